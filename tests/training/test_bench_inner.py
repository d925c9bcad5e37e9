"""scripts/bench_inner.py (the GPU throughput/MFU benchmark) runs end to end on CPU with the tiny
preset, so a session lent a GPU can trust it in its one prepared device run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_kit import load_script

from training.model import ModelConfig


def test_both_loops_run_and_mfu_follows_the_stated_formula(tmp_path: Path) -> None:
    bench = load_script("bench_inner")
    out = tmp_path / "inner.json"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--steps", "2", "--repeats", "2", "--warmup", "1",
                       "--seq-len", "32", "--peak-tflops", "1.0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    tiny = ModelConfig.preset("tiny")
    per_token = 6 * tiny.num_params() + 12 * tiny.n_layers * tiny.dim * 32
    assert report["config"]["flops_per_token"] == per_token
    assert [r["name"] for r in report["runs"]] == ["bare_pytorch", "inner_trainer"]
    for r in report["runs"]:
        assert len(r["tokens_per_s_all"]) == 2 and r["tokens_per_s"] > 0
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 1e12)
    assert report["trainer_vs_bare"] == pytest.approx(
        report["runs"][1]["tokens_per_s"] / report["runs"][0]["tokens_per_s"]
    )


def test_a_sequence_longer_than_the_preset_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_script("bench_inner").main(["--preset", "tiny", "--device", "cpu", "--seq-len", "4096"])
    assert "exceeds the tiny preset's max_seq_len 64" in capsys.readouterr().err
