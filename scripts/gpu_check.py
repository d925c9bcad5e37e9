"""The parts of scripts/gpu_check.sh that are ours to run (the inner-loop benchmark is bench_inner.py).

    fsdp  (under torchrun, one process per GPU)  FSDP2 training steps of a preset, sharded over the GPUs,
          bf16 compute, fp32 master weights and reductions, optionally compiled and checkpointed:
          tokens/s, MFU and peak memory per GPU against training.plan's prediction.
    rig   (one process: the host daemon's side)  rounds of a host's real rig (RigRounds: torchrun, the
          mailbox, FSDP2 on --procs GPUs) against a one-GPU rig: payloads (equal, or their relative
          difference: bf16 reductions of another shape round differently), per-round waits.

Both run on CPU with gloo too (`--device cpu`): what `gpu_check.sh --dry-run` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_inner import flops_per_token, peak_flops, random_batches

from training.model import Llama, ModelConfig


def _fsdp(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from training.inner import InnerConfig, InnerTrainer
    from training.plan import plan_rig
    from training.rig import Rig
    from training.sharded import ShardedSync, ShardOptions, held_bytes, shard_model

    rig = Rig.from_torchrun()
    cfg = ModelConfig.preset(args.preset)
    seq = args.seq_len or cfg.max_seq_len
    model = Llama(cfg, device="meta")
    shard_model(model, init_device_mesh(rig.device.type, (rig.world_size,)),
                ShardOptions(checkpoint_activations=args.activation_checkpointing, compile=args.compile))
    model.to_empty(device=rig.device)
    gen = torch.Generator(device=rig.device).manual_seed(rig.rank)
    with torch.no_grad():  # a throughput run: any sane weights (each shard its own draw)
        for p in model.parameters():
            cast(DTensor, p).to_local().normal_(0.0, 0.02, generator=gen)  # shard_model made them DTensors
    steps = args.warmup + args.steps
    config = InnerConfig.fitted(steps=steps, lr=3e-4, warmup_steps=10, total_steps=steps + 1,
                                micro_batch=args.micro_batch, grad_accum=rig.world_size, seq_len=seq)
    trainer = InnerTrainer(model, config, sync=ShardedSync(rig))
    if rig.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rig.device)
    batches = random_batches(cfg, args.micro_batch, seq, seed=rig.rank)
    trainer.run(batches, steps=args.warmup)
    result = trainer.run(batches, steps=args.steps)
    peak_mem = torch.cuda.max_memory_allocated(rig.device) if rig.device.type == "cuda" else 0
    stats = rig.gather_object({"peak_memory_bytes": peak_mem, "held": held_bytes(model, trainer.optimizer)})
    if rig.is_rank0:
        assert stats is not None
        rate = result.tokens / result.seconds
        peak = peak_flops(rig.device, args.peak_tflops)
        total_mem = torch.cuda.get_device_properties(rig.device).total_memory if rig.device.type == "cuda" else 0
        plan = plan_rig(cfg, gpus=rig.world_size, gpu_mem_gb=(total_mem or 10**12) / 1e9, micro_batch=args.micro_batch,
                        seq_len=seq, sharded=True, checkpoint_activations=args.activation_checkpointing,
                        device=rig.device.type)
        out = {
            "preset": args.preset, "params": cfg.num_params(), "gpus": rig.world_size, "device": rig.device.type,
            "micro_batch": args.micro_batch, "seq_len": seq, "compile": args.compile,
            "activation_checkpointing": args.activation_checkpointing,
            "tokens_per_s": rate, "tokens_per_s_per_gpu": rate / rig.world_size,
            "mfu": rate * flops_per_token(cfg, seq) / (peak * rig.world_size) if peak else None,
            "losses": result.losses, "finite": all(math.isfinite(x) for x in result.losses),
            "peak_memory_gb_per_gpu": [s["peak_memory_bytes"] / 1e9 for s in stats],
            "planned_total_gb_per_gpu": plan.bytes_per_gpu["total"] / 1e9,
            "held_state_gb_per_gpu": [sum(s["held"].values()) / 1e9 for s in stats],
            "planned_state_gb_per_gpu": sum(plan.bytes_per_gpu[k] for k in ("parameters", "gradients", "optimizer")) / 1e9,
        }
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out))
    dist.barrier()
    rig.close()
    # Ended here, past the interpreter's finalization: there gloo's worker threads may still free tensors
    # they held, whose GIL acquire aborts the process now and then (SIGABRT after a clean run, its report
    # written: pytorch/pytorch#179291), which torchrun reports as this check failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rig(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from gonka_node.core.recipe import Recipe
    from gonka_node.host.rig_round import RigOptions, RigRounds
    from training.codecs import get_codec, round_seed
    from training.model import build_model
    from training.worker import Assignment

    work = Path(tempfile.mkdtemp(prefix="gpu_check_rig-"))
    corpus = work / "corpus.txt"
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    corpus.write_bytes(b"".join((lib / n).read_bytes() for n in ("argparse.py", "textwrap.py", "typing.py")))
    recipe = Recipe(model=ModelConfig.preset(args.preset), corpus=str(corpus), seq_len=args.seq_len,
                    micro_batch=args.micro_batch, grad_accum=args.procs, inner_steps=args.inner_steps, inner_lr=1e-3,
                    warmup_steps=2, n_rounds=args.rounds, codec="int8").with_data_manifest(work / "cache")
    assignment = Assignment(recipe.epoch_seed, 0, 4)
    params = {n: p.detach() for n, p in build_model(recipe.model, recipe.init_seed).named_parameters()}
    save_file(params, str(work / "global.safetensors"))
    runs: dict[str, Any] = {}
    for name, options in (("sharded", RigOptions(args.procs, "sharded", compile=args.compile)),
                          ("one_gpu", RigOptions(1, "replicated", compile=args.compile))):
        rig = RigRounds(options, recipe, assignment, work / "cache", work / name)
        started = time.perf_counter()
        rig.start()
        try:
            start_s = rig.wait_ready(timeout_s=600.0)
            rounds = []
            for r in range(1, args.rounds + 1):
                t0 = time.perf_counter()
                result = rig.train_round(r, params, lambda: work / "global.safetensors", lambda s, loss: None)
                rounds.append({"payload": result.payload, "wait_s": time.perf_counter() - t0,
                               "inner_s": result.seconds, "last_loss": result.last_loss})
        finally:
            rig.close()
        runs[name] = {"start_s": start_s, "total_s": time.perf_counter() - started, "rounds": rounds}
    spec = {n: tuple(t.shape) for n, t in params.items()}
    compare = []
    for r, (a, b) in enumerate(zip(runs["sharded"]["rounds"], runs["one_gpu"]["rounds"], strict=True), start=1):
        codec = get_codec(recipe.codec).for_round(round_seed(recipe.epoch_seed, r))
        x, y = codec.decode(a["payload"], spec), codec.decode(b["payload"], spec)
        diff = math.sqrt(sum(float((x[n] - y[n]).double().square().sum()) for n in x))
        norm = math.sqrt(sum(float(y[n].double().square().sum()) for n in y))
        compare.append({"round": r, "payload_equal": a["payload"] == b["payload"], "relative_l2_diff": diff / norm})
    for run in runs.values():
        for row in run["rounds"]:
            row["payload_bytes"] = len(row.pop("payload"))
    out = {"preset": args.preset, "procs": args.procs, "rounds": runs, "sharded_vs_one_gpu": compare}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fsdp = sub.add_parser("fsdp")
    fsdp.add_argument("--preset", default="1b")
    fsdp.add_argument("--micro-batch", type=int, default=4)
    fsdp.add_argument("--seq-len", type=int, default=None)
    fsdp.add_argument("--steps", type=int, default=8)
    fsdp.add_argument("--warmup", type=int, default=3)
    fsdp.add_argument("--compile", action="store_true")
    fsdp.add_argument("--activation-checkpointing", action="store_true")
    fsdp.add_argument("--peak-tflops", type=float, default=None)
    fsdp.add_argument("--out", required=True)
    rig = sub.add_parser("rig")
    rig.add_argument("--preset", default="12m")
    rig.add_argument("--procs", type=int, default=2)
    rig.add_argument("--rounds", type=int, default=2)
    rig.add_argument("--inner-steps", type=int, default=20)
    rig.add_argument("--micro-batch", type=int, default=8)
    rig.add_argument("--seq-len", type=int, default=256)
    rig.add_argument("--compile", action="store_true")
    rig.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    return _fsdp(args) if args.command == "fsdp" else _rig(args)


if __name__ == "__main__":
    sys.exit(main())
