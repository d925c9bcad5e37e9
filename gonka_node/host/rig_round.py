"""A host's inner steps across the N processes of its rig (`gonka-node run --gpus N`).

The daemon stays one process that talks to the network; for each round it launches the rig: N
processes joined through a fresh FileStore rendezvous (no ports; NCCL on GPUs, gloo on CPU), each
holding a full model copy and taking every N-th micro-batch, gradients summed before every step
(`training.rig`). The global batch is the recipe's whatever N is, so the payload is the one a single
process sends (bit for bit when grad_accum == N; see tests/gonka_node/test_host_rig.py).

The daemon's `DiLoCoWorker` stays the owner of what survives between rounds: its state (inner AdamW,
error-feedback residual) goes to the rig in a file and comes back from rank 0 after the round. The
processes are started per round, which costs a few seconds of start-up per round; a round is minutes
of training on a real rig.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import Tensor

from gonka_node.recipe import Recipe
from training.codecs import get_codec
from training.model import build_model
from training.rig import Rig
from training.worker import Assignment, DiLoCoWorker, WorkerRound


class RigError(RuntimeError):
    pass


def make_worker(recipe: Recipe, assignment: Assignment, cache_dir: Path | None, rig: Rig | None = None) -> DiLoCoWorker:
    """The host's worker for this recipe and slot (on `rig`'s device, sharing its batches when given)."""
    device = rig.device if rig is not None else "cpu"
    return DiLoCoWorker(
        build_model(recipe.model, recipe.init_seed, device),
        recipe.inner_config(),
        get_codec(recipe.codec),
        recipe.windows(cache_dir),
        assignment,
        recipe.ef_decay,
        rig=rig,
    )


def check_rig_size(recipe: Recipe, procs: int) -> None:
    if procs < 1:
        raise RigError(f"--gpus {procs}: a rig has at least one process")
    if recipe.grad_accum % procs:
        raise RigError(
            f"--gpus {procs}: the epoch's recipe accumulates {recipe.grad_accum} micro-batches per step, "
            f"which do not split evenly over {procs} processes; use a divisor of {recipe.grad_accum}"
        )


@dataclass(frozen=True)
class RoundJob:
    """What every process of the rig needs for one round (picklable: it crosses the spawn)."""

    recipe: Recipe
    assignment: Assignment
    cache_dir: Path | None
    round: int
    global_path: Path
    state_path: Path
    result_path: Path
    rendezvous: Path


def _rig_process(rank: int, world_size: int, job: RoundJob) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    rig = Rig.from_store(dist.FileStore(str(job.rendezvous), world_size), rank, world_size)
    try:
        worker = make_worker(job.recipe, job.assignment, job.cache_dir, rig)
        worker.load_state_dict(torch.load(job.state_path, weights_only=True, map_location=rig.device))
        global_params = {n: t.to(rig.device) for n, t in load_file(str(job.global_path)).items()}
        steps: list[tuple[int, float]] = []
        result = worker.train_round(job.round, global_params, lambda s, loss: steps.append((s, loss)))
        if rig.is_rank0:  # every process holds the same model and residual; rank 0 hands them back
            staged = job.result_path.with_suffix(".tmp")
            torch.save({"round": asdict(result), "state": worker.state_dict(), "steps": steps}, staged)
            os.replace(staged, job.result_path)
        rig.barrier()
    finally:
        rig.close()


class RigRound:
    """Trains a `DiLoCoWorker`'s round on `procs` local processes; the worker's state follows."""

    def __init__(self, procs: int, recipe: Recipe, assignment: Assignment, cache_dir: Path | None, work_dir: Path):
        check_rig_size(recipe, procs)
        self.procs, self.recipe, self.assignment, self.cache_dir, self.work_dir = (
            procs, recipe, assignment, cache_dir, work_dir,
        )

    def train_round(
        self,
        worker: DiLoCoWorker,
        round_index: int,
        global_params: Mapping[str, Tensor],
        on_step: Callable[[int, float], None] | None = None,
    ) -> WorkerRound:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tag = f"round-{round_index}-{uuid.uuid4().hex[:8]}"
        job = RoundJob(
            self.recipe, self.assignment, self.cache_dir, round_index,
            self.work_dir / f"{tag}-global.safetensors", self.work_dir / f"{tag}-state.pt",
            self.work_dir / f"{tag}-result.pt", self.work_dir / f"{tag}-rendezvous",
        )
        try:
            save_file({n: t.detach().contiguous().cpu() for n, t in global_params.items()}, str(job.global_path))
            torch.save(worker.state_dict(), job.state_path)
            try:
                mp.spawn(_rig_process, args=(self.procs, job), nprocs=self.procs, join=True)
            except mp.ProcessRaisedException as exc:
                raise RigError(f"round {round_index}: a rig process failed:\n{exc}") from exc
            except mp.ProcessExitedException as exc:
                raise RigError(f"round {round_index}: a rig process died ({exc})") from exc
            back = torch.load(job.result_path, weights_only=True, map_location="cpu")
        finally:
            for path in (job.global_path, job.state_path, job.result_path, job.rendezvous):
                path.unlink(missing_ok=True)
        worker.load_state_dict(back["state"])
        if on_step is not None:  # replayed after the fact: the steps ran in the rig's processes
            for step, loss in back["steps"]:
                on_step(step, loss)
        return WorkerRound(**back["round"])
