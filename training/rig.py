"""One host = one rig of 1-8 GPUs: inner steps data-parallel across the rig's processes.

Launch every process with `torchrun --standalone --nproc_per_node N ...` (NCCL on GPU, gloo on CPU),
or with `launch_local` (a FileStore rendezvous, no ports) for tests and CPU runs. Each process holds a
full model copy; before a round rank 0 broadcasts the global model, during it each process computes
gradients on its share of the micro-batches and the gradients are summed across processes before
every optimizer step. The global batch (`micro_batch * grad_accum`) is the same whatever the number
of processes, so a round trains the same model on 1 GPU or 8. Only rank 0 talks to the network.

`python -m training.rig` trains a model on one rig (under torchrun or alone) and writes a checkpoint:
the smallest end-to-end use of model, data, inner loop and checkpoint, and the host's template.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from training.checkpoint import save_checkpoint
from training.data import TokenCorpus, builtin_corpus_files, corpus_files
from training.inner import Batch, InnerConfig, InnerTrainer, evaluate
from training.model import ModelConfig, build_model


def torchrun_store(rank: int, world_size: int) -> dist.Store:
    """torchrun's rendezvous store, under a prefix of this restart's own.

    The elastic agent keeps one TCPStore for every restart of a job, and the process group's keys are
    the same in every attempt: without the prefix a restarted process can read what a killed attempt
    wrote (a dead peer's gloo address: "connectFullMesh ... Connection refused" until the timeout, or a
    barrier counter already past), so a restart after a crash failed or hung at random."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # the agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not shared and rank == 0, multi_tenant=not shared)
    return dist.PrefixStore(f"gonka-rig/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def is_rank0() -> bool:
    """True in the process that may talk to the network (and in any single-process run)."""
    return not dist.is_initialized() or dist.get_rank() == 0


@dataclass(frozen=True)
class Rig:
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def single(cls, device: torch.device | str | None = None) -> Rig:
        """A one-process rig: no process group, the first GPU if there is one."""
        default = "cuda:0" if torch.cuda.is_available() else "cpu"
        return cls(0, 1, torch.device(device or default))

    @classmethod
    def from_torchrun(cls) -> Rig:
        """Join the process group torchrun set up (it passes the rendezvous through the environment),
        in a namespace of this restart's own (`torchrun_store`)."""
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return cls.from_store(torchrun_store(rank, world_size), rank, world_size)

    @classmethod
    def from_store(cls, store: dist.Store, rank: int, world_size: int) -> Rig:
        """Join a process group through an explicit store (e.g. a FileStore: no ports involved)."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        device = _rank_device(rank) if backend == "nccl" else torch.device("cpu")
        return cls(rank, world_size, device)

    @classmethod
    def init(cls) -> Rig:
        """The rig this process belongs to: torchrun's if launched by it, else a single process."""
        return cls.from_torchrun() if dist.is_torchelastic_launched() else cls.single()

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast_model(self, model: nn.Module) -> None:
        """Make every process's copy equal to rank 0's (call before each round)."""
        if self.distributed:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor.data, src=0)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable, small: round numbers, paths, decisions) on every process."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every process's `obj` (small, picklable) as a list on rank 0; None on the others."""
        if not self.distributed:
            return [obj]
        box: list[Any] | None = [None] * self.world_size if self.is_rank0 else None
        dist.gather_object(obj, box, dst=0)
        return box

    def all_reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Sum gradients over the rig. One async collective per tensor: NCCL and gloo pipeline them."""
        if not self.distributed:
            return
        for param in params:
            if param.grad is None:  # every process must take part in every collective
                param.grad = torch.zeros_like(param)
        handles = [dist.all_reduce(p.grad, async_op=True) for p in params]
        for handle in handles:
            handle.wait()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return tensor
        summed = tensor.clone()
        dist.all_reduce(summed)
        return summed

    def grad_sq_total(self, local: torch.Tensor) -> torch.Tensor:
        return local  # after `all_reduce_grads` every process holds the whole gradients

    def shard(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This process's share of the rig's micro-batch stream: micro-batches rank, rank + N, ..."""
        for index, batch in enumerate(batches):
            if index % self.world_size == self.rank:
                yield batch

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_device(rank: int) -> torch.device:
    # A rig is one machine, so the global rank is also the local rank.
    if rank >= torch.cuda.device_count():
        raise RuntimeError(f"rank {rank} has no GPU: this machine has {torch.cuda.device_count()}")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


@dataclass(frozen=True, kw_only=True)
class RigJob:
    """A standalone training run on one rig: a model, a corpus, some inner steps, a checkpoint."""

    model: ModelConfig
    inner: InnerConfig
    seed: int = 0  # model init and data order
    corpus: tuple[str, ...] = ()  # files/folders; empty: the built-in corpus
    corpus_max_bytes: int = 8_000_000  # cap on the built-in corpus
    cache_dir: str | None = None
    eval_windows: int = 64
    out: str | None = None  # checkpoint path, written by rank 0
    log_every: int = 0


@dataclass(frozen=True)
class RigReport:
    losses: list[float]
    heldout_loss: float
    tokens: int
    seconds: float
    world_size: int
    checkpoint_sha256: str | None
    data_manifest_sha256: str
    extra: dict[str, Any] = field(default_factory=dict)


def train(rig: Rig, job: RigJob) -> RigReport:
    """Run `job` on `rig` (call it in every process of the rig); rank 0 writes the checkpoint."""
    corpus = (
        TokenCorpus.from_files(corpus_files(job.corpus), job.cache_dir)
        if job.corpus
        else TokenCorpus.from_files(builtin_corpus_files(job.corpus_max_bytes), job.cache_dir)
    )
    windows = corpus.windows(job.inner.seq_len)
    model = build_model(job.model, job.seed, rig.device)
    trainer = InnerTrainer(model, job.inner, sync=rig)
    rig.broadcast_model(model)  # equal already (same seed); this is where a host syncs the global model
    ids = windows.assignment(
        epoch_seed=job.seed, round_index=0, slot=0, max_slots=1, windows_per_host=job.inner.windows_per_round
    )

    def log(step: int, loss: float) -> None:
        if rig.is_rank0 and job.log_every and step % job.log_every == 0:
            print(f"step {step:5d}  loss {loss:.4f}  lr {job.inner.lr_at(step - 1):.2e}", flush=True)

    result = trainer.run(rig.shard(windows.batches(ids, job.inner.micro_batch)), on_step=log)
    heldout = windows.batches(windows.sample_heldout(job.seed, job.eval_windows), job.inner.micro_batch)
    heldout_loss = evaluate(model, heldout, job.inner.autocast)
    sha256 = None
    if rig.is_rank0 and job.out:
        sha256 = save_checkpoint(
            job.out, model.state_dict(), {"model_config": json.dumps(job.model.to_dict())}
        )
    rig.barrier()  # nobody leaves before the checkpoint exists
    return RigReport(
        result.losses,
        heldout_loss,
        result.tokens,
        result.seconds,
        rig.world_size,
        sha256,
        corpus.manifest_sha256,
    )


def _local_worker(rank: int, world_size: int, store_path: str, jobs: Sequence[RigJob]) -> None:
    torch.set_num_threads(1)  # N processes share the CPU cores
    rig = Rig.from_store(dist.FileStore(store_path, world_size), rank, world_size)
    try:
        for job in jobs:
            train(rig, job)
    finally:
        rig.close()


def launch_local(world_size: int, jobs: Sequence[RigJob], store_path: str | Path) -> None:
    """Run `jobs` on a rig of `world_size` local processes, rendezvous through a fresh file."""
    if Path(store_path).exists():
        raise ValueError(f"{store_path} exists; the rendezvous file must be new")
    mp.spawn(_local_worker, args=(world_size, str(store_path), list(jobs)), nprocs=world_size, join=True)


def _parse(argv: Sequence[str] | None) -> RigJob:
    parser = argparse.ArgumentParser(prog="python -m training.rig", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="devnet", help="model preset: tiny, devnet, 10m, 1b")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step, whole rig")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_seq_len")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", nargs="*", default=[], help="files/folders; default: built-in corpus")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", default=None, help="checkpoint (.safetensors) written by rank 0")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    model = ModelConfig.preset(args.preset)
    inner = InnerConfig.fitted(
        steps=args.steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        total_steps=args.steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len or model.max_seq_len,
        compile=args.compile,
    )
    return RigJob(
        model=model,
        inner=inner,
        seed=args.seed,
        corpus=tuple(args.corpus),
        cache_dir=args.cache_dir,
        out=args.out,
        log_every=args.log_every,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        job = _parse(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rig = Rig.init()
    try:
        report = train(rig, job)
    finally:
        rig.close()
    if rig.is_rank0:
        print(json.dumps(asdict(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
