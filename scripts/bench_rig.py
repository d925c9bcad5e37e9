"""A rig on CPU (gloo): sharded against one process, a persistent rig against one relaunched per round.

Model `--preset` (default 12m: 12.8M parameters), `--procs` processes (default 2), `--rounds` rounds
(default 3) of the host's real path (`gonka_node.host.rig_round`: torchrun, the mailbox, state
versions on disk), int8 payloads with error feedback, AdamW state carried across rounds:

- `sharded_vs_single`: the sharded rig's per-step losses and payloads against `LocalRounds` (one process);
- `persistent.round_overhead_s`: per round, what the daemon waits beyond the inner loop's own seconds,
  with the rig started once (its one-time start is `persistent.start_s`);
- `relaunch.round_overhead_s`: the same with a fresh torchrun job per round (the rig before this
  design): start, model build, data, state load, round, stop — all of it paid every round;
- `state_mb_per_process` / `peak_rss_per_process_mb`: parameters, gradients and AdamW state a process
  holds (measured tensor by tensor), and its peak RSS, replicated and sharded (largest process);
- `plan_check`: the same state and the activations of one micro-batch as `training.plan` predicts
  them (fp32 on CPU) over what was measured.

    .venv/bin/python scripts/bench_rig.py --out bench_rig.json

Exits 1 when a target is missed: sharded state ≤ 0.6 × replicated, persistent overhead ≤ 0.2 × relaunch,
payloads equal, plan within 25 %.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file

from gonka_node.core.recipe import Recipe
from gonka_node.host.rig_round import LocalRounds, RigOptions, RigRounds, make_worker
from training.model import ModelConfig, build_model
from training.plan import Dtypes, activation_bytes, measure_activation_bytes, plan_rig
from training.worker import Assignment

CORPUS_FILES = ("argparse.py", "textwrap.py", "shlex.py", "difflib.py", "pathlib.py", "typing.py")


@dataclass
class Run:
    """One way of training the rounds: payloads, per-step losses, per-round waits and the rig's reports."""

    payloads: list[bytes] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)
    start_s: float = 0.0


def _recipe(work: Path, args: argparse.Namespace) -> Recipe:
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    corpus = work / "corpus.txt"
    corpus.write_bytes(b"".join((lib / name).read_bytes() for name in CORPUS_FILES))
    return Recipe(
        model=ModelConfig.preset(args.preset), corpus=str(corpus), seq_len=args.seq_len, micro_batch=args.micro_batch,
        grad_accum=args.procs, inner_steps=args.inner_steps, inner_lr=1e-3, warmup_steps=2, n_rounds=args.rounds,
        codec="int8", ef_decay=0.9,
    ).with_data_manifest(work / "cache")


def _globals(recipe: Recipe, work: Path, rounds: int) -> list[tuple[dict[str, torch.Tensor], Path]]:
    """A different global model per round (the initial one, nudged), in memory and as the daemon's file."""
    base = {n: p.detach() for n, p in build_model(recipe.model, recipe.init_seed).named_parameters()}
    out = []
    for r in range(1, rounds + 1):
        params = {n: t + 1e-3 * r * torch.sin(torch.arange(t.numel()).reshape(t.shape) * 0.1 * r) for n, t in base.items()}
        path = work / f"global-{r}.safetensors"
        save_file(params, str(path))
        out.append((params, path))
    return out


def _returns(path: Path) -> Callable[[], Path]:
    return lambda: path


def _local(recipe: Recipe, assignment: Assignment, work: Path, models: list[Any]) -> Run:
    rounds, run = LocalRounds(make_worker(recipe, assignment, work / "cache")), Run()
    for r, (params, path) in enumerate(models, start=1):
        result = rounds.train_round(r, params, _returns(path), lambda s, loss: run.losses.append(loss))
        run.payloads.append(result.payload)
    return run


def _rig_round(rig: RigRounds, r: int, params: Any, path: Path, run: Run) -> None:
    """Train round r; records what the daemon waited beyond the inner loop's own seconds."""
    started = time.perf_counter()
    result = rig.train_round(r, params, lambda: path, lambda s, loss: run.losses.append(loss))
    assert rig.last_report is not None
    run.overheads.append(time.perf_counter() - started - rig.last_report.seconds)
    run.payloads.append(result.payload)
    run.reports.append(rig.last_report)


def _persistent(options: RigOptions, recipe: Recipe, assignment: Assignment, work: Path, models: list[Any]) -> Run:
    rig, run = RigRounds(options, recipe, assignment, work / "cache", work / f"rig-{options.sharding}"), Run()
    started = time.perf_counter()
    rig.start()
    try:
        rig.wait_ready(timeout_s=600.0)
        run.start_s = time.perf_counter() - started
        for r, (params, path) in enumerate(models, start=1):
            _rig_round(rig, r, params, path, run)
    finally:
        rig.close()
    return run


def _relaunched(options: RigOptions, recipe: Recipe, assignment: Assignment, work: Path, models: list[Any]) -> Run:
    run = Run()
    for r, (params, path) in enumerate(models, start=1):
        rig = RigRounds(options, recipe, assignment, work / "cache", work / "rig-relaunch")
        rig.load_state_dict({"rig": {"base": r - 1, "procs": options.procs}})  # the state on disk goes on
        started = time.perf_counter()
        rig.start()
        try:
            _rig_round(rig, r, params, path, run)
        finally:
            rig.close()
        run.overheads[-1] = time.perf_counter() - started - run.reports[-1].seconds  # start and stop included
    return run


def mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 3)


def _mb(n: float) -> float:
    return round(n / 2**20, 2)


def _largest(run: Run, key: str) -> float:
    last = run.reports[-1].ranks
    if key == "held":
        return max(sum(rank["held_bytes"].values()) for rank in last)
    return max(rank["peak_rss_mb"] for rank in last)


def _plan_check(recipe: Recipe, procs: int, sharded: Run) -> dict[str, float]:
    plan = plan_rig(recipe.model, gpus=procs, gpu_mem_gb=1e6, micro_batch=recipe.micro_batch,
                    seq_len=recipe.seq_len, sharded=True, checkpoint_activations=False, device="cpu")
    planned_state = sum(plan.bytes_per_gpu[k] for k in ("parameters", "gradients", "optimizer"))
    tokens = recipe.micro_batch * recipe.seq_len
    measured_act = measure_activation_bytes(recipe.model, recipe.micro_batch, recipe.seq_len, checkpoint=False)
    return {
        "state_planned_over_measured": round(planned_state / _largest(sharded, "held"), 4),
        "activations_planned_over_measured": round(activation_bytes(recipe.model, tokens, Dtypes(4, 4), False)
                                                   / measured_act, 4),
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_rig.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="12m")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder, removed after")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    recipe = _recipe(work, args)
    assignment = Assignment(recipe.epoch_seed, slot=0, max_slots=4)
    models = _globals(recipe, work, args.rounds)
    single = _local(recipe, assignment, work, models)
    sharded = _persistent(RigOptions(args.procs, "sharded"), recipe, assignment, work, models)
    replicated = _persistent(RigOptions(args.procs, "replicated"), recipe, assignment, work, models)
    relaunch = _relaunched(RigOptions(args.procs, "sharded"), recipe, assignment, work, models)
    return {
        "config": {"preset": args.preset, "params": recipe.model.num_params(), "procs": args.procs,
                   "rounds": args.rounds, "inner_steps": args.inner_steps, "micro_batch": args.micro_batch,
                   "seq_len": args.seq_len, "codec": recipe.codec, "device": "cpu (gloo)",
                   "load_average": os.getloadavg()[0]},
        "sharded_vs_single": {
            "max_abs_loss_diff": max(abs(a - b) for a, b in zip(sharded.losses, single.losses, strict=True)),
            "payload_equal": sharded.payloads == single.payloads,
            "replicated_payload_equal": replicated.payloads == single.payloads,
            "relaunched_payload_equal": relaunch.payloads == single.payloads,
        },
        "persistent": {"round_overhead_s": mean(sharded.overheads), "per_round_s": sharded.overheads,
                       "start_s": round(sharded.start_s, 3),
                       "inner_s": [round(r.seconds, 3) for r in sharded.reports]},
        "relaunch": {"round_overhead_s": mean(relaunch.overheads), "per_round_s": relaunch.overheads},
        "state_mb_per_process": {"replicated": _mb(_largest(replicated, "held")),
                                 "sharded": _mb(_largest(sharded, "held"))},
        "peak_rss_per_process_mb": {"replicated": round(_largest(replicated, "rss"), 1),
                                    "sharded": round(_largest(sharded, "rss"), 1)},
        "plan_check": _plan_check(recipe, args.procs, sharded),
    }


def targets_met(report: dict[str, Any]) -> list[str]:
    missed = []
    state = report["state_mb_per_process"]
    if state["sharded"] > 0.6 * state["replicated"]:
        missed.append("sharded state > 0.6 × replicated")
    if report["persistent"]["round_overhead_s"] > 0.2 * report["relaunch"]["round_overhead_s"]:
        missed.append("persistent round overhead > 0.2 × relaunch's")
    if not report["sharded_vs_single"]["payload_equal"]:
        missed.append("sharded payloads differ from one process's")
    if any(abs(v - 1) > 0.25 for v in report["plan_check"].values()):
        missed.append("plan off by more than 25 %")
    return missed


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_rig-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        report = bench(args, work)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report["missed"] = targets_met(report)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 1 if report["missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
