"""DiLoCo (with each codec) against data-parallel training, on one machine, at equal compute.

K simulated workers train the same model on the same tokens with the same global batch and the same
number of steps; only how they synchronise differs:

  ddp          all-reduce (mean) of gradients every step: one model, global batch K × micro-batch
  diloco-*     H local AdamW steps per worker, then the outer Nesterov step on the average of the
               compressed pseudo-gradients (error feedback per worker for lossy codecs)

For each run: final held-out loss, bytes each worker sent, reduction against DDP, wall time. DDP's
bytes are each worker's fp32 gradient once per step (what it uploads to a parameter server; a ring
all-reduce sends 2(K−1)/K times that, so the reductions quoted are conservative).

Every method starts from the seed's random init, or with --warm-start N from one shared checkpoint:
DDP pre-trains N steps on the first rounds of the seed's data stream and every method continues on the
rounds after them (an epoch that continues an earlier model). Runs are then also scored by their share
of DDP's progress from that start. --jobs runs them in parallel processes.

    .venv/bin/python scripts/bench_training.py --seeds 3 --out bench.json
    .venv/bin/python scripts/bench_training.py --warm-start 900 --lr 3e-3 --diloco-lr 1.5e-3 --seeds 3 --jobs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gonka_node.cli.train import load_windows, local_recipe
from training.data import Windows
from training.inner import Batch, InnerTrainer, evaluate
from training.local import LocalDiLoCo, LocalRunConfig, ddp_bytes_per_worker
from training.model import Llama, ModelConfig, build_model

StateDict = dict[str, torch.Tensor]

BENCH_MODEL = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=64)
# The pilot size (0.83M parameters): 853,120 parameters, ~3.7x the compute per step.
PILOT_MODEL = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64)
MODELS = {"bench": BENCH_MODEL, "pilot": PILOT_MODEL}


@dataclass(frozen=True)
class Method:
    name: str
    codec: str | None  # None: DDP
    sync_every: int = 20  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    ef_decay: float = 1.0
    inner_lr: float | None = None  # peak AdamW lr; None: --lr (DDP) or --diloco-lr (DiLoCo)
    overlap: str = "off"  # the recipe's overlap rule (training/overlap.py): "delayed"/"eager" train while uploading
    forecast_step: int = 0  # eager: the step a round moves onto its forecast (training/overlap.py); 0: from the start
    merge_step: int = 0  # eager: the step a round moves onto the model after r − 1; 0: never
    fragments: int = 1  # streamed (training/streaming.py): P fragments, one synced a round of H / P steps
    stream_mix: float = 0.0  # streamed: the share of its own fragment a host keeps when the synced one lands

    @property
    def round_steps(self) -> int:
        """Inner steps a round: H, or H / P when streamed (each fragment still syncs every H steps)."""
        return self.sync_every // self.fragments


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("ddp", None),
        # Outer (lr, momentum) = (0.9, 0.5): tuned at this short horizon (10 outer steps); DiLoCo's
        # (0.7, 0.9) overshoots here (docs/benchmarks.md has the sweep).
        Method("diloco-fp32", "fp32", 30, 0.9, 0.5),
        Method("diloco-int8", "int8:block=256", 30, 0.9, 0.5),
        Method("diloco-int4", "int4:block=128", 30, 0.9, 0.5),
        Method("diloco-topk", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9),
        # The whole >= 1,000x budget: 1/16 of each chunk as signs (2-bit values at equal bytes do as
        # well). A sparse average is diluted by the hosts that did not pick an entry; a larger outer
        # lr (1.2) makes up for part of it.
        Method("diloco-topk1", "topk:chunk=4096,k=256,bits=1", 30, 1.2, 0.5, 0.9),
        Method("diloco-mask", "mask:stride=2,bits=2,chunk=256", 30, 0.9, 0.5),
        # Overlapped rounds (issue 14): the int8 method with one-round-delayed outer updates.
        Method("diloco-int8-overlap", "int8:block=256", 30, 0.9, 0.5, overlap="delayed"),
        Method("diloco-topk-overlap", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9, overlap="delayed"),
        # The same schedule with the eager rule: each host trains from its forecast of the model the
        # outer step lands on (training/overlap.py).
        Method("diloco-int8-eager", "int8:block=256", 30, 0.9, 0.5, overlap="eager"),
        Method("diloco-topk-eager", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9, overlap="eager"),
        # Eager rounds that move onto another base a quarter in (step 7 of 30): onto the forecast (its
        # first steps from the step's momentum part, so the seal and the forecast hide behind them), or
        # onto the model after r − 1 once it has arrived (Streaming DiLoCo's merge).
        Method("diloco-topk-eager-late", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9, overlap="eager",
               forecast_step=7),
        Method("diloco-int8-eager-merge", "int8:block=256", 30, 0.9, 0.5, overlap="eager", merge_step=7),
        # Streaming DiLoCo: 3 fragments, one synced every 10 steps, so each syncs every 30 as above; the
        # sync in place ("off"), or landing one round late ("delayed") with half the host's own kept.
        Method("diloco-int8-stream3", "int8:block=256", 30, 0.9, 0.5, fragments=3),
        Method("diloco-int8-stream3-delayed", "int8:block=256", 30, 0.9, 0.5, overlap="delayed", fragments=3,
               stream_mix=0.5),
        Method("diloco-topk-stream3", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9, fragments=3),
        Method("diloco-topk-stream3-delayed", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9, overlap="delayed",
               fragments=3, stream_mix=0.5),
        # ... and landing late by replacing the host's own fragment (mix 0): what the mix buys
        Method("diloco-int8-stream3-delayed-replace", "int8:block=256", 30, 0.9, 0.5, overlap="delayed", fragments=3),
        Method("diloco-topk-stream3-delayed-replace", "topk:chunk=4096,k=128,bits=2", 30, 0.9, 0.5, 0.9,
               overlap="delayed", fragments=3),
    ]
}


EXTRA_FORMAT = "NAME|CODEC|H[|OUTER_LR|MOMENTUM|EF_DECAY|INNER_LR|FRAGMENTS]"


def parse_extra(text: str) -> Method:
    """NAME|CODEC|H[|OUTER_LR|MOMENTUM|EF_DECAY|INNER_LR|FRAGMENTS], e.g. 'mask-s2|mask:stride=2|30|0.7|0.9|1.0'.

    CODEC 'ddp' makes a DDP run (H is then the evaluation interval, outer fields are ignored). FRAGMENTS:
    a streamed run (training/streaming.py), each fragment synced every H steps, in place."""
    fields = text.split("|")
    if not 3 <= len(fields) <= 8:
        raise SystemExit(f"--extra {text!r}: expected {EXTRA_FORMAT}")
    try:
        given: list[float | None] = [float(f) for f in fields[3:7]]
        h, fragments = int(fields[2]), int(fields[7]) if len(fields) == 8 else 1
    except ValueError as exc:
        raise SystemExit(f"--extra {text!r}: {exc} (expected {EXTRA_FORMAT})") from exc
    n = given + [None] * (4 - len(given))
    base = Method(fields[0], None if fields[1] == "ddp" else fields[1], h)
    return Method(
        base.name, base.codec, base.sync_every, base.outer_lr if n[0] is None else n[0],
        base.outer_momentum if n[1] is None else n[1], base.ef_decay if n[2] is None else n[2], n[3],
        fragments=fragments,
    )


@dataclass
class DdpRun:
    model: Llama
    start_loss: float
    curve: list[tuple[int, float]]  # (steps taken, held-out loss) after each evaluation interval


def run_ddp(
    base: LocalRunConfig, windows: Windows, initial: StateDict | None = None, first_round: int = 0
) -> DdpRun:
    """One model, global batch = K micro-batches (exactly the workers' windows of each step), from
    `initial` (or the recipe's init) on the data stream's rounds first_round, first_round + 1, ..."""
    recipe = base.recipe
    model = build_model(recipe.model, seed=recipe.init_seed)
    if initial is not None:
        model.load_state_dict(initial)
    trainer = InnerTrainer(model, replace(recipe.inner_config(), grad_accum=base.workers))
    heldout = windows.sample_heldout(base.seed, base.eval_windows)
    start = evaluate(model, windows.batches(heldout, 32))
    curve = []
    for r in range(recipe.n_rounds):
        trainer.run(_interleaved(windows, base, first_round + r))
        curve.append(((r + 1) * recipe.inner_steps, evaluate(model, windows.batches(heldout, 32))))
    return DdpRun(model, start, curve)


def _interleaved(windows: Windows, cfg: LocalRunConfig, round_index: int) -> Iterator[Batch]:
    """Step i's micro-batches of workers 0..K-1 in turn: the DDP global batch of step i."""
    steps, micro_batch = cfg.recipe.inner_steps, cfg.recipe.micro_batch
    per_worker = [
        windows.assignment(
            epoch_seed=cfg.seed,
            round_index=round_index,
            slot=w,
            max_slots=cfg.workers,
            windows_per_host=steps * micro_batch,
        ).reshape(steps, micro_batch)
        for w in range(cfg.workers)
    ]
    for step in range(steps):
        for ids in per_worker:
            yield from windows.batches(ids[step], micro_batch)


def inner_lr(method: Method, args: argparse.Namespace) -> float:
    if method.inner_lr is not None:
        return method.inner_lr
    return args.lr if method.codec is None else args.diloco_lr


def _config(args: argparse.Namespace, seed: int, method: Method, steps: int, h: int) -> LocalRunConfig:
    model = MODELS[args.model]
    return LocalRunConfig(
        recipe=local_recipe(
            model,
            n_rounds=steps // h,
            inner_steps=h,
            micro_batch=args.micro_batch,
            seq_len=model.max_seq_len,
            inner_lr=inner_lr(method, args),
            warmup_steps=args.warmup,
            codec=method.codec or "fp32",
            ef_decay=method.ef_decay,
            outer_lr=method.outer_lr,
            outer_momentum=method.outer_momentum,
            seed=seed,
            overlap=method.overlap,
            forecast_step=method.forecast_step,
            merge_step=method.merge_step,
            stream_fragments=method.fragments,
            stream_mix=method.stream_mix,
        ),
        workers=args.workers,
        eval_windows=args.eval_windows,
    )


def pretrain(args: argparse.Namespace, windows: Windows, seed: int) -> StateDict:
    """--warm-start: the checkpoint every method of this seed continues from. DDP at its own lr
    (--pretrain-lr) for --warm-start steps from the seed's init, warm-up + cosine over those steps, on the
    first rounds of the seed's data stream; the comparison then takes the rounds after them, so no
    method sees a pre-training window again."""
    h = args.ddp_eval_every
    if args.warm_start % h:
        raise SystemExit(f"--warm-start {args.warm_start} must be a multiple of --ddp-eval-every {h}")
    method = Method("pretrain", None, inner_lr=args.pretrain_lr)
    print(f"seed {seed}: pre-training {args.warm_start} steps of DDP for the shared start", flush=True)
    return run_ddp(_config(args, seed, method, args.warm_start, h), windows).model.state_dict()


def check_schedule(method: Method, args: argparse.Namespace) -> int:
    """The method's round length (H, H / P when streamed, or DDP's evaluation interval), which --steps and
    --warm-start must both be multiples of: rounds are the unit of the data stream."""
    if method.sync_every % method.fragments:
        raise SystemExit(f"{method.name}: H = {method.sync_every} is not a multiple of its {method.fragments} fragments")
    h = method.round_steps if method.codec else args.ddp_eval_every
    for what, n in (("--steps", args.steps), ("--warm-start", args.warm_start)):
        if n % h:
            raise SystemExit(f"{what} {n} must be a multiple of {method.name}'s H = {h}")
    return h


def run_method(
    method: Method, args: argparse.Namespace, windows: Windows, seed: int, initial: StateDict | None = None
) -> dict[str, Any]:
    steps = args.steps
    h = check_schedule(method, args)
    base = _config(args, seed, method, steps, h)
    first_round = args.warm_start // h  # rounds of H steps the pre-training took from the data stream
    params = MODELS[args.model].num_params()
    ddp_bytes = ddp_bytes_per_worker(params, steps)
    started = time.perf_counter()
    if method.codec is None:
        ddp = run_ddp(base, windows, initial, first_round)
        start, sent = ddp.start_loss, ddp_bytes
        peak = 4 * params  # a gradient a step
        points = [(step * 4 * params, loss) for step, loss in ddp.curve]
    else:
        run, peak = LocalDiLoCo(base, windows, initial, first_round), 0
        start, sent, points = run.heldout_loss(), 0, []
        for _ in range(base.recipe.n_rounds):
            report = run.run_round()
            sent += report.bytes_per_worker
            peak = max(peak, report.bytes_per_worker)
            points.append((sent, report.heldout_loss))
    return {
        "name": method.name,
        "codec": method.codec,
        "sync_every": method.sync_every if method.codec else 1,
        "fragments": method.fragments,
        "inner_lr": inner_lr(method, args),
        "seed": seed,
        "start_loss": start,
        "final_loss": points[-1][1],
        "bytes_per_worker": sent,
        "reduction_vs_ddp": ddp_bytes / sent,
        "peak_round_bytes": peak,  # the largest single upload: a streamed round's is a fragment's
        "wall_s": time.perf_counter() - started,
        "curve": points,  # (bytes sent so far, held-out loss)
    }


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± std over seeds per method (std 0 with one seed)."""
    out = []
    for name in dict.fromkeys(r["name"] for r in runs):
        group = [r for r in runs if r["name"] == name]
        losses = [r["final_loss"] for r in group]
        out.append(
            {
                "name": name,
                "codec": group[0]["codec"],
                "sync_every": group[0]["sync_every"],
                "fragments": group[0]["fragments"],
                "peak_round_bytes": group[0]["peak_round_bytes"],
                "inner_lr": group[0]["inner_lr"],
                "final_loss": statistics.fmean(losses),
                "final_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                "bytes_per_worker": group[0]["bytes_per_worker"],
                "reduction_vs_ddp": group[0]["reduction_vs_ddp"],
                "wall_s": statistics.fmean(r["wall_s"] for r in group),
                "seeds": [r["seed"] for r in group],
            }
        )
    ddp = next((r for r in out if r["name"] == "ddp"), None)
    ddp_final = {r["seed"]: r["final_loss"] for r in runs if r["name"] == "ddp"}
    for r in out:
        r["loss_vs_ddp"] = r["final_loss"] / ddp["final_loss"] - 1 if ddp else None
        # From a warm start the final losses sit close together whatever happens, so also: the share of
        # DDP's loss reduction (from the shared start) the method achieved, paired by seed.
        shares = [
            (x["start_loss"] - x["final_loss"]) / (x["start_loss"] - ddp_final[x["seed"]])
            for x in runs
            if x["name"] == r["name"] and x["seed"] in ddp_final and x["start_loss"] > ddp_final[x["seed"]]
        ]
        r["start_loss"] = statistics.fmean(x["start_loss"] for x in runs if x["name"] == r["name"])
        r["progress_vs_ddp"] = statistics.fmean(shares) if shares else None
    return out


def plot(runs: list[dict[str, Any]], path: Path, model: ModelConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["name"] for r in runs):
        run = next(r for r in runs if r["name"] == name)  # first seed's curve
        xs, ys = zip(*run["curve"], strict=True)
        ax.plot(xs, ys, label=f"{name} ({run['reduction_vs_ddp']:,.0f}× fewer bytes)")
    ax.set(xscale="log", xlabel="bytes sent per worker", ylabel="held-out loss (nats/byte)")
    ax.set_title(f"DiLoCo vs DDP, {model.num_params():,} parameters")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class _InlineExecutor(concurrent.futures.Executor):
    """--jobs 1: run each task when it is submitted, in this process."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # re-raised by .result(), as a pool would
            future.set_exception(exc)
        return future


def _executor(jobs: int, threads: int) -> concurrent.futures.Executor:
    if jobs == 1:
        return _InlineExecutor()
    return concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=torch.set_num_threads, initargs=(threads,)
    )


def run_all(args: argparse.Namespace, windows: Windows, names: list[str]) -> Iterator[dict[str, Any]]:
    """Every (seed, method) run, yielded in that order. With --warm-start a seed's runs are queued as soon
    as its checkpoint exists, so the pool never waits for all pre-trainings to finish."""
    with _executor(args.jobs, args.threads) as pool:
        seeds = range(args.seeds)
        starts = {s: pool.submit(pretrain, args, windows, s) for s in seeds} if args.warm_start else {}
        runs: Iterable[concurrent.futures.Future[dict[str, Any]]] = (
            pool.submit(run_method, METHODS[name], args, windows, seed, starts[seed].result() if starts else None)
            for seed in seeds
            for name in names
        )
        if args.jobs > 1:
            runs = list(runs)  # queue them all now; inline (--jobs 1) each runs when its turn comes
        for run in runs:
            yield run.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, help="text file or folder (default: Python's stdlib sources)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per method; reports mean ± std")
    parser.add_argument(
        "--methods", default=",".join(n for n, m in METHODS.items() if m.overlap == "off" and m.fragments == 1),
        help=f"comma-separated subset of {list(METHODS)} (default: all but the overlapped and streamed ones)"
    )
    parser.add_argument("--extra", action="append", default=[], help=f"extra method {EXTRA_FORMAT}")
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="bench", help="bench: 230k parameters; pilot: 853k"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per worker (and for DDP)")
    parser.add_argument("--micro-batch", type=int, default=8, help="windows per worker per step")
    # Each tuned on its own (seed 0, 300 steps; docs/benchmarks.md): DDP's batch of 32 windows takes
    # twice the lr that suits a DiLoCo worker's batch of 8.
    parser.add_argument("--lr", type=float, default=6e-3, help="DDP's AdamW peak learning rate")
    parser.add_argument(
        "--diloco-lr", type=float, default=3e-3, help="DiLoCo workers' inner AdamW peak learning rate"
    )
    parser.add_argument(
        "--warm-start",
        type=int,
        default=0,
        metavar="STEPS",
        help="continue from a shared checkpoint: DDP pre-trains STEPS steps per seed, then every method "
        "starts from it on the data that follows (0: every method starts from the random init)",
    )
    parser.add_argument(
        "--pretrain-lr", type=float, default=6e-3, help="peak lr of the --warm-start pre-training (DDP's)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (one thread each)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--ddp-eval-every", type=int, default=30)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is robust on a shared machine)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_training.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for text in args.extra:
        method = parse_extra(text)
        METHODS[method.name] = method
    names = [n for n in args.methods.split(",") if n] + [parse_extra(t).name for t in args.extra]
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if args.jobs <= 0 or args.warm_start < 0:
        parser.error("--jobs must be positive and --warm-start >= 0")
    for name in names:  # before any work, and before a pool worker would hit it
        check_schedule(METHODS[name], args)
    model = MODELS[args.model]
    windows = load_windows(args.corpus, model.max_seq_len)
    runs = []
    for run in run_all(args, windows, names):
        runs.append(run)
        print(
            f"seed {run['seed']} {run['name']:14s} loss {run['start_loss']:.4f} → {run['final_loss']:.4f}"
            f"  bytes/worker {run['bytes_per_worker']:>13,}  {run['reduction_vs_ddp']:>8,.1f}×"
            f"  {run['wall_s']:6.1f} s",
            flush=True,
        )
    summary = aggregate(runs)
    for r in summary:
        rel = f"{100 * r['loss_vs_ddp']:+.1f}%" if r["loss_vs_ddp"] is not None else ""
        share = r["progress_vs_ddp"]
        share = f"{100 * share:.0f}% of DDP's progress" if args.warm_start and share is not None else ""
        print(
            f"{r['name']:14s} {r['final_loss']:.4f} ± {r['final_loss_std']:.4f} {rel:>7s}"
            f"  {r['reduction_vs_ddp']:,.1f}×  {share}"
        )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["model"] = model.to_dict()
    args.out.write_text(json.dumps({"config": config, "runs": summary, "per_seed": runs}, indent=1) + "\n")
    plot(runs, args.out.with_suffix(".png"), model)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
