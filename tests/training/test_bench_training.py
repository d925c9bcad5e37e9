"""scripts/bench_training.py end to end on a small corpus with a few steps: the warm start shares one
checkpoint per seed, the comparison continues on the data after the pre-training's, and parallel
jobs give the same numbers as one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from script_kit import load_script
from stdlib_corpus import write_small_corpus


def run(tmp_path: Path, name: str, *extra: str) -> dict[str, Any]:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        write_small_corpus(corpus)
    out = tmp_path / f"{name}.json"
    argv = ["--corpus", str(corpus), "--methods", "ddp", "--extra", "i8|int8:block=256|2|0.9|0.5",
            "--steps", "4", "--ddp-eval-every", "2", "--micro-batch", "2", "--workers", "2",
            "--eval-windows", "8", "--warmup", "1", "--out", str(out), *extra]
    assert load_script("bench_training").main(argv) == 0
    return json.loads(out.read_text())


def test_warm_start_shares_one_checkpoint_and_reports_progress(tmp_path: Path) -> None:
    scratch = run(tmp_path, "scratch")
    warm = run(tmp_path, "warm", "--warm-start", "4")
    assert warm["config"]["warm_start"] == 4
    by_name = {r["name"]: r for r in warm["per_seed"]}
    # Both methods start from the same pre-trained weights, which are better than the random init.
    assert by_name["ddp"]["start_loss"] == by_name["i8"]["start_loss"]
    assert by_name["ddp"]["start_loss"] < scratch["per_seed"][0]["start_loss"] - 0.1
    # The continuation is not the from-scratch run: other weights, other windows.
    assert by_name["ddp"]["final_loss"] != scratch["per_seed"][0]["final_loss"]
    summary = {r["name"]: r for r in warm["runs"]}
    assert summary["ddp"]["progress_vs_ddp"] == pytest.approx(1.0)
    start, ddp_final = by_name["ddp"]["start_loss"], by_name["ddp"]["final_loss"]
    assert summary["i8"]["progress_vs_ddp"] == pytest.approx(
        (start - by_name["i8"]["final_loss"]) / (start - ddp_final)
    )
    assert summary["i8"]["loss_vs_ddp"] == pytest.approx(by_name["i8"]["final_loss"] / ddp_final - 1)


def test_continuation_reads_the_windows_after_the_pretraining(tmp_path: Path) -> None:
    bench = load_script("bench_training")
    seen: list[int] = []
    windows_batches = bench.Windows.batches

    def record(self, ids, micro_batch):  # type: ignore[no-untyped-def]
        seen.extend(int(i) for i in ids)
        return windows_batches(self, ids, micro_batch)

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_small_corpus(corpus)
    args = bench.argparse.Namespace(
        model="bench", steps=4, micro_batch=2, workers=2, lr=1e-3, diloco_lr=1e-3, pretrain_lr=1e-3,
        warmup=1, eval_windows=4, ddp_eval_every=2, warm_start=4,
    )
    windows = bench.load_windows(corpus, 64)
    heldout = set(windows.sample_heldout(0, 4).tolist())
    bench.Windows.batches = record
    try:
        state = bench.pretrain(args, windows, 0)
        pretrained = [i for i in seen if i not in heldout]
        seen.clear()
        bench.run_method(bench.METHODS["ddp"], args, windows, 0, state)
        continued = [i for i in seen if i not in heldout]
    finally:
        bench.Windows.batches = windows_batches
    assert len(pretrained) == len(continued) == 4 * 2 * 2  # steps × workers × micro-batch
    assert not set(pretrained) & set(continued)
    # Exactly the stream's next rounds: rounds 2 and 3 of H = 2 steps after the pre-training's 0 and 1.
    expected = [
        int(i)
        for r in (2, 3)
        for i in np.stack(
            [windows.assignment(epoch_seed=0, round_index=r, slot=s, max_slots=2, windows_per_host=4).reshape(2, 2)
             for s in range(2)],
            axis=1,
        ).reshape(-1)
    ]
    assert continued == expected


@pytest.mark.slow
def test_parallel_jobs_give_the_numbers_of_one_process(tmp_path: Path) -> None:
    one = run(tmp_path, "one", "--warm-start", "2")
    two = run(tmp_path, "two", "--warm-start", "2", "--jobs", "2")
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in one["per_seed"]]
    assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in two["per_seed"]]


def test_a_warm_start_off_the_round_grid_is_refused_before_any_training(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, "bad", "--warm-start", "3")
    assert str(exc.value) == "--warm-start 3 must be a multiple of ddp's H = 2"
    assert not (tmp_path / "bad.json").exists()


def test_a_streamed_method_trains_rounds_of_h_over_p_steps_and_syncs_each_fragment_every_h() -> None:
    bench = load_script("bench_training")
    method = bench.METHODS["diloco-topk-stream3-delayed"]
    args = bench.argparse.Namespace(model="bench", steps=60, warm_start=30, ddp_eval_every=30, micro_batch=2,
                                    workers=2, eval_windows=4, warmup=1, lr=1e-3, diloco_lr=1e-3)
    assert bench.check_schedule(method, args) == 10  # the data stream's round: 10 steps
    recipe = bench._config(args, 0, method, args.steps, 10).recipe
    assert (recipe.inner_steps, recipe.n_rounds, recipe.stream_fragments, recipe.stream_mix, recipe.overlap) == \
        (10, 6, 3, 0.5, "delayed")
    with pytest.raises(SystemExit, match="H = 30 is not a multiple of its 4 fragments"):
        bench.check_schedule(bench.Method("odd", "int8", 30, fragments=4), args)


def test_an_extra_method_may_stream_and_a_bad_field_is_refused_in_one_line() -> None:
    bench = load_script("bench_training")
    method = bench.parse_extra("i8-s5|int8:block=256|30|0.9|0.5|1.0|0.0015|5")
    assert (method.sync_every, method.fragments, method.round_steps, method.inner_lr) == (30, 5, 6, 0.0015)
    assert bench.parse_extra("i8|int8|30").fragments == 1
    with pytest.raises(SystemExit, match=r"--extra 'i8\|int8\|30\|x': could not convert string to float"):
        bench.parse_extra("i8|int8|30|x")
