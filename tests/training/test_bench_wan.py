"""scripts/bench_wan.py: the utilisation timeline on hand-checkable numbers, and the payload sizes it
reports are the real codecs' for the 1.2B shapes."""

from __future__ import annotations

import math

import pytest
from script_kit import load_script

from training.codecs import get_codec


def timing(bench, **kw):  # type: ignore[no-untyped-def]
    base = {"steps": 100, "step_s": 0.1, "close_s": 1.0, "apply_s": 2.0, "save_s": 0.0, "rounds": 6,
            "latency_ms": 0.0}
    return bench.Timing(**(base | kw))


def test_without_overlap_a_round_waits_for_upload_close_download_and_apply() -> None:
    bench = load_script("bench_wan")
    # 8/8 Mbit/s = 1 MB/s each way: 3 MB up and 2 MB down take 3 s and 2 s (less the 10 ms burst).
    got = bench.simulate("8/8", 3_000_000, 2_000_000, "off", timing(bench))
    round_s = 10 + 3 + 1 + 2 + 2  # compute, upload, close, download, apply
    assert got["round_wall_s"] == pytest.approx(round_s, abs=0.03)
    assert got["utilisation"] == pytest.approx(6 * 10 / (10 + 5 * round_s), abs=0.002)


def test_with_overlap_the_round_hides_what_fits_in_its_compute() -> None:
    bench = load_script("bench_wan")
    fits = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(bench))  # 3 + 1 + 2 + 2 < 10 s
    assert fits["utilisation"] == 1.0
    # 9 s up + 1 s close + 2 s down + 2 s apply = 14 s > 10 s. By hand: rounds end at 10, 20, 34, 44, 58,
    # 68, 82, 92 s (every other round waits 4 s for its base: the wait also absorbs the next one's lag).
    slow = bench.simulate("8/8", 9_000_000, 2_000_000, "delayed", timing(bench, rounds=8))
    assert slow["utilisation"] == pytest.approx(80 / 92, abs=0.003)
    assert slow["utilisation_per_round"][2:] == pytest.approx([10 / 14, 1.0] * 3, abs=0.003)


def test_the_reported_payloads_are_the_codecs_sizes_for_the_1b_shapes() -> None:
    bench = load_script("bench_wan")
    spec = bench.llama_1b_spec()
    params = sum(math.prod(s) for s in spec.values())
    assert 1.23e9 < params < 1.24e9  # Llama-3.2-1B: 1,235,814,400
    topk = get_codec(bench.CODECS["top-k"])
    assert bench.checked_size(topk, spec) == topk.encoded_size(spec) < params * 4 / 50
