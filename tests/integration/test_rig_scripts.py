"""The rig's benchmark and the prepared GPU check run end to end on this CPU (gloo, tiny presets), so
the JSON they promise is there when a session runs them for their numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # four rig starts (persistent sharded and replicated, two relaunches): ~1-2 min
@pytest.mark.multiprocess
def test_bench_rig_writes_the_issues_keys(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_rig.py", "--preset", "tiny", "--rounds", "2", "--inner-steps", "2",
         "--seq-len", "32", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a speed target missed on a loaded machine
    report = json.loads(out.read_text())
    assert report["sharded_vs_single"]["payload_equal"] is True
    assert report["sharded_vs_single"]["max_abs_loss_diff"] == 0.0
    assert report["sharded_vs_single"]["relaunched_payload_equal"] is True
    assert report["persistent"]["round_overhead_s"] >= 0 and report["relaunch"]["round_overhead_s"] > 0
    state = report["state_mb_per_process"]
    assert 0.45 * state["replicated"] <= state["sharded"] <= 0.6 * state["replicated"]
    assert set(report["peak_rss_per_process_mb"]) == {"replicated", "sharded"}
    assert report["plan_check"]["state_planned_over_measured"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.slow  # three steps, two of them start processes: ~1 min
@pytest.mark.multiprocess
def test_gpu_check_dry_run_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert {name: report[name]["status"] for name in ("inner", "fsdp", "rig")} == dict.fromkeys(
        ("inner", "fsdp", "rig"), "ok")
    assert report["fsdp"]["result"]["gpus"] == 2 and report["fsdp"]["result"]["finite"]
    held, planned = report["fsdp"]["result"]["held_state_gb_per_gpu"], report["fsdp"]["result"]["planned_state_gb_per_gpu"]
    assert all(h == pytest.approx(planned, rel=0.05) for h in held)
    assert all(row["payload_equal"] for row in report["rig"]["result"]["sharded_vs_one_gpu"])  # fp32 on CPU
