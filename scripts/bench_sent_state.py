"""Bytes a host writes before each upload (`HostStore.save_sent`), whole worker state vs the lean one.

Trains two rounds of a preset model in one process (`DiLoCoWorker`, `round_state = "fresh"`, top-k, so
both residuals exist after round 2) on random tokens, then keeps round 2 as the host does: once with the
state a fresh epoch now keeps (`DiLoCoWorker.state_dict`: the residuals and the step) and once with the
whole trainer state as before (AdamW moments too); the same for the snapshot saved once the round is
applied. Prints the bytes each save writes.

    .venv/bin/python scripts/bench_sent_state.py --preset 12m
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gonka_node.host.store import HostStore, Progress
from training.codecs import get_codec
from training.data import Windows
from training.inner import InnerConfig
from training.model import ModelConfig, build_model
from training.worker import Assignment, DiLoCoWorker

CODEC = "topk:chunk=4096,k=128,bits=2"


def trained_worker(preset: str, steps: int) -> DiLoCoWorker:
    """A fresh-epoch worker after two rounds of `steps` inner steps (seq_len 32, micro-batch 2)."""
    tokens = np.random.RandomState(0).randint(0, 256, size=400_000).astype(np.uint8)
    inner = InnerConfig(steps=steps, warmup_steps=1, total_steps=100, micro_batch=2, seq_len=32, round_state="fresh")
    model = build_model(ModelConfig.preset(preset), 0)
    worker = DiLoCoWorker(model, inner, get_codec(CODEC), Windows(tokens, seq_len=32), Assignment(5, 1, 4))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    for round_ in (1, 2):
        worker.train_round(round_, params)
    return worker


def written(worker: DiLoCoWorker, state: dict[str, Any]) -> dict[str, int]:
    """Bytes a round's two saves write with `state`: the kept round (`save_sent`, before the upload; a
    1 KiB stand-in payload) and the snapshot once the round is applied (`save`: the global model beside
    the worker state, no outer momentum)."""
    params = {n: p.detach() for n, p in worker.model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        store = HostStore(Path(tmp))
        store.save_sent(2, b"\0" * 1024, b"\1" * 32, state)
        store.save(Progress(1, 1, 2, "00" * 32), params, None, state)
        return {"sent": _bytes(Path(tmp) / "sent"), "snapshot": _bytes(store.global_path(2).parent)}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="12m")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    worker = trained_worker(args.preset, args.steps)
    whole = {"inner": worker.trainer.state_dict(), "feedback": worker.feedback.state_dict()}
    params = sum(p.numel() for p in worker.model.parameters())
    out = {"preset": args.preset, "parameters": params,
           "whole": written(worker, whole), "lean": written(worker, worker.state_dict())}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
