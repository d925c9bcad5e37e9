"""scripts/bench_wan_stream.py on the committed bench_wan report: P = 1 is bench_wan's own row, and a
streamed round carries the largest fragment's real payload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_kit import load_script

REPO = Path(__file__).resolve().parents[2]
WAN = REPO / "docs" / "bench_wan.json"


def test_one_fragment_is_bench_wan_s_row_and_two_halve_every_round_s_bytes(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    assert load_script("bench_wan_stream").main(["--measured", str(WAN), "--out", str(out), "--fragments", "1,2"]) == 0
    report = json.loads(out.read_text())
    rows = {(r["fragments"], r["fragment"], r["link"], r["codec"], r["overlap"]): r for r in report["runs"]}
    assert {key[:2] for key in rows} == {(1, "mean"), (2, "mean"), (2, "largest")}
    wan = json.loads(WAN.read_text())
    seal = wan["apply_measured"]["seal"]
    for (p, _kind, link, codec, overlap), row in rows.items():
        if p == 1:
            same = next(r for r in wan["runs"] if (r["link"], r["codec"], r["overlap_mode"], r["broadcast"],
                                                   r["merge_step"], r["forecast_step"]) == (link, codec, overlap, "codec", 0, 0))
            assert (row["utilisation"], row["upload_bytes"]) == (same["utilisation"], same["upload_bytes"])
            continue
        whole = rows[(1, "mean", link, codec, overlap)]
        assert row["upload_bytes"] == row["download_bytes"]
        assert 0.5 <= row["upload_bytes"] / whole["upload_bytes"] < 0.51
        assert row["steps_per_round"] == whole["steps_per_round"] // 2
        # the fragment's work and the close at its share; the writer whole (moments, own model), no root
        assert row["close_s"] == pytest.approx(wan["timing"]["close_s"] * row["share"], abs=0.01)
        assert row["keep_s"] == pytest.approx(2 * seal["save_s"], abs=0.01)
        assert row["snapshot_s"] == pytest.approx(1.5 * seal["snapshot_s"], abs=0.01)
        assert row["seal_s"] == pytest.approx(seal["seal_s"][codec] * row["share"], abs=0.01)
        assert rows[(2, "largest", link, codec, overlap)]["upload_bytes"] >= rows[(2, "mean", link, codec, overlap)]["upload_bytes"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--fragments", "1,x"], "--fragments '1,x': a comma-separated list of positive integers"),
    (["--fragments", "3"], "H = 500 is not a multiple of 3 fragments"),
])
def test_bad_arguments_are_refused_in_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        load_script("bench_wan_stream").main(["--measured", str(WAN), "--out", str(tmp_path / "o.json"), *argv])
    assert not (tmp_path / "o.json").exists()


def test_a_report_without_measured_host_work_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "wan.json"
    bad.write_text(json.dumps({"timing": {}, "apply_measured": {}}))
    with pytest.raises(SystemExit, match="not a bench_wan report written with --apply-measured"):
        load_script("bench_wan_stream").main(["--measured", str(bad), "--out", str(tmp_path / "o.json")])
