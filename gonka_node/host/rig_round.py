"""How a host trains its rounds: in the daemon's own process, or on a rig that lives for the epoch.

`LocalRounds` runs the round in the daemon (`gonka-node run` on a CPU, one process). `RigRounds`
starts one torchrun job (`torch.distributed.run --standalone`, its elastic agent restarting the whole
rig if a process dies) whose processes keep the model, the AdamW state and any compiled graph on
their devices for the epoch and take the daemon's rounds through a mailbox folder
(`training.rig_service`). Each process loads only what it trains on from the daemon's global-model
file; rank 0 writes the payload. With `--shard sharded` the rig's state is split over its processes
by FSDP2 (`training.sharded`); replicated, every process holds it all and gradients are all-reduced.

The daemon's `state_dict()` of a rig is only the *version* of the rig's state to start the next round
from (`{"rig": {"base": r, ...}}`, saved in the host's progress): the state itself stays in the rig's
files, so a refused round rolls back by naming the previous version, as the one-process worker's
state does. Either way the payload is the one a one-process host sends, byte for byte on CPU with
`grad_accum` equal to the number of processes (docs/ARCHITECTURE.md, "Rigs", for the tolerance
elsewhere).

`python -m gonka_node.host.rig_process --setup FILE` is what torchrun runs in every process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
from safetensors.torch import save_file
from torch import Tensor

from gonka_node.core.recipe import Recipe
from gonka_node.host.sealing import SealedRound, StateAfterSeal
from training.codecs import get_codec, spec_of
from training.model import Llama, build_model
from training.overlap import base_round
from training.rig_service import (
    Mailbox,
    RoundOrder,
    RoundReport,
)
from training.streaming import StreamSchedule, stream_schedule
from training.worker import Assignment, DiLoCoWorker, Rebase, Shifted, WorkerRound

SHARDINGS = ("auto", "replicated", "sharded")
StepHook = Callable[[int, float], None]  # (step within the round, from 1; loss)


class RigError(RuntimeError):
    pass


@dataclass(frozen=True)
class RigOptions:
    """`gonka-node run --gpus N --shard … --activation-checkpointing --compile`: host-local choices
    that change how fast a round trains, not what it sends."""

    procs: int = 1
    sharding: str = "auto"  # auto: sharded when one GPU cannot hold the training state (training.plan)
    checkpoint_activations: bool = False
    compile: bool = False
    max_restarts: int = 3  # times torchrun's agent restarts a rig whose process died, per rig start
    stall_s: float = 1800.0  # a round with no step for this long, the rig up, stops it (`--rig-stall-s`)
    # A rig (re)starting for this long stops it (`--rig-start-s`): joining the rig, building the model and
    # loading the data take what they take on a large model, so the stall clock does not run meanwhile.
    start_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.procs < 1:
            raise RigError(f"--gpus {self.procs}: a rig has at least one process")
        if self.sharding not in SHARDINGS:
            raise RigError(f"--shard {self.sharding!r}: choose one of {', '.join(SHARDINGS)}")
        if self.max_restarts < 0:
            raise RigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.stall_s > 0:
            raise RigError(f"--rig-stall-s {self.stall_s}: give the seconds a round may go without a step (> 0)")
        if not self.start_s > 0:
            raise RigError(f"--rig-start-s {self.start_s}: give the seconds the rig may take to start (> 0)")


def check_rig_size(recipe: Recipe, procs: int) -> None:
    if procs < 1:
        raise RigError(f"--gpus {procs}: a rig has at least one process")
    if recipe.grad_accum % procs:
        raise RigError(
            f"--gpus {procs}: the epoch's recipe accumulates {recipe.grad_accum} micro-batches per step, "
            f"which do not split evenly over {procs} processes; use a divisor of {recipe.grad_accum}"
        )


def make_worker(recipe: Recipe, assignment: Assignment, cache_dir: Path | None, model: Llama | None = None) -> DiLoCoWorker:
    """The host's one-process worker for this recipe and slot (on the recipe's initial model unless given)."""
    return DiLoCoWorker(
        model if model is not None else build_model(recipe.model, recipe.init_seed),
        recipe.inner_config(),
        get_codec(recipe.codec),
        recipe.windows(cache_dir),
        assignment,
        recipe.ef_decay,
    )


def host_rounds(
    recipe: Recipe, assignment: Assignment, cache_dir: Path | None, rig: RigOptions | None, rig_dir: Path,
    keep_previous: bool = False,
) -> Rounds:
    """What a host daemon trains its rounds with: its own process (`rig` None), or a rig of processes
    started later (`RigRounds.start`) that keeps its state in `rig_dir` (RigError: its size does not split
    the recipe's step)."""
    if rig is None:
        return LocalRounds(make_worker(recipe, assignment, cache_dir), recipe_stream(recipe), recipe.overlap)
    return RigRounds(rig, recipe, assignment, cache_dir, rig_dir, keep_previous=keep_previous)


def recipe_stream(recipe: Recipe) -> StreamSchedule | None:
    """A network epoch's stream schedule (rounds from 1; None: not streamed), from the model's shapes alone."""
    if recipe.stream_fragments <= 1:
        return None
    return stream_schedule(recipe, spec_of(dict(Llama(recipe.model, device="meta").named_parameters())), first_round=1)


class Rounds(Protocol):
    """What the host daemon trains its rounds with (`LocalRounds` or `RigRounds`)."""

    stream: StreamSchedule | None  # a streamed epoch's schedule: round r's payload and update hold its fragment
    skipped: Callable[[int], bool]  # a streamed epoch: whether the chain skipped a finalized round (the daemon's)

    def start(self) -> None: ...

    def train_round(
        self, round_index: int, params: Mapping[str, Tensor], params_file: Callable[[], Path], on_step: StepHook,
        rebases: Sequence[Rebase] = (),
    ) -> WorkerRound | SealedRound:
        """Train `round_index` from the global model (`params`, or the same in the file `params_file()`
        returns), moving onto other bases on the way as `rebases` say (a rig through its mailbox); the state
        moves on to after this round (`load_state_dict` takes it back)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def snapshot(self) -> Mapping[str, Any]:
        """`state_dict()` as of now, unchanged by the rounds trained after it (a rollback point)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def residuals(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The error-feedback residuals before and after the last trained round's compress (e_{r−1},
        e_r; a name absent was zero): what a challenge of that round opens."""
        ...

    def residuals_of(self, state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """`residuals()` of a kept `state_dict()` (`HostStore.save_sent`): an overlapped host has trained
        the next round since, so round r's challenge opens what the state kept with round r holds."""
        ...

    def close(self) -> None: ...


class LocalRounds:
    """Rounds in the daemon's process: its `DiLoCoWorker` holds the whole state. `stream`: a streamed
    epoch's schedule (training/streaming.py); its rounds train on from the worker's own model."""

    def __init__(self, worker: DiLoCoWorker, stream: StreamSchedule | None = None, overlap: str = "off") -> None:
        self.worker, self.stream, self.overlap = worker, stream, overlap
        self.sparse = False  # whether a round also returns its sparse payload's entries (an eager host)
        # an eager recipe's forecast_step: each round's seal runs beside the next round's first steps
        # (host/sealing.py); `on_sealed` is told of each round so sealed, from the seal's thread
        self.seal_behind = False
        self.on_sealed: Callable[[WorkerRound], None] = lambda _round: None
        self._sealing: SealedRound | None = None  # the last round sealed behind (its thread may run yet)
        # a streamed epoch: whether the chain skipped a finalized round (it synced no fragment); the daemon's
        self.skipped: Callable[[int], bool] = lambda _round: False

    def start(self) -> None:
        return None

    def train_round(
        self, round_index: int, params: Mapping[str, Tensor], params_file: Callable[[], Path], on_step: StepHook,
        rebases: Sequence[Rebase] = (),
    ) -> WorkerRound | SealedRound:
        count = iter(range(1, sys.maxsize))

        def step(_step: int, loss: float) -> None:
            on_step(next(count), loss)

        if self.stream is not None:
            if rebases:
                raise RigError("a streamed round does not move onto another base partway")
            return self._stream_round(self.stream, round_index, params, step)
        if not self.seal_behind:
            # the residual's root is hashed where the round is saved (`HostSaves`), beside the next round
            return self.worker.train_round(round_index, params, step, root=False, sparse=self.sparse, rebases=rebases)
        delta, result = self.worker.local_delta(round_index, params, step, rebases)
        self._sealed()  # one seal at a time (the round before's: its forecast waited for it already)
        self._sealing = SealedRound(self.worker, round_index, delta, result, self.sparse, self.on_sealed)
        return self._sealing

    def _stream_round(self, stream: StreamSchedule, round_index: int, params: Mapping[str, Tensor],
                      step: Callable[[int, float], None]) -> WorkerRound:
        """A streamed round from `params`, the held global model, which is the one after the round's base
        (`base_round`: the daemon brings it there before training); `skipped` says which rounds the chain
        skipped (no sync: nothing of them lands)."""
        held = base_round(round_index, self.overlap)
        since = held if self.worker.landed is None else self.worker.landed  # None: nothing lands (it begins)
        skipped = [r for r in range(since + 1, held + 1) if self.skipped(r)]
        return self.worker.network_stream_round(stream, round_index, params, held, skipped, step)

    def _sealed(self) -> None:
        """No seal runs once this returns (a seal that failed raises its error here)."""
        if self._sealing is not None:
            self._sealing.wait()

    def state_dict(self) -> dict[str, Any]:
        self._sealed()
        return self.worker.state_dict()

    def snapshot(self) -> Mapping[str, Any]:
        """As of now; while a round seals behind, its residuals as that seal leaves them (read, they wait)."""
        if self._sealing is not None and not self._sealing.done:
            return StateAfterSeal(self.worker.inner_snapshot(), self._sealing)
        return self.worker.snapshot()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "rig" in state:
            raise RigError(f"this host's saved state belongs to a rig of {state['rig']['procs']} processes; "
                           f"run with --gpus {state['rig']['procs']}")
        self._sealed()  # a round trained again: the seal of its first training is over before its state goes
        self.worker.load_state_dict(state)

    def residuals(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        self._sealed()
        return dict(self.worker.feedback.previous), dict(self.worker.feedback.residual)

    def residuals_of(self, state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        if "rig" in state:
            raise RigError(f"this host's kept state belongs to a rig of {state['rig']['procs']} processes")
        feedback = state["feedback"]
        return dict(feedback.get("previous", {})), dict(feedback["residual"])

    def close(self) -> None:
        if self._sealing is not None:
            self._sealing.join()


@dataclass(frozen=True)
class RigSetup:
    """What every rig process reads at start (JSON next to the mailbox)."""

    recipe: dict[str, Any]
    epoch_seed: int
    slot: int
    max_slots: int
    cache_dir: str | None
    sharding: str
    checkpoint_activations: bool
    compile: bool
    mailbox: str
    state_dir: str
    parent_pid: int
    beacon: str = ""  # hex; the assignment's post-sign-in randomness (training.worker.Assignment.beacon)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> RigSetup:
        return cls(**json.loads(path.read_text()))


class RigRounds:
    """Rounds on a torchrun job of `options.procs` processes that lives from `start()` to `close()`."""

    def __init__(
        self, options: RigOptions, recipe: Recipe, assignment: Assignment, cache_dir: Path | None, work_dir: Path,
        poll_s: float = 0.05, keep_previous: bool = False,
    ) -> None:
        check_rig_size(recipe, options.procs)
        self.options, self.recipe, self.assignment, self.cache_dir = options, recipe, assignment, cache_dir
        self.work_dir, self.poll_s = work_dir, poll_s
        self.base = 0  # the rig-state version the next round starts from
        # `keep_previous`: the daemon may roll back to the state before the round uploading (an overlapped
        # top-k host whose previous round is refused), so the rig keeps the previous order's base as well.
        self.keep_previous, self.previous_base = keep_previous, 0
        self.seq = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.mailbox: Mailbox | None = None
        self.log_path: Path | None = None
        self.last_report: RoundReport | None = None  # the rig's figures of the last round (benchmarks)
        self.stream = recipe_stream(recipe)  # the rig's processes build the same schedule (`build_rig_worker`)
        # a streamed epoch: whether the chain skipped a finalized round (it synced no fragment); the daemon's
        self.skipped: Callable[[int], bool] = lambda _round: False

    def start(self) -> None:
        """Launch the rig (it builds its model and loads its data while the daemon waits for a round).
        An earlier daemon's runs keep their logs; the models their mailboxes may still hold (a round's
        moves and payload, left by a crash mid-round) go: nothing reads them again."""
        for stale in self.work_dir.glob("run-*/mailbox/*"):
            if stale.name.startswith(("move-", "payload-")):
                stale.unlink(missing_ok=True)
        run = self.work_dir / f"run-{uuid.uuid4().hex[:8]}"
        run.mkdir(parents=True)
        self.mailbox, self.log_path = Mailbox(run / "mailbox"), run / "rig.log"
        setup = RigSetup(
            self.recipe.to_dict(), self.assignment.epoch_seed, self.assignment.slot, self.assignment.max_slots,
            str(self.cache_dir) if self.cache_dir is not None else None, self.options.sharding,
            self.options.checkpoint_activations, self.options.compile, str(self.mailbox.root),
            str(self.work_dir / "state"), os.getpid(), self.assignment.beacon.hex(),
        )
        setup.save(run / "setup.json")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.options.procs}",
            f"--max-restarts={self.options.max_restarts}", "--monitor-interval=0.5",
            "-m", "gonka_node.host.rig_process", "--setup", str(run / "setup.json"),
        ]
        with self.log_path.open("wb") as log:
            # Its own session: the daemon stops the agent and its workers together (close()).
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until every process has built its model and waits for orders (at most `timeout_s`,
        default `options.start_s`); returns the seconds waited. (The daemon need not: an order posted
        earlier is taken as soon as the rig is up.)"""
        if self.proc is None or self.mailbox is None:
            raise RigError("the rig is not started")
        limit = self.options.start_s if timeout_s is None else timeout_s
        started = time.monotonic()
        while self.starting():
            if self.proc.poll() is not None:
                raise RigError(f"the rig stopped while starting (exit code {self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() - started > limit:
                raise RigError(f"the rig did not start within {limit:.0f} s:\n{self.log_tail()}")
            time.sleep(self.poll_s)
        return time.monotonic() - started

    def starting(self) -> bool:
        """Whether some process of the rig has not announced itself since the rig last (re)started: it
        is still joining the rig, building its model or loading its data. A process announces its pid
        and the agent's restart count once it waits for orders (`Mailbox.announce`); when one dies,
        torchrun's agent restarts every process, so until all have announced again the ranks' counts
        differ or a pid is gone (a dead one not reaped yet still counts as alive, for at most the
        agent's 0.5 s monitor interval, unless the counts give the restart away)."""
        assert self.mailbox is not None
        entries = [self.mailbox.announced(rank) for rank in range(self.options.procs)]
        up = [e for e in entries if e is not None]
        return (len(up) < len(entries) or len({restart for _pid, restart in up}) > 1
                or not all(process_alive(pid) for pid, _restart in up))

    def train_round(
        self, round_index: int, params: Mapping[str, Tensor], params_file: Callable[[], Path], on_step: StepHook,
        rebases: Sequence[Rebase] = (),
    ) -> WorkerRound:
        if self.proc is None or self.mailbox is None:
            raise RigError("the rig is not started")
        self.seq += 1
        keep = self.previous_base if self.keep_previous else None
        order = RoundOrder(self.seq, round_index, str(params_file()), self.base, keep=keep,
                           skipped=self._skipped_since_base(round_index), moves=tuple(r.step for r in rebases))
        self.mailbox.post(order)
        self.previous_base = order.base
        try:
            report = self._await(order, on_step, rebases)
        finally:  # read by the rig already (mapped: a file unlinked stays readable to who opened it)
            for i in range(len(rebases)):
                for shift in (False, True):
                    path = self.mailbox.move_path(order.seq, i, shift)
                    for leftover in (path, path.with_name(path.name + ".tmp")):  # .tmp: a write that failed
                        leftover.unlink(missing_ok=True)
        payload_path = self.mailbox.payload_path(order.seq)
        payload = payload_path.read_bytes()
        for path in (payload_path, self.mailbox.progress_path(order.seq)):
            path.unlink(missing_ok=True)
        self.base = round_index
        self.last_report = report
        return WorkerRound(round_index, payload, report.delta_norm, report.mean_loss, report.last_loss,
                           report.tokens, report.seconds, bytes.fromhex(report.residual_root))

    def _skipped_since_base(self, round_index: int) -> tuple[int, ...]:
        """A streamed round's skipped rounds the rig's landing must know of: those after the last landing of
        the state it starts from (the one after round `base`, which landed through `base`'s base round;
        none before the first round: that state begins from the global model) up to the held model's."""
        if self.stream is None or self.base == 0:
            return ()
        held, since = base_round(round_index, self.recipe.overlap), base_round(self.base, self.recipe.overlap)
        return tuple(r for r in range(since + 1, held + 1) if self.skipped(r))

    def _await(self, order: RoundOrder, on_step: StepHook, rebases: Sequence[Rebase] = ()) -> RoundReport:
        """The round's report, passing its steps on as they come; a rig that stopped, or went
        `stall_s` without a step while up (a hung collective), or `start_s` (re)starting (a hung rendezvous),
        fails the round. The stall clock starts again when the rig is up: its first start, or a restart
        after a process died, rebuilds the model, which on a large one may take longer than a step.
        `rebases`: once a move's step is reported, its target is taken (`Rebase.target`, as a one-process
        round takes it there) and written for the rig, which waits for it (`training.rig_moves`)."""
        assert self.proc is not None and self.mailbox is not None
        offset, last_sign, starting_since, moved = 0, time.monotonic(), None, 0
        while True:
            report = self.mailbox.report(order.seq)
            steps, offset = self.mailbox.progress(order.seq, offset)
            for step, loss in steps:
                on_step(step, loss)
                while moved < len(rebases) and step >= rebases[moved].step:  # a restarted rig finds it written
                    self._write_move(order.seq, moved, rebases[moved].target())
                    moved, last_sign = moved + 1, time.monotonic()
            if report is not None:
                if moved < len(rebases):  # the rig reported a round without taking every move
                    raise RigError(f"round {order.round}: the rig finished without {len(rebases) - moved} of "
                                   f"its {len(rebases)} moves; the end of {self.log_path}:\n{self.log_tail()}")
                return report
            if self.proc.poll() is not None:
                raise RigError(f"round {order.round}: the rig stopped (exit code {self.proc.returncode}) after "
                               f"{self.options.max_restarts} restarts; the end of {self.log_path}:\n{self.log_tail()}")
            now = time.monotonic()
            if steps:
                last_sign = now
            if self.starting():
                starting_since = now if starting_since is None else starting_since
                last_sign = now
                if now - starting_since > self.options.start_s:
                    self._stop(order, f"did not start within {self.options.start_s:.0f} s",
                               "raise --rig-start-s if building its model and loading its data take that long")
            else:
                starting_since = None
            if now - last_sign > self.options.stall_s:
                self._stop(order, f"took no step for {self.options.stall_s:.0f} s",
                           "raise --rig-stall-s if its steps are that slow")
            time.sleep(self.poll_s)

    def _write_move(self, seq: int, index: int, target: Mapping[str, Tensor] | Shifted) -> None:
        """Move `index`'s files: the shift first when the target came with one, then the target, whose
        arrival tells the rig both are there (each renamed into place whole)."""
        assert self.mailbox is not None
        files = [] if not isinstance(target, Shifted) else [(self.mailbox.move_path(seq, index, True), target.shift)]
        files.append((self.mailbox.move_path(seq, index), target.target if isinstance(target, Shifted) else target))
        for path, tensors in files:
            staged = path.with_name(path.name + ".tmp")
            save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(staged))
            os.replace(staged, path)

    def _stop(self, order: RoundOrder, what: str, advice: str) -> NoReturn:
        """Stop the rig and fail `order`'s round with the log's tail."""
        tail = self.log_tail()
        self.close(timeout_s=0.0)
        raise RigError(f"round {order.round}: the rig {what}, so it was stopped ({advice}); the end of "
                       f"{self.log_path}:\n{tail}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path is not None else ""

    def state_dict(self) -> dict[str, Any]:
        return {"rig": {"base": self.base, "procs": self.options.procs}}

    def snapshot(self) -> dict[str, Any]:
        # A version's name: the rig's files of it do not change, and it keeps them while the daemon can
        # still roll back to it (the current order's base and, with `keep_previous`, the previous one's).
        return self.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rig = state.get("rig")
        if not isinstance(rig, Mapping):
            raise RigError("this host's saved state belongs to a one-process host (its AdamW state and residual "
                           "are in its state folder, not a rig's); run with --gpus 1")
        if rig["procs"] != self.options.procs:
            raise RigError(f"this host's saved state belongs to a rig of {rig['procs']} processes; "
                           f"run with --gpus {rig['procs']}")
        self.base = int(rig["base"])

    def residuals(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """From the rig's files of its current version (`training.rig_service.StateVersions`): each
        process keeps the residuals of the tensors it owns (sharded) or all of them (replicated), so the
        union over its files is the whole residual. Mapped, not read: only the opened chunks are touched."""
        return self._version_residuals(self.base)

    def residuals_of(self, state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The residuals of the version `state` names: the rig keeps it until it trains from a later one
        (`StateVersions.keep_only`), which an overlapped host does only once that round is final."""
        rig = state.get("rig")
        if not isinstance(rig, Mapping):
            raise RigError("this host's kept state belongs to a one-process host, not a rig")
        return self._version_residuals(int(rig["base"]))

    def _version_residuals(self, version: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        previous: dict[str, Tensor] = {}
        current: dict[str, Tensor] = {}
        for path in sorted((self.work_dir / "state" / f"after-{version}").glob("rank-*.pt")):
            feedback = torch.load(path, weights_only=True, map_location="cpu", mmap=True)["feedback"]
            for name, tensor in feedback.get("previous", {}).items():
                previous.setdefault(name, tensor)
            for name, tensor in feedback["residual"].items():
                current.setdefault(name, tensor)
        return previous, current

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the rig: a stop order, then the session's processes if they linger."""
        if self.proc is None or self.mailbox is None:
            return
        if self.proc.poll() is None:
            self.mailbox.post(RoundOrder(self.seq + 1, stop=True))
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the agent; its processes follow it (follow_daemon)
                self.proc.wait()
        self.proc = None


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
