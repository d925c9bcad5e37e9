"""scripts/bench_data.py runs end to end on a small corpus and reports what docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_data.py"


@pytest.mark.slow
def test_bench_reports_prepare_and_loader_rates_per_source(tmp_path: Path) -> None:
    out = tmp_path / "data.json"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--corpus-mb", "0.5", "--vocab", "300",
                    "--rounds", "1", "--cache-mb", "4", "--workers", "1", "--work-dir", str(tmp_path / "work")],
                   check=True, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    assert report["corpus_bytes"] >= 0.5 * 2**20
    assert report["prepare_tokens_per_s"] == report["prepare"]["prepare_tokens_per_s"] > 0
    assert set(report["sources"]) == {"local", "local_half", "s3"}
    assert report["loader_tokens_per_s"] == report["sources"]["local"]["loader_tokens_per_s"]
    for source in report["sources"].values():
        assert source["tokens"] == 512 * 2048  # one round of 512 windows, inputs only
        assert source["shard_downloads"] >= 1 and source["peak_rss_mb"] > 0
    assert report["meets_target"] == {name: s["loader_tokens_per_s"] >= 690_000 for name, s in report["sources"].items()}
    manifest = json.loads((tmp_path / "work" / "dataset" / "manifest.json").read_text())
    assert sum(s["tokens"] for s in manifest["train"] + manifest["heldout"]) == report["prepare"]["tokens"]
