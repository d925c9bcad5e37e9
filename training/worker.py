"""One host's side of a DiLoCo round: load the global model, take H inner steps on the assigned windows,
and compress the pseudo-gradient with error feedback.

The same object serves the real host daemon (one per process) and the local simulation (K of them in
one process), so what a simulated host sends is byte for byte what a real one would send.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from training.codecs import Codec, ErrorFeedback, Spec, get_codec, round_seed
from training.data import Windows, window_seed
from training.diloco import pseudo_gradient
from training.inner import Batch, GradSync, InnerConfig, InnerResult, InnerTrainer
from training.model import Llama
from training.residual_commit import commitment_layout, residual_root
from training.rig import Rig
from training.streaming import StreamSchedule, merge_fragment


@dataclass(frozen=True)
class Assignment:
    """Which training windows a host slot owns: a pure function of these numbers (see `Windows.assignment`)."""

    epoch_seed: int
    slot: int
    max_slots: int
    # randomness published after sign-in closed (chain.client.signin_beacon) when the recipe asks for it
    beacon: bytes = b""

    @property
    def window_seed(self) -> int:
        """The seed windows are assigned by; codecs keep using `epoch_seed` (their state is public)."""
        return window_seed(self.epoch_seed, self.beacon)


@dataclass(frozen=True)
class Rebase:
    """Partway through a round the local model moves onto another base (training/overlap.py: an eager
    host's late forecast, its merge of the model after r − 1): after `step` of the round's inner steps
    (0 < step < H), θ ← θ + (target − base), and the round's pseudo-gradient is measured from `target`.
    AdamW's state goes on unchanged. `target` is called when the round gets there, so a host may still be
    computing it (or waiting for it) while the first `step` steps train."""

    step: int
    target: Callable[[], Mapping[str, Tensor] | Shifted]


class Shifted(NamedTuple):
    """A `Rebase` target given with its shift, `target − base` in fp32 as `shift_onto` would take it, bit for
    bit: computed off the training path by a caller that writes the old base over in place to make the new
    one (an eager host's forecast, `SpeculativeStep.forecast_shift`), so the round only adds it."""

    target: Mapping[str, Tensor]
    shift: Mapping[str, Tensor]


@dataclass(frozen=True)
class WorkerRound:
    """What one round produced: the payload to send, the root of the residual it left, and what it cost."""

    round: int
    payload: bytes
    delta_norm: float  # of the uncompressed pseudo-gradient; a quick sanity figure for logs
    mean_loss: float
    last_loss: float
    tokens: int
    seconds: float
    # residual_root(e_r) after this round's compress: the host signs it (commitment_root); None when the
    # caller asked for none and computes it itself, off its training path (gonka_node/host/saves.py)
    residual_root: bytes | None
    # a sparse codec's payload as `Codec.decode_sparse` reads it, when asked for (`sparse`): what an eager
    # host forecasts the next round's base with, without decoding its own bytes (training/overlap.py)
    sparse: dict[str, tuple[Tensor, Tensor]] | None = None


@dataclass(frozen=True)
class RoundFigures:
    """A round's figures without its payload (a rig writes the payload to a file)."""

    round: int
    delta_norm: float
    mean_loss: float
    last_loss: float
    tokens: int
    seconds: float
    residual_root: bytes  # rank 0's: the whole residual's (b"" in a sharded rig's other processes)


class SlotWorker:
    """What every worker of a host slot holds between rounds, one process or a sharded rig alike: the
    local model, the inner trainer (AdamW state, schedule) and the error-feedback residual, and the
    slot's windows. It starts each round the same way (`start_round`) and picks the round's codec."""

    def __init__(
        self,
        model: Llama,
        inner: InnerConfig,
        codec: Codec,
        windows: Windows,
        assignment: Assignment,
        ef_decay: float = 1.0,
        first_round: int = 1,
        sync: GradSync | None = None,
    ) -> None:
        self.model = model
        self.first_round = first_round  # the chain numbers rounds from 1; the local simulation from 0
        self.trainer = InnerTrainer(model, inner, sync=sync)
        self.feedback = ErrorFeedback(codec, ef_decay)
        self.windows = windows
        self.assignment = assignment

    def start_round(self, round_index: int, micro_batch: int) -> Iterator[Batch]:
        """Once the global model is loaded: restart the schedule at the round's place when rounds start
        fresh, and return the whole slot's micro-batches of the round, in training order."""
        if self.trainer.config.round_state == "fresh":
            self.trainer.restart(self.round_start_step(round_index))
        return round_batches(self.windows, self.assignment, round_index, self.trainer.config, micro_batch)

    def round_start_step(self, round_index: int) -> int:
        return round_start_step(round_index, self.first_round, self.trainer.config.steps)

    def round_codec(self, round_index: int) -> Codec:
        """The codec as round `round_index` uses it (the mask codec's mask is seeded per round)."""
        return self.feedback.codec.for_round(round_seed(self.assignment.epoch_seed, round_index))


class DiLoCoWorker(SlotWorker):
    """Holds what a host keeps between rounds: the local model, the inner AdamW state and the
    error-feedback residual. `state_dict()` has all of it, so a killed host resumes bit for bit."""

    def __init__(
        self,
        model: Llama,
        inner: InnerConfig,
        codec: Codec,
        windows: Windows,
        assignment: Assignment,
        ef_decay: float = 1.0,
        micro_batch: int | None = None,
        rig: Rig | None = None,
        first_round: int = 1,
    ) -> None:
        super().__init__(model, inner, codec, windows, assignment, ef_decay, first_round, sync=rig)
        self.rig = rig  # several processes of one rig: each takes its share of the micro-batches
        self.micro_batch = micro_batch or inner.micro_batch
        # A streamed epoch (training/streaming.py): the round whose sync this worker's own model has landed
        # last; None until `begin_stream` loads the global model (its model is then no longer the global one).
        self.landed: int | None = None

    def train_round(
        self,
        round_index: int,
        global_params: Mapping[str, Tensor],
        on_step: Callable[[int, float], None] | None = None,
        root: bool = True,
        sparse: bool = False,
        rebases: Sequence[Rebase] = (),
    ) -> WorkerRound:
        """Start from `global_params`, train H steps on this slot's windows of `round_index`, and
        return the compressed pseudo-gradient θ_global − θ_local. `root`: also the root over the residual
        it leaves (`commitment_root`; else None, for a caller that hashes the residual later).
        `rebases`: where the round moves onto other bases on the way (`Rebase`)."""
        delta, result = self.local_delta(round_index, global_params, on_step, rebases)
        return self.seal(round_index, delta, result, root, sparse)

    def begin_stream(self, global_params: Mapping[str, Tensor], landed: int) -> None:
        """A streamed epoch's first round for this worker (or one after its own model was lost): load the
        global model, which holds the syncs of rounds through `landed`; the worker trains on from its own
        model after this, landing later syncs (`land`)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(global_params[name])
        self.landed = landed

    def land(self, schedule: StreamSchedule, synced: Mapping[str, Tensor], upto: int, held: int | None = None,
             skipped: Collection[int] = ()) -> None:
        """Take back the fragments synced since this worker's last landing through round `upto`, from
        `synced`, the held global model as of round `held` (default `upto`), `skipped` rounds synced
        nothing: `StreamSchedule.landing`."""
        if self.landed is None:
            raise ValueError("land: this worker has not begun a streamed epoch (begin_stream)")
        for fragment in schedule.landing(self.landed, upto, held, skipped):
            merge_fragment(self.model, synced, fragment.names, schedule.mix)
        self.landed = max(self.landed, upto)

    def network_stream_round(
        self, schedule: StreamSchedule, round_index: int, held_params: Mapping[str, Tensor], held: int,
        skipped: Collection[int] = (), on_step: Callable[[int, float], None] | None = None, root: bool = False,
    ) -> WorkerRound:
        """A network host's streamed round: `held_params` is the global model after round `held`, the
        round's base (training/overlap.py `base_round`). Lands every fragment synced since the last
        landing from it (`skipped` rounds synced nothing), or loads it whole when the worker has no model
        of its own yet (its first round here, or its state before that was restored), then `stream_round`."""
        if self.landed is None:
            self.begin_stream(held_params, held)
        else:
            self.land(schedule, held_params, held, skipped=skipped)
        return self.stream_round(round_index, held_params, schedule.fragment_of(round_index).names, on_step, root)

    def stream_round(
        self,
        round_index: int,
        anchor: Mapping[str, Tensor],
        names: Sequence[str],
        on_step: Callable[[int, float], None] | None = None,
        root: bool = False,
    ) -> WorkerRound:
        """A streamed round (training/streaming.py): H steps on from the worker's own model (`begin_stream`
        first), then the pseudo-gradient of the fragment `names` alone, measured from `anchor`'s values of
        it (the global model, whose fragment is as its last sync left it), compressed with error feedback
        on those tensors' residuals. `root`: also the root over the whole residual (a rig reports it; a
        streamed epoch carries AdamW state, so no round of it is challenged, but the host signs one)."""
        params = dict(self.model.named_parameters())
        unknown = sorted(set(names) - set(params))
        if unknown or not names:
            raise ValueError(f"stream_round: the fragment's tensors {unknown[:3] or '(none)'} are not the model's")
        if self.landed is None:
            raise ValueError("stream_round: begin_stream first (the worker holds no model of its own yet)")
        batches = iter(self.start_round(round_index, self.micro_batch))
        if self.rig is not None:
            batches = iter(self.rig.shard(batches))
        result = self.trainer.run(batches, on_step=on_step)
        delta = pseudo_gradient({n: anchor[n] for n in names}, {n: params[n] for n in names})
        return self.seal(round_index, delta, result, root=root, part=True)

    def seal(self, round_index: int, delta: dict[str, Tensor], result: InnerResult, root: bool = True,
             sparse: bool = False, part: bool = False) -> WorkerRound:
        """The round's payload from its pseudo-gradient `delta` (`local_delta`, read no more: the residual is
        made in it): compressed with error feedback, the residual's root when `root`, and the payload's
        kept entries when `sparse` (a sparse codec). A host may run it beside the next round's first
        steps, which do not touch the residual (gonka_node/host/sealing.py), never beside another seal.
        `part`: `delta` is one fragment of the model (`stream_round`)."""
        codec = self.round_codec(round_index)
        kept: dict[str, tuple[Tensor, Tensor]] | None = {} if sparse and codec.sparse else None
        squares: dict[str, float] = {}
        # Δ is read no more: e_r is made in it, and its norm taken on the way
        payload = self.feedback.compress(delta, codec, kept, consume=True, squares=squares, part=part)
        norm = math.sqrt(math.fsum(squares[name] for name in delta))
        # the root is over the whole model's residual (a fragment's round leaves the others' as they were)
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()} if part else \
            {n: tuple(d.shape) for n, d in delta.items()}
        signed = commitment_root(self.feedback.residual, shapes, self.feedback.codec) if root else None
        return WorkerRound(
            round=round_index,
            payload=payload,
            delta_norm=norm,
            mean_loss=result.mean_loss,
            last_loss=result.last_loss,
            tokens=result.tokens,
            seconds=result.seconds,
            residual_root=signed,
            sparse=kept,
        )

    def local_delta(
        self,
        round_index: int,
        global_params: Mapping[str, Tensor],
        on_step: Callable[[int, float], None] | None = None,
        rebases: Sequence[Rebase] = (),
    ) -> tuple[dict[str, Tensor], InnerResult]:
        """The round's training, uncompressed: the pseudo-gradient θ_base − θ_local and the loop's result,
        θ_base being `global_params`, or the last `Rebase`'s target when the round moved on the way."""
        steps = check_rebases(rebases, self.trainer.config.steps)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(global_params[name])
        batches = iter(self.start_round(round_index, self.micro_batch))
        if self.rig is not None:
            batches = iter(self.rig.shard(batches))
        base, parts = global_params, []
        for rebase, segment in zip((None, *rebases), steps, strict=True):
            if rebase is not None:
                base = move_onto(self.model, base, rebase.target())  # a shift given is not held past it
            parts.append(self.trainer.run(batches, steps=segment, on_step=on_step))
        return pseudo_gradient(base, dict(self.model.named_parameters())), InnerResult.joined(parts)

    def state_dict(self) -> dict[str, Any]:
        """What a killed host resumes from bit for bit: the inner state and both residuals, and in a
        streamed epoch the worker's own model (its tensors themselves: saved before training goes on) and
        the round it landed last."""
        state = {"inner": self._inner_state(), "feedback": self.feedback.state_dict()}
        if self.landed is not None:
            state["stream"] = self._stream_state(copy_model=False)
        return state

    def _stream_state(self, copy_model: bool) -> dict[str, Any]:
        model = {name: p.detach().clone() if copy_model else p.detach() for name, p in self.model.named_parameters()}
        return {"landed": self.landed, "model": model}

    def _inner_state(self) -> dict[str, Any]:
        """The inner trainer's part of what crosses rounds: in a `fresh` epoch only the clock, since every
        round restarts AdamW (`start_round`), so a kept state holds no moments (two model-sized fp32
        tensors: ~9.6 GB at 1.2B); in a `carry` epoch all of it."""
        if self.trainer.config.round_state == "fresh":
            return {"step": self.trainer.step}
        return self.trainer.state_dict()

    def snapshot(self) -> dict[str, Any]:
        """`state_dict()` as of now, to keep while training goes on (a refused round's rollback point):
        the optimizer's tensors, which its steps update in place, copied; the residuals, which a compress
        replaces and never updates, shared. One copy of the AdamW state (none in a `fresh` epoch), none
        of the residuals. A streamed worker's own model copied too (one model more): going back to it
        undoes the round whole, as going back to a `state_dict()` saved then does."""
        state = {"inner": self.inner_snapshot(), "feedback": self.feedback.state_dict()}
        if self.landed is not None:
            state["stream"] = self._stream_state(copy_model=True)
        return state

    def inner_snapshot(self) -> dict[str, Any]:
        """The inner trainer's part of `snapshot()`: a copy, unchanged by the steps trained after it."""
        return copy.deepcopy(self._inner_state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stream, params = state.get("stream"), dict(self.model.named_parameters())
        saved = stream["model"] if stream is not None else params
        # checked whole before anything loads
        if set(saved) != set(params) or any(tuple(saved[n].shape) != tuple(p.shape) for n, p in params.items()):
            raise ValueError("load_state_dict: the streamed state's model is not this worker's model")
        self.trainer.load_state_dict(dict(state["inner"]))
        self.feedback.load_state_dict(state["feedback"])
        if stream is not None:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(saved[name])
            self.landed = int(stream["landed"])
        else:  # a state from before the worker's first streamed round: its next one loads the global model whole
            self.landed = None


def check_rebases(rebases: Sequence[Rebase], steps: int) -> list[int]:
    """The round's H steps cut at each rebase's step (ValueError unless each lies strictly inside the
    round, after the one before)."""
    cuts = [r.step for r in rebases]
    if any(not 0 < c < steps for c in cuts) or cuts != sorted(set(cuts)):
        raise ValueError(f"rebase steps {cuts} must be increasing and strictly between 0 and the round's {steps} steps")
    return [b - a for a, b in zip([0, *cuts], [*cuts, steps], strict=True)]


def shift_onto(model: Llama, base: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """θ ← θ + (target − base) for every parameter of `model` (the difference taken in fp32, then added
    in place: one rounding each, the same on a host and in its replay); returns `target`."""
    params = dict(model.named_parameters())
    _check_target(params, target)
    with torch.no_grad():
        for name, p in params.items():
            p.add_(target[name].to(p.device, torch.float32) - base[name].to(p.device, torch.float32))
    return target


def _check_target(params: Mapping[str, Tensor], target: Mapping[str, Tensor]) -> None:
    """A rebase's tensors checked whole against the model's before any parameter moves."""
    if set(target) != set(params):
        missing, unexpected = sorted(set(params) - set(target))[:3], sorted(set(target) - set(params))[:3]
        raise ValueError(f"rebase: the target's tensors are not the model's (missing {missing}, unexpected {unexpected})")
    for name, p in params.items():
        if tuple(target[name].shape) != tuple(p.shape):
            raise ValueError(f"rebase: {name} has shape {tuple(target[name].shape)}, the model's is {tuple(p.shape)}")


def move_onto(model: Llama, base: Mapping[str, Tensor], moved: Mapping[str, Tensor] | Shifted) -> Mapping[str, Tensor]:
    """A `Rebase`'s move: `shift_by` when its target came with its shift, else `shift_onto`."""
    return shift_by(model, moved) if isinstance(moved, Shifted) else shift_onto(model, base, moved)


def shift_by(model: Llama, moved: Shifted) -> Mapping[str, Tensor]:
    """θ ← θ + `moved.shift` (`shift_onto`'s move with its difference taken already); returns the target."""
    params = dict(model.named_parameters())
    _check_target(params, moved.shift)
    with torch.no_grad():
        for name, p in params.items():
            p.add_(moved.shift[name].to(p.device, torch.float32))
    return moved.target


def commitment_root(residual: Mapping[str, Tensor], spec: Spec, codec: Codec) -> bytes:
    """The root a host signs for its residual after a round: `residual_root` in the epoch's layout (the
    model's tensors, chunks of 4096 elements or whole top-k codec chunks: `commitment_layout`). Every codec here runs through `ErrorFeedback`; one that loses nothing
    (fp32) leaves an exactly zero residual, whose root is `zero_root`, as before a host's first round."""
    return residual_root(residual, commitment_layout(spec, codec))


def round_start_step(round_index: int, first_round: int, steps: int) -> int:
    """Where a `fresh` round starts on the epoch's schedule: H steps per round since the first, so
    a late joiner or a restarted host trains at the same learning rates as everyone else."""
    if round_index < first_round:
        raise ValueError(f"round {round_index} precedes the first round {first_round}")
    return (round_index - first_round) * steps


def round_batches(
    windows: Windows, assignment: Assignment, round_index: int, inner: InnerConfig, micro_batch: int
) -> Iterator[Batch]:
    """The whole rig's micro-batches of one host slot in one round, in training order."""
    ids = windows.assignment(
        epoch_seed=assignment.window_seed,
        round_index=round_index,
        slot=assignment.slot,
        max_slots=assignment.max_slots,
        windows_per_host=inner.windows_per_round,
    )
    return iter(windows.batches(ids, micro_batch))


def replay_round(
    model: Llama,
    inner: InnerConfig,
    windows: Windows,
    assignment: Assignment,
    round_index: int,
    global_params: Mapping[str, Tensor],
    micro_batch: int | None = None,
    first_round: int = 1,
    rebases: Sequence[Rebase] = (),
) -> dict[str, Tensor]:
    """The uncompressed pseudo-gradient an honest host of `assignment` computes in `round_index` when
    rounds start fresh (`inner.round_state == "fresh"`): the very code path of `DiLoCoWorker`, so on the
    same hardware and library versions the result is bit-identical to the host's."""
    if inner.round_state != "fresh":
        raise ValueError(
            "replay_round needs round_state = 'fresh': with 'carry' a round depends on the host's private "
            "AdamW moments from earlier rounds"
        )
    worker = DiLoCoWorker(model, inner, get_codec("fp32"), windows, assignment, micro_batch=micro_batch,
                          first_round=first_round)
    return worker.local_delta(round_index, global_params, rebases=rebases)[0]
