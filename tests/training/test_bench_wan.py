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


def test_the_step_taken_ahead_of_the_update_runs_while_the_update_is_in_flight() -> None:
    bench = load_script("bench_wan")
    # The update is there 6 s after a round's training ends (3 s up, 1 s close, 2 s down). 9 s of step
    # after it: 15 s > 10 s of compute, so every other round waits 5 s (rounds end at 10, 20, 35, 45, 60, 70).
    after = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(bench, apply_s=9.0))
    assert after["utilisation"] == pytest.approx(60 / 70, abs=0.003)
    # The same 9 s with 7 of them taken ahead, from when the base is released (the next round's start),
    # beside the transfers: max(6, 7) + 2 = 9 s < 10 s, hidden.
    ahead = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(bench, apply_s=2.0, ahead_s=7.0))
    assert ahead["utilisation"] == 1.0
    # Taken ahead but longer than the transfers, it is what the next round waits for: 9 + 2 = 11 s from
    # a round's start, so from round 3 on each starts 1 s late (rounds end at 10, 20, 31, 42, 53, 64).
    long = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(bench, apply_s=2.0, ahead_s=9.0))
    assert long["utilisation"] == pytest.approx(60 / 64, abs=0.003)


def test_an_eager_round_waits_for_its_forecast_and_the_step_it_previews() -> None:
    bench = load_script("bench_wan")
    # The update is there 6 s after a round's training ends. Taken ahead (3 s, right after the model
    # before, by the thread that computed it), finished in 1 s, the forecast written over it in 0.5 s on
    # the training path (round 2: 2 s, nothing taken ahead yet): rounds start at 0, 12, 22.5, 33, 43.5,
    # 54 and end 10 s later.
    ahead = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", timing(
        bench, ahead_s=3.0, apply_s=1.0, forecast_s=0.5, first_forecast_s=2.0))
    assert ahead["utilisation"] == pytest.approx(60 / 64, abs=0.003)
    assert ahead["utilisation_per_round"][2:] == pytest.approx([10 / 10.5] * 4, abs=0.003)
    # The whole step after the update (3 s + 1 s of hash) and a forecast stepping a copy (3 s): the model
    # after r − 2 is there in time, the forecast is not (rounds start at 0, 13, 26, 39, 52, 65).
    whole = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", timing(bench, apply_s=4.0, forecast_s=3.0))
    assert whole["utilisation"] == pytest.approx(60 / 75, abs=0.003)
    # "delayed" has no forecast, and takes the step ahead beside its upload: the same work fits.
    assert bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(
        bench, ahead_s=3.0, apply_s=1.0, forecast_s=0.5, first_forecast_s=2.0))["utilisation"] == 1.0
    # Eager takes round 3's step right after the model before it (5 s), and round 3 waits for it; from round
    # 4 on that step was taken ahead of the update beside the upload (5 s from the base's release, handed
    # with it) and is only fixed at its entries after the finish (0 s here): rounds start at 0, 12, 25.5,
    # 36, 46.5, 57 (before the step was taken ahead of the update: ..., 36.5, 50, 61). "Delayed" takes it
    # from the base's release beside the transfers: max(6, 5) + 3 = 9 s < 10 s, hidden.
    slow = timing(bench, ahead_s=5.0, apply_s=3.0, forecast_s=0.5, first_forecast_s=2.0)
    assert bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", slow)["utilisation"] == 1.0
    assert bench.simulate("8/8", 3_000_000, 2_000_000, "eager", slow)["utilisation"] == pytest.approx(60 / 67, abs=0.003)
    # A fix of 2 s: each step is there 2 s after the model before it, from round 4 on (rounds start at
    # ..., 36, 47, 57.5: round 5 waits for the model after round 3, ready at 44.5 s, and the fix).
    fixed = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", bench.dataclasses.replace(slow, fix_s=2.0))
    assert fixed["utilisation"] == pytest.approx(60 / 67.5, abs=0.003)


def test_the_round_s_seal_delays_its_upload_and_the_next_round_in_every_mode() -> None:
    bench = load_script("bench_wan")
    # 3 s of seal after each round's 10 s of training: the upload (3 s) starts 3 s later and, with
    # overlap, the next round too: 13 s a round, and the transfers (3 + 1 + 2 + 2 = 8 s) still fit behind.
    delayed = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(bench, seal_s=3.0))
    assert delayed["round_wall_s"] == pytest.approx(13.0, abs=0.01)
    assert delayed["utilisation"] == pytest.approx(60 / (6 * 13 - 3), abs=0.002)  # the last seal is after
    # Without overlap the seal comes before the upload: 10 + 3 + 3 + 1 + 2 + 2 = 21 s a round.
    off = bench.simulate("8/8", 3_000_000, 2_000_000, "off", timing(bench, seal_s=3.0))
    assert off["round_wall_s"] == pytest.approx(21.0, abs=0.03)
    # The measured seal is the codec's; the round's save and the snapshot are the host's.
    measured = {"step_s": 30.0, "ahead_s": 31.0, "finish_s": 3.0, "finish_after_forecast_s": 6.0,
                "forecast_s": 5.0, "sha256_s": 4.0, "decode_s": {"int8": 2.0, "top-k": 1.0},
                "move_add_s": 0.8, "move_onto_s": 1.6, "forecast_shift_s": 0.6, "fix_s": 0.7,
                "seal": {"seal_s": {"int8": 20.0, "top-k": 12.0}, "root_s": {"int8": 3.0, "top-k": 2.0},
                         "save_s": 8.0, "snapshot_s": 9.0, "pseudo_gradient_s": 1.5}}
    got = bench.host_timing(timing(bench), measured, "eager", True, "int8")
    assert (got.seal_s, got.keep_s, got.save_s) == (20.0, 11.0, 9.0)  # the root is hashed with the save
    # a late forecast's: the pseudo-gradient, the +0 step where none was taken ahead, the move (added)
    assert (got.pseudo_s, got.zero_s, got.shift_s, got.move_s, got.fix_s) == (1.5, 31.0, 0.6, 0.8, 0.7)
    whole = bench.host_timing(timing(bench), measured, "eager", False, "int8")  # no step ahead to write over
    assert (whole.shift_s, whole.move_s, whole.fix_s) == (0.0, 1.6, 0.0)  # the difference taken and added
    halved = bench.host_timing(timing(bench), bench.scaled_host(measured, 0.5), "delayed", True)
    assert (halved.seal_s, halved.keep_s, halved.save_s, halved.apply_s) == (6.0, 5.0, 4.5, 3.5)
    assert (halved.pseudo_s, halved.zero_s, halved.shift_s, halved.move_s) == (0.75, 15.5, 0.3, 0.4)


def test_the_saves_are_written_behind_on_one_writer_and_the_upload_waits_for_its_round_s() -> None:
    bench = load_script("bench_wan")
    # Without overlap the round's save (2 s) is on the path before the upload: 10 + 1 + 2 + 3 + 1 + 2 + 2
    # = 21 s a round; the snapshot (4 s) is written behind and costs nothing.
    off = bench.simulate("8/8", 3_000_000, 2_000_000, "off", timing(bench, seal_s=1.0, keep_s=2.0, save_s=4.0))
    assert off["round_wall_s"] == pytest.approx(21.0, abs=0.03)
    # With overlap only the seal (1 s) is on the path: 11 s a round; the save (2 s) and the snapshot
    # (4 s) share the writer, 6 s of every 11, and the upload (3 s) starts after the save: 2 + 3 + 1 + 2
    # + 2 = 10 s after the seal, behind the next round's 11.
    fits = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed", timing(bench, seal_s=1.0, keep_s=2.0, save_s=4.0))
    assert fits["round_wall_s"] == pytest.approx(11.0, abs=0.01)
    # A writer slower than the round (keep 5 s + snapshot 7 s = 12 s of every 11): the saves queue, the
    # uploads wait longer every round and the rounds end up waiting for their bases.
    slow = bench.simulate("8/8", 3_000_000, 2_000_000, "delayed",
                          timing(bench, seal_s=1.0, keep_s=5.0, save_s=7.0, rounds=12))
    assert slow["utilisation"] < fits["utilisation"] - 0.02


def test_the_host_steps_ahead_only_with_overlap_and_a_sparse_broadcast() -> None:
    bench = load_script("bench_wan")
    topk, int8 = bench.CODECS["top-k"], bench.CODECS["int8"]
    assert bench.speculates("delayed", "codec", topk) and bench.speculates("eager", "codec", topk)
    assert not bench.speculates("eager", "codec", "mask")  # a quarter of the entries: about a whole step
    assert not bench.speculates("delayed", "dense", topk)  # a dense update: every entry recomputed
    assert not bench.speculates("eager", "codec", int8)
    assert not bench.speculates("off", "codec", topk)
    measured = {"step_s": 30.0, "ahead_s": 31.0, "finish_s": 3.0, "finish_after_forecast_s": 6.0,
                "forecast_s": 5.0, "sha256_s": 4.0, "decode_s": {"int8": 2.0, "top-k": 1.0},
                "move_add_s": 0.8, "move_onto_s": 1.6, "forecast_shift_s": 0.6, "fix_s": 0.7}
    t = timing(bench, ahead_s=5.0, forecast_s=7.0)

    def placed(overlap: str, speculated: bool, codec: str = "top-k", broadcast: str = "codec"
               ) -> tuple[float, float, float, float | None]:
        got = bench.host_timing(t, measured, overlap, speculated, codec, broadcast)
        return got.ahead_s, got.apply_s, got.forecast_s, got.first_forecast_s

    assert placed("eager", True) == (31.0, 10.0, 5.0, 31.0)  # round 2's forecast: a decode and a whole step
    assert placed("delayed", True) == (31.0, 7.0, 0.0, None)
    assert placed("eager", False, "int8") == (0.0, 36.0, 32.0, None)
    assert placed("eager", False, "top-k", "dense") == (0.0, 34.0, 31.0, None)  # the own payload is decoded
    assert placed("off", False, "int8", "dense") == (0.0, 34.0, 0.0, None)
    assert bench.host_timing(t, None, "delayed", False).ahead_s == 0.0
    assert bench.host_timing(t, None, "delayed", True).forecast_s == 0.0
    assert bench.host_timing(t, None, "eager", True) == bench.dataclasses.replace(t, zero_s=t.apply_s)


def test_the_reported_payloads_are_the_codecs_sizes_for_the_1b_shapes() -> None:
    bench = load_script("bench_wan")
    spec = bench.llama_1b_spec()
    params = sum(math.prod(s) for s in spec.values())
    assert 1.23e9 < params < 1.24e9  # Llama-3.2-1B: 1,235,814,400
    topk = get_codec(bench.CODECS["top-k"])
    assert bench.checked_size(topk, spec) == topk.encoded_size(spec) < params * 4 / 50


def test_the_host_s_work_is_timed_on_each_tensor_size_of_the_model_and_counted_per_tensor() -> None:
    """Not one small tensor scaled: each size class of the 1B shapes once, at its real size, times how many
    tensors have it; `prepare` untimed; the median over the rounds."""
    bench = load_script("bench_wan")
    classes = bench.shape_classes(bench.llama_1b_spec())
    assert classes[:2] == [(128_256 * 2048, 1), (2048 * 8192, 48)]  # the tied embedding, the MLP projections
    assert sum(n * c for n, c in classes) == 1_235_814_400
    now = [0.0]
    slow = iter([3, 3, 1, 1, 2, 2])  # per round, per class: the median round is the one of factor 2

    def build(numel: int):  # type: ignore[no-untyped-def]
        def work(arg: int) -> None:
            now[0] += numel * next(slow) + arg

        def prepare() -> int:
            now[0] += 10**9  # not timed
            return 0

        return {"work": (work, prepare)}

    got = bench.measure_classes([(100, 3), (7, 2)], build, repeat=3, clock=lambda: now[0])
    assert got == {"work": 2 * (100 * 3 + 7 * 2)}


def test_an_eager_round_with_a_merge_waits_there_for_the_model_after_the_round_before() -> None:
    bench = load_script("bench_wan")
    eager = timing(bench, ahead_s=3.0, apply_s=1.0, forecast_s=0.5, first_forecast_s=2.0)
    plain = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", eager)
    # Round 1 ends at 10 s; its upload takes 3 s, the close 1 s, the download 2 s: the update is there at
    # 16 s, and the step taken ahead (from 12 s, 3 s) is finished 1 s later: the model after round 1 is
    # ready at 17 s. Round 2 starts at 12 s (2 s of first forecast); merging at step 25 (12 + 2.5 s) it
    # waits until 17 s and ends 7.5 s later, at 24.5 s; round 1 never waits (it merges onto the model held).
    early = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", bench.dataclasses.replace(eager, merge_step=25))
    assert early["utilisation_per_round"][:2] == pytest.approx([1.0, 10 / 14.5], abs=0.003)
    assert early["utilisation"] < plain["utilisation"]
    # Merging at step 80 (12 + 8 s = 20 s > 17 s) the model is there: no round waits more than without.
    late = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", bench.dataclasses.replace(eager, merge_step=80))
    assert late["utilisation_per_round"] == plain["utilisation_per_round"]


def test_a_late_forecast_s_round_waits_for_the_pseudo_gradient_and_its_seal_only_at_the_forecast_step() -> None:
    bench = load_script("bench_wan")
    host = {"ahead_s": 3.0, "apply_s": 1.0, "forecast_s": 0.5, "first_forecast_s": 2.0, "seal_s": 3.0,
            "pseudo_s": 0.5, "zero_s": 3.0, "move_s": 0.2}
    plain = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", timing(bench, **host))
    # Plain eager: round 2 waits for round 1's seal (10 + 3 s) and its first forecast (2 s): 15 s a round.
    assert plain["utilisation_per_round"][1] == pytest.approx(10 / 15, abs=0.003)
    late = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", timing(bench, **host, forecast_step=25))
    # Round 2 starts after round 1's pseudo-gradient, at 10.5 s (its +0 step of the initial model was taken
    # beside round 1, from its start: ready at 3 s); round 1's seal is done at 13 s, the forecast
    # written over the +0 step at 13.5 s, after step 25 (13 s): the move (0.2 s) at 13.5 s, the end at
    # 21.2 s, 11.2 s after round 1's. Every round after it alike: its +0 step was taken beside the upload
    # before it (`take_after`), ready soon after the model before (at 20 s for round 3, which starts at
    # 21.7 s); what the round waits for is its seal, 0.5 s longer than the first 25 steps.
    assert late["utilisation_per_round"] == pytest.approx([1.0] + [10 / 11.2] * 5, abs=0.003)
    # A seal that fits in the first 25 steps (2 s): only the pseudo-gradient and the move stay on the path
    # (10.7 s a round), as long as the model it starts from is there (the upload and the step ahead).
    quick = bench.simulate("8/8", 3_000_000, 2_000_000, "eager", timing(bench, **(host | {"seal_s": 2.0}),
                                                                            forecast_step=25, rounds=8))
    assert quick["utilisation_per_round"][1:] == pytest.approx([10 / 10.7] * 7, abs=0.003)
    assert quick["utilisation"] > late["utilisation"] > plain["utilisation"]
