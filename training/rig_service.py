"""A rig that lives for the epoch: its processes keep the model, the optimizer state and any compiled
graph across rounds, and take the host daemon's rounds through a folder (the *mailbox*).

The daemon (`gonka_node.host.rig_round.RigRounds`) starts one torchrun job; every process runs `serve`.
Every process reads the daemon's orders itself (no collective waits while the rig idles between rounds:
a round's aggregation can take longer than a collective's timeout); rank 0 alone writes back.

    order.json             the daemon's latest order: {"seq", "round", "global", "base", "keep", "skipped", "moves"} or {"seq", "stop"}
    move-<seq>-<i>[-shift].safetensors   the daemon: move i's target (and its shift), once its step is reported
    progress-<seq>.jsonl   rank 0, one line per inner step: {"step": i (1 … H), "loss": x}
    payload-<seq>.bin      rank 0: the round's payload, written before the report
    report-<seq>.json      rank 0: the round's figures; it exists once round <seq> is done
    rank-<k>.json          each process: its pid (diagnostics; the tests kill a process through it)

Between rounds the rig's state lives in *versions* on disk, `state/after-<r>/rank-<k>.pt`: every
process's share after training round r (`after-0` is the state before the first round and is never
written). An order names the version to start from (`base`), and the one other version the daemon
may still roll back to (`keep`); the rest are deleted. The daemon moves `base` forward only when the
aggregator accepted the round, so a refused round leaves no trace, and a process that dies is
restarted by torchrun's agent with the whole rig, which reloads `base` and trains the round again:
deterministic, so the retried round sends the payload the first attempt would have.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import Tensor

from training.durable import atomic_write, durable_replace, fsync_path
from training.overlap import base_round
from training.rig import Rig
from training.rig_moves import OrderReplaced, RigMove
from training.sharded import held_bytes
from training.streaming import StreamSchedule
from training.worker import DiLoCoWorker, Rebase, RoundFigures, Shifted

StepHook = Callable[[int, float], None]


class RoundWorker(Protocol):
    """One host slot's rounds on a rig; `training.sharded.ShardedWorker` or `ReplicatedWorker`."""

    def run_round(self, round_index: int, global_path: Path, payload_path: Path, on_step: StepHook | None,
                  skipped: Sequence[int] = (), moves: Sequence[RigMove] = ()) -> RoundFigures:
        """Train the round from the global model in `global_path`; rank 0 writes the payload. `skipped`:
        a streamed epoch's rounds the chain skipped since the state's last landing (they land nothing).
        `moves`: where the round moves onto another base partway (an eager round's late forecast, merge)."""
        ...

    def reset(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def held_bytes(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class RoundOrder:
    seq: int
    round: int = 0
    global_path: str = ""
    base: int = 0  # the state version to start from: the round after which it was saved (0: initial)
    stop: bool = False
    # A version the daemon may still roll back to, kept with `base` (an overlapped top-k host's state
    # before the round uploading meanwhile: the previous order's base); None: only `base`.
    keep: int | None = None
    # A streamed epoch (training/streaming.py): the rounds the chain skipped since the landing of `base`'s
    # state, up to the global model's round: no fragment lands from them.
    skipped: Sequence[int] = ()
    # An eager round's moves (training.worker.Rebase): the inner steps after which the rig moves onto the
    # base the daemon writes then (`Mailbox.move_path`), once its first `step` steps are reported.
    moves: Sequence[int] = ()


@dataclass(frozen=True)
class RoundReport:
    seq: int
    round: int
    base: int
    delta_norm: float
    mean_loss: float
    last_loss: float
    tokens: int
    seconds: float  # the inner loop's
    round_s: float  # from reading the order to the payload on disk: what the daemon waited, less polling
    ranks: list[dict[str, Any]]  # per process: pid, held bytes, peak RSS
    residual_root: str = ""  # hex: the root of the rig's residual after the round (rank 0 joins the leaves)


class Mailbox:
    """The files through which the daemon and rank 0 exchange rounds (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def post(self, order: RoundOrder) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.root / "order.json", lambda p: p.write_text(json.dumps(asdict(order))))

    def order(self) -> RoundOrder | None:
        try:
            return RoundOrder(**json.loads((self.root / "order.json").read_text()))
        except FileNotFoundError:
            return None

    def progress_path(self, seq: int) -> Path:
        return self.root / f"progress-{seq}.jsonl"

    def move_path(self, seq: int, index: int, shift: bool = False) -> Path:
        """Move `index` of order `seq`: its target model (safetensors), or the target's shift from the base
        before it (`training.worker.Shifted`), which the daemon writes first when it has one."""
        return self.root / f"move-{seq}-{index}{'-shift' if shift else ''}.safetensors"

    def payload_path(self, seq: int) -> Path:
        return self.root / f"payload-{seq}.bin"

    def report_path(self, seq: int) -> Path:
        return self.root / f"report-{seq}.json"

    def write_report(self, report: RoundReport) -> None:
        atomic_write(self.report_path(report.seq), lambda p: p.write_text(json.dumps(asdict(report))))

    def report(self, seq: int) -> RoundReport | None:
        try:
            return RoundReport(**json.loads(self.report_path(seq).read_text()))
        except FileNotFoundError:
            return None

    def last_reported(self) -> int:
        seqs = [int(p.stem.split("-")[1]) for p in self.root.glob("report-*.json")]
        return max(seqs, default=0)

    def progress(self, seq: int, offset: int) -> tuple[list[tuple[int, float]], int]:
        """Steps logged since byte `offset`, and the next offset (a retried round starts its file again)."""
        path = self.progress_path(seq)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return [], 0
        if len(data) < offset:
            offset = 0
        complete = data[offset:].rpartition(b"\n")[0]
        lines = [json.loads(line) for line in complete.splitlines() if line]
        return [(int(x["step"]), float(x["loss"])) for x in lines], offset + len(complete) + (1 if complete else 0)

    def announce(self, rank: int) -> None:
        """This process waits for orders: its pid, and which start of the rig it belongs to (torchrun's
        agent counts its restarts of the whole rig)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        atomic_write(self.root / f"rank-{rank}.json",
                     lambda p: p.write_text(json.dumps({"pid": os.getpid(), "restart": restart})))

    def announced(self, rank: int) -> tuple[int, int] | None:
        """The (pid, restart) rank `rank` last announced, or None."""
        try:
            entry = json.loads((self.root / f"rank-{rank}.json").read_text())
        except FileNotFoundError:
            return None
        return int(entry["pid"]), int(entry.get("restart", 0))

    def pid(self, rank: int) -> int | None:
        entry = self.announced(rank)
        return None if entry is None else entry[0]


class StateVersions:
    """The rig's state after each trained round, one file per process (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, version: int) -> Path:
        return self.root / f"after-{version}"

    def save(self, version: int, state: Mapping[str, Any], rig: Rig) -> None:
        """Every process writes its share; the version appears (an atomic rename) once all have."""
        partial = self.root / f"after-{version}.partial"
        if rig.is_rank0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        rig.barrier()
        mine = partial / f"rank-{rig.rank}.pt"
        torch.save(dict(state), mine)
        fsync_path(mine)
        rig.barrier()
        if rig.is_rank0:
            (partial / "rig.json").write_text(json.dumps({"world_size": rig.world_size}))
            shutil.rmtree(self.path(version), ignore_errors=True)
            durable_replace(partial, self.path(version))

    def load(self, version: int, rig: Rig) -> dict[str, Any]:
        where = self.path(version)
        try:
            saved = json.loads((where / "rig.json").read_text())["world_size"]
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{where} is missing: the rig's state after round {version}, which the host's progress names"
            ) from None
        if saved != rig.world_size:
            raise ValueError(
                f"{where} holds the state of a rig of {saved} processes; this rig has {rig.world_size}: "
                f"run with --gpus {saved}"
            )
        return torch.load(where / f"rank-{rig.rank}.pt", weights_only=True, map_location=rig.device)

    def keep_only(self, *versions: int) -> None:
        kept = {self.path(v) for v in versions}
        for old in self.root.glob("after-*"):
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)


class FileTensors(Mapping[str, Tensor]):
    """The tensors of an open safetensors file, each read when asked for (on `device`)."""

    def __init__(self, handle: Any, device: torch.device) -> None:
        self.handle, self.device = handle, device
        self.names = sorted(handle.keys())

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.handle.get_tensor(name).to(self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class ReplicatedWorker:
    """`RoundWorker` for a rig whose processes each hold the whole model (gradients all-reduced).
    `stream`: a streamed epoch's schedule, its rounds trained on from the worker's own model, landing the
    synced fragments from the global model of the round's base (`overlap`'s `base_round`)."""

    def __init__(self, worker: DiLoCoWorker, rig: Rig, stream: StreamSchedule | None = None,
                 overlap: str = "off") -> None:
        self.worker, self.rig, self.stream, self.overlap = worker, rig, stream, overlap

    def run_round(self, round_index: int, global_path: Path, payload_path: Path, on_step: StepHook | None,
                  skipped: Sequence[int] = (), moves: Sequence[RigMove] = ()) -> RoundFigures:
        with contextlib.ExitStack() as files, safe_open(str(global_path), "pt") as handle:
            params = FileTensors(handle, self.rig.device)

            def opened(path: Path) -> FileTensors:  # open until the round's Δ is taken from the last target
                return FileTensors(files.enter_context(safe_open(str(path), "pt")), self.rig.device)

            def target(move: RigMove) -> Mapping[str, Tensor] | Shifted:
                at, shift = move.wait()
                return opened(at) if shift is None else Shifted(opened(at), opened(shift))

            rebases = [Rebase(m.step, functools.partial(target, m)) for m in moves]
            if self.stream is not None and moves:  # the recipe refuses it (streamed rounds are not eager)
                raise ValueError("a streamed round does not move onto another base partway")
            if self.stream is None:
                result = self.worker.train_round(round_index, params, on_step, rebases=rebases)
            else:
                result = self.worker.network_stream_round(self.stream, round_index, params,
                                                          base_round(round_index, self.overlap), skipped, on_step,
                                                          root=True)
        if self.rig.is_rank0:
            atomic_write(payload_path, lambda p: p.write_bytes(result.payload))
        assert result.residual_root is not None  # asked for (train_round's default)
        return RoundFigures(result.round, result.delta_norm, result.mean_loss, result.last_loss, result.tokens,
                            result.seconds, result.residual_root)

    def reset(self) -> None:
        self.worker.trainer.restart(0)
        self.worker.feedback.residual = {}
        self.worker.landed = None  # a streamed epoch's next round loads the global model whole

    def state_dict(self) -> dict[str, Any]:
        return self.worker.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.worker.load_state_dict(state)

    def held_bytes(self) -> dict[str, int]:
        return held_bytes(self.worker.model, self.worker.trainer.optimizer)


class RigService:
    """The loop every process of a live rig runs: wait for an order, train, save the state, report."""

    def __init__(
        self, rig: Rig, mailbox: Mailbox, versions: StateVersions, worker: RoundWorker,
        parent_alive: Callable[[], bool], poll_s: float = 0.05,
    ) -> None:
        self.rig, self.mailbox, self.versions, self.worker = rig, mailbox, versions, worker
        self.parent_alive, self.poll_s = parent_alive, poll_s
        self.held: int | None = None  # the state version the worker holds in memory (None: unknown)

    def serve(self) -> None:
        """Take orders until a stop order, or until the daemon is gone."""
        self.mailbox.announce(self.rig.rank)
        done = self.mailbox.last_reported()  # after a restart: a round without its report runs again
        while True:
            order = self._next_order(done)
            if order is None or order.stop:
                return
            with contextlib.suppress(OrderReplaced):  # every process sees the newer order: none waits in a collective
                self.run(order)
            done = order.seq

    def _next_order(self, done: int) -> RoundOrder | None:
        while True:
            order = self.mailbox.order()
            if order is not None and order.seq > done:
                return self.rig.broadcast_object(order)  # every process runs rank 0's reading
            if not self.parent_alive():
                return None
            time.sleep(self.poll_s)

    def run(self, order: RoundOrder) -> RoundReport:
        started = time.perf_counter()
        self._hold(order.base)
        if self.rig.is_rank0:
            # Nobody reads another version any more: the round saves a new one, so at most three exist.
            self.versions.keep_only(order.base, *(() if order.keep is None else (order.keep,)))
        steps = _StepLog(self.mailbox.progress_path(order.seq)) if self.rig.is_rank0 else None
        try:
            moves = [RigMove(step, self.mailbox.move_path(order.seq, i), self.mailbox.move_path(order.seq, i, True),
                             functools.partial(self._replaced, order.seq), self.poll_s)
                     for i, step in enumerate(order.moves)]
            figures = self.worker.run_round(
                order.round, Path(order.global_path), self.mailbox.payload_path(order.seq), steps, order.skipped, moves
            )
        except OrderReplaced:
            self.held = None  # half a round trained: the next order reloads its base version
            raise
        finally:
            if steps is not None:
                steps.close()
        round_s = time.perf_counter() - started
        self.versions.save(order.round, self.worker.state_dict(), self.rig)
        self.held = order.round
        ranks = self.rig.gather_object(self._describe())
        report = RoundReport(order.seq, order.round, order.base, figures.delta_norm, figures.mean_loss,
                             figures.last_loss, figures.tokens, figures.seconds, round_s, ranks or [],
                             figures.residual_root.hex())
        if self.rig.is_rank0:
            self.mailbox.write_report(report)
        return report

    def _replaced(self, seq: int) -> bool:
        order = self.mailbox.order()
        return order is not None and order.seq != seq

    def _hold(self, base: int) -> None:
        """Bring the worker's in-memory state to version `base` (nothing to do in the common case)."""
        if self.held == base:
            return
        if base == 0:
            self.worker.reset()
        else:
            self.worker.load_state_dict(self.versions.load(base, self.rig))
        self.held = base

    def _describe(self) -> dict[str, Any]:
        return {
            "rank": self.rig.rank,
            "pid": os.getpid(),
            "held_bytes": self.worker.held_bytes(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        }


class _StepLog:
    """Rank 0's per-step progress lines (flushed: the daemon tails them for its progress events)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")
        self.count = 0

    def __call__(self, step: int, loss: float) -> None:
        self.count += 1
        self.file.write(json.dumps({"step": self.count, "loss": loss}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
