"""scripts/bench_sparse_replay.py on one short top-k epoch: the residual check accepts the honest hosts
that the old dense comparison refuses, and refuses the cheats that skip training or scale their update."""

from __future__ import annotations

import json
from pathlib import Path

from script_kit import load_script


def test_honest_hosts_pass_on_sampled_chunks_and_skipping_or_scaling_fails(tmp_path: Path) -> None:
    bench = load_script("bench_sparse_replay")
    out = tmp_path / "bench.json"
    lines: list[str] = []
    bench.main(["--out", str(out), "--codecs", "topk:chunk=4096,k=128,bits=2", "--decays", "0.9", "--rounds", "2",
                "--hosts", "2", "--inner-steps", "3", "--corpus-bytes", "60000", "--fractions", "0.05", "1"],
               out=lines.append)
    summary = json.loads(out.read_text())["epochs"][0]["summary"]
    assert summary["honest"]["f=0.05"]["accepted"] == summary["honest"]["f=1"]["accepted"] == 4
    assert summary["honest"]["old_dense"]["accepted"] == 0  # what the network's replay sees today
    assert summary["honest"]["f=1"]["cosine"][0] > 1 - 1e-9
    for cheat in ("skip", "scaled", "forged", "copy"):
        assert summary[cheat]["f=0.05"]["accepted"] == summary[cheat]["f=1"]["accepted"] == 0
    assert summary["scaled"]["f=1"]["norm_ratio"][0] > 1.99
    assert summary["copy"]["f=1"]["payloads_fit"] == 0  # someone else's payload does not fit its residual
    honest_line = lines[0].splitlines()[1]  # old dense | f = 5 % | f = 100 %
    assert honest_line.startswith("  honest  0/4 ") and honest_line.count("| 4/4 ") == 2
