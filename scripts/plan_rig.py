"""How a model's training state fits a rig: bytes per GPU and host RAM (`training.plan`).

    .venv/bin/python scripts/plan_rig.py --preset 30b --gpus 8 --gpu-mem-gb 80 [--json]
    .venv/bin/python scripts/plan_rig.py --preset 8b --gpus 8 --gpu-mem-gb 80 --micro-batch 2 --shard sharded

Without --shard / --activation-checkpointing the plan picks the cheapest setting that fits: replicated
before sharded, no checkpointing before it. `max_micro_batch` is the most sequences of --seq-len (default:
the preset's max_seq_len) that fit per micro-batch with that setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.model import ModelConfig
from training.plan import RigPlan, plan_rig

ROWS = ("parameters", "gradients", "optimizer", "gathered", "activations", "workspace", "total")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plan_rig.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help="model preset: 1b, 8b, 30b, 12m, …")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-mem-gb", type=float, required=True, help="memory of one GPU, GB (1e9 bytes)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--shard", choices=("auto", "replicated", "sharded"), default="auto")
    parser.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return parser.parse_args(argv)


def _table(plan: RigPlan) -> str:
    how = f"{'sharded' if plan.sharded else 'replicated'}, activation checkpointing {'on' if plan.checkpoint_activations else 'off'}"
    lines = [f"{plan.preset}: {plan.params / 1e9:.2f}B parameters on {plan.gpus} × {plan.gpu_mem_gb:g} GB, {how}",
             f"micro-batch {plan.micro_batch} × {plan.seq_len} tokens"]
    lines += [f"  {row:<12} {plan.bytes_per_gpu[row] / 1e9:8.2f} GB per GPU" for row in ROWS]
    lines += [f"  usable       {plan.usable_bytes / 1e9:8.2f} GB per GPU",
              f"fits: {'yes' if plan.fits else 'no'}; largest micro-batch that fits: {plan.max_micro_batch}",
              f"host RAM: {plan.host_ram_bytes / 1e9:.0f} GB"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    choice = {"auto": None, "on": True, "off": False}
    try:
        plan = plan_rig(
            ModelConfig.preset(args.preset), preset=args.preset, gpus=args.gpus, gpu_mem_gb=args.gpu_mem_gb,
            micro_batch=args.micro_batch, seq_len=args.seq_len,
            sharded={"auto": None, "sharded": True, "replicated": False}[args.shard],
            checkpoint_activations=choice[args.activation_checkpointing],
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict()) if args.json else _table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
