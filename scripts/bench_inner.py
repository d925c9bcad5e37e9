"""Inner-loop throughput: tokens/s and model FLOPs utilisation (MFU) of `training.inner.InnerTrainer`
against a bare PyTorch training loop on the same model, micro-batch and sequence length.

The bare loop is the least a trainer can do: forward and loss under the same autocast, backward,
AdamW step (fused on CUDA), zero the gradients. `InnerTrainer` adds what a host needs: the warm-up +
cosine learning-rate schedule, gradient clipping, gradient accumulation and a loss read-back (one
device sync) per step. The ratio of the two is the trainer's overhead.

Tokens are random byte ids (throughput does not depend on the text, and nothing is downloaded). Each
loop first runs `--warmup` untimed steps (allocator, cuDNN/compile autotuning), then `--repeats`
timed windows of `--steps` steps; the medians over windows are reported. FLOPs per token are
6·N + 12·L·d·T (parameters N, layers L, width d, sequence T: the PaLM convention, attention counted
unmasked). MFU = tokens/s × FLOPs per token / the device's peak dense bf16 FLOP/s (`--peak-tflops`,
known for H100/H200; none on CPU).

    .venv/bin/python scripts/bench_inner.py --preset 1b --device cuda --micro-batch 8 --seq-len 2048 --out inner.json
    .venv/bin/python scripts/bench_inner.py --preset tiny --device cpu --steps 3 --repeats 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.inner import Batch, InnerConfig, InnerTrainer
from training.model import Llama, ModelConfig, build_model

PEAK_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}  # dense, per GPU (vendor datasheets)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * cfg.num_params() + 12.0 * cfg.n_layers * cfg.dim * seq_len


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for key, t in PEAK_BF16_TFLOPS.items() if key in name), None)


def random_batches(cfg: ModelConfig, micro_batch: int, seq_len: int, seed: int) -> Iterator[Batch]:
    """Endless (inputs, targets) micro-batches of random token ids, on the CPU as a host's data is."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        window = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen)
        yield window[:, :-1], window[:, 1:]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_loop(model: Llama, args: argparse.Namespace, device: torch.device) -> Callable[[int], float]:
    """A function running n steps of the bare loop and returning the seconds they took."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    loss_fn = torch.compile(model.loss) if args.compile else model.loss
    batches = random_batches(model.config, args.micro_batch, args.seq_len, seed=1)
    autocast = device.type == "cuda"

    def run(n: int) -> float:
        sync(device)
        started = time.perf_counter()
        for _ in range(n):
            for _ in range(args.grad_accum):
                inputs, targets = next(batches)
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = loss_fn(inputs, targets)
                (loss / args.grad_accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - started

    return run


def trainer_loop(model: Llama, args: argparse.Namespace) -> Callable[[int], float]:
    total = args.warmup + args.steps * args.repeats
    config = InnerConfig.fitted(steps=args.steps, lr=args.lr, warmup_steps=10, total_steps=total,
                         micro_batch=args.micro_batch, grad_accum=args.grad_accum, seq_len=args.seq_len,
                         compile=args.compile)
    trainer = InnerTrainer(model, config)
    batches = random_batches(model.config, args.micro_batch, args.seq_len, seed=1)
    return lambda n: trainer.run(batches, steps=n).seconds  # run() ends with a device sync


def measure(name: str, run: Callable[[int], float], args: argparse.Namespace, device: torch.device,
            per_token: float, peak: float | None) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.warmup:
        run(args.warmup)
    tokens = args.steps * args.grad_accum * args.micro_batch * args.seq_len
    windows = [run(args.steps) for _ in range(args.repeats)]
    rates = [tokens / s for s in windows]
    rate = statistics.median(rates)
    return {
        "name": name,
        "tokens_per_s": rate,
        "tokens_per_s_all": rates,
        "step_s_median": statistics.median(windows) / args.steps,
        "model_tflops_per_s": rate * per_token / 1e12,
        "mfu": rate * per_token / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b", help="model preset (default 1b)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_seq_len")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows; medians are reported")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss in both loops")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak dense bf16 TFLOP/s")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=Path("bench_inner.json"))
    args = ap.parse_args(argv)
    cfg = ModelConfig.preset(args.preset)
    args.seq_len = args.seq_len or cfg.max_seq_len
    if args.seq_len > cfg.max_seq_len:
        ap.error(f"--seq-len {args.seq_len} exceeds the {args.preset} preset's max_seq_len {cfg.max_seq_len}")
    if min(args.steps, args.repeats, args.micro_batch, args.grad_accum) < 1 or args.warmup < 0:
        ap.error("--steps, --repeats, --micro-batch and --grad-accum must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    per_token = flops_per_token(cfg, args.seq_len)
    peak = peak_flops(device, args.peak_tflops)
    started = time.perf_counter()
    model = build_model(cfg, seed=0, device=device)
    runs = [measure("bare_pytorch", bare_loop(model, args, device), args, device, per_token, peak)]
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the bare loop's AdamW state is garbage now
    runs.append(measure("inner_trainer", trainer_loop(model, args), args, device, per_token, peak))
    out = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "params": cfg.num_params(), "flops_per_token": per_token,
                   "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "peak_flops": peak, "torch": torch.__version__},
        "runs": runs,
        "trainer_vs_bare": runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"],
        "seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in runs:
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "n/a (no peak known)"
        print(f"{r['name']:14s} {r['tokens_per_s']:>12,.0f} tokens/s  {r['model_tflops_per_s']:8.2f} TFLOP/s  MFU {mfu}")
    print(f"InnerTrainer / bare: {out['trainer_vs_bare']:.3f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
