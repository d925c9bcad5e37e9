"""The inner loop: H AdamW steps on one host's data, between two DiLoCo outer steps.

`InnerTrainer` owns the AdamW optimizer for the whole epoch, because DiLoCo keeps the inner optimizer
state across outer steps, and the step counter that drives the warm-up + cosine schedule. The loop is
plain: for each step, accumulate gradients over micro-batches, (on a multi-GPU rig) sum them across
ranks, clip, step. Data parallelism attaches through the `GradSync` protocol (see `training.rig`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

from training.model import Llama, check_fields

Batch = tuple[torch.Tensor, torch.Tensor]
AutocastMode = Literal["auto", "bf16", "off"]
RoundState = Literal["carry", "fresh"]
ROUND_STATES = ("carry", "fresh")


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    steps: int = 100  # H: inner steps per round
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    total_steps: int = 10_000  # the cosine horizon, in inner steps over the whole epoch
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    micro_batch: int = 8  # windows per forward/backward
    grad_accum: int = 1  # micro-batches per optimizer step, summed over the whole rig
    seq_len: int = 128
    compile: bool = False
    autocast: AutocastMode = "auto"  # "auto": bf16 on CUDA, off on CPU
    # "carry": AdamW moments and the schedule clock run on across rounds (lowest loss). "fresh": each
    # round starts from zero moments with the clock at the round's place in the epoch, so a round is a
    # pure function of (base model, assigned windows, round) that anyone can replay and check
    # (training.worker.replay_round; the aggregator's replay check).
    round_state: RoundState = "carry"

    def __post_init__(self) -> None:
        for name in ("steps", "total_steps", "micro_batch", "grad_accum", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"InnerConfig.{name} must be a positive integer, got {value!r}")
        if not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(
                f"InnerConfig.warmup_steps ({self.warmup_steps}) must be >= 0 and < total_steps ({self.total_steps})"
            )
        if not self.lr > 0:
            raise ValueError(f"InnerConfig.lr must be > 0, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"InnerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("InnerConfig.weight_decay and grad_clip must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"InnerConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.autocast not in ("auto", "bf16", "off"):
            raise ValueError(f"InnerConfig.autocast must be 'auto', 'bf16' or 'off', got {self.autocast!r}")
        if self.round_state not in ROUND_STATES:
            raise ValueError(f"InnerConfig.round_state must be 'carry' or 'fresh', got {self.round_state!r}")

    @classmethod
    def fitted(cls, **fields: Any) -> InnerConfig:
        """An InnerConfig whose warm-up is cut to fit its horizon: a run shorter than the requested
        warm-up warms up over all but its last step (warmup_steps < total_steps is required)."""
        total = fields.get("total_steps", cls.total_steps)
        warmup = fields.get("warmup_steps", cls.warmup_steps)
        if isinstance(total, int) and isinstance(warmup, int):
            fields["warmup_steps"] = min(warmup, total - 1)
        return cls(**fields)

    @property
    def windows_per_round(self) -> int:
        """Training windows one host consumes in a round (its `windows_per_host`)."""
        return self.steps * self.grad_accum * self.micro_batch

    def lr_at(self, step: int) -> float:
        """Linear warm-up to `lr` over `warmup_steps`, cosine down to `lr * min_lr_ratio` at `total_steps`."""
        min_lr = self.lr * self.min_lr_ratio
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return min_lr
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - min_lr)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InnerConfig:
        check_fields(cls, data)
        if "betas" in data:
            data = {**data, "betas": tuple(data["betas"])}  # JSON/TOML give a list
        return cls(**data)


class GradSync(Protocol):
    """How a rig of several processes sums gradients: `training.rig.Rig` (every process holds whole
    gradients, summed by all-reduce) or `training.sharded.ShardedSync` (FSDP2 reduce-scatters them:
    each process holds a shard)."""

    @property
    def world_size(self) -> int: ...

    def all_reduce_grads(self, params: list[nn.Parameter]) -> None: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def grad_sq_total(self, local: torch.Tensor) -> torch.Tensor:
        """The rig's sum of squared gradients given this process's (fp64) sum over what it holds."""
        ...


@dataclass(frozen=True)
class InnerResult:
    mean_loss: float
    last_loss: float
    losses: list[float]  # one per step: the mean over that step's micro-batches on the whole rig
    tokens: int  # input tokens trained on, whole rig
    seconds: float

    @classmethod
    def joined(cls, parts: Sequence[InnerResult]) -> InnerResult:
        """One result for consecutive runs of a round's steps (a round cut by a rebase: training/worker.py);
        a single part is returned as it is."""
        if len(parts) == 1:
            return parts[0]
        losses = [loss for part in parts for loss in part.losses]
        return cls(
            mean_loss=sum(losses) / len(losses) if losses else math.nan,
            last_loss=losses[-1] if losses else math.nan,
            losses=losses,
            tokens=sum(part.tokens for part in parts),
            seconds=sum(part.seconds for part in parts),
        )


def _autocast_context(
    mode: AutocastMode, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    if mode == "bf16" and device.type != "cuda":
        raise ValueError(
            f"autocast='bf16' needs a CUDA device, the model is on {device}; use 'auto' or 'off'"
        )
    if mode != "off" and device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # Matrices (projections, embeddings) decay; norm gains do not.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class InnerTrainer:
    def __init__(self, model: Llama, config: InnerConfig, sync: GradSync | None = None) -> None:
        world_size = sync.world_size if sync is not None else 1
        if config.grad_accum % world_size:
            raise ValueError(
                f"grad_accum ({config.grad_accum}) must be a multiple of the rig's process count ({world_size}) "
                "so that the global batch stays the same"
            )
        if config.seq_len > model.config.max_seq_len:
            raise ValueError(f"InnerConfig.seq_len {config.seq_len} exceeds the model's max_seq_len")
        self.model = model
        self.config = config
        self.sync = sync
        self.local_accum = config.grad_accum // world_size
        self.device = next(model.parameters()).device
        self.step = 0  # optimizer steps taken so far in the epoch: the schedule's clock
        self._autocast = _autocast_context(config.autocast, self.device)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        self._loss = torch.compile(model.loss) if config.compile else model.loss

    def _new_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(
            _param_groups(self.model, self.config.weight_decay),
            lr=self.config.lr_at(self.step),
            betas=self.config.betas,
            fused=self.device.type == "cuda",
        )

    def restart(self, step: int) -> None:
        """Zero AdamW moments and the schedule clock at `step`: what `round_state = "fresh"` does at the
        start of every round."""
        if step < 0:
            raise ValueError(f"restart step must be >= 0, got {step}")
        self.step = step
        self.optimizer = self._new_optimizer()

    def _next(self, batches: Iterator[Batch], step: int) -> Batch:
        try:
            inputs, targets = next(batches)
        except StopIteration:
            raise ValueError(
                f"the batches ran out during step {step}: each step needs {self.local_accum} micro-batch(es) "
                "per process"
            ) from None
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def accumulate_gradients(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Forward/backward over this process's micro-batches of one step, adding into `.grad`.

        Returns [sum of micro-batch losses, input tokens] for this process.
        """
        totals = torch.zeros(2, device=self.device)
        for _ in range(self.local_accum):
            inputs, targets = self._next(batches, self.step)
            with self._autocast():
                loss = self._loss(inputs, targets)
            # Dividing by the rig-wide count makes the summed gradient the mean over the global batch.
            (loss / self.config.grad_accum).backward()
            tokens = torch.tensor(float(inputs.numel()), device=self.device)
            totals += torch.stack([loss.detach().float(), tokens])
        return totals

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """One optimizer step; returns [sum of micro-batch losses, input tokens] for the whole rig."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(self.step)
        totals = self.accumulate_gradients(batches)
        if self.sync is not None:
            self.sync.all_reduce_grads(self._params)
            totals = self.sync.all_reduce_sum(totals)
        if self.config.grad_clip > 0:
            clip_grad_norm(self._params, self.config.grad_clip, self.sync)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return totals

    def run(
        self,
        batches: Iterable[Batch],
        steps: int | None = None,
        on_step: Callable[[int, float], None] | None = None,
    ) -> InnerResult:
        """Take `steps` (default `config.steps`) optimizer steps over `batches` (this process's share).

        `on_step(step, loss)` is called after each step with the epoch-wide step number.
        """
        steps = self.config.steps if steps is None else steps
        self.model.train()
        iterator = iter(batches)
        started = time.perf_counter()
        step_totals = []
        for _ in range(steps):
            totals = self.train_step(iterator)
            step_totals.append(totals)
            if on_step is not None:
                on_step(self.step, totals[0].item() / self.config.grad_accum)  # .item(): a GPU sync point
        stacked = torch.stack(step_totals).cpu() if step_totals else torch.zeros(0, 2)
        seconds = time.perf_counter() - started  # .cpu() above waited for the device
        losses = (stacked[:, 0] / self.config.grad_accum).tolist()
        return InnerResult(
            mean_loss=sum(losses) / len(losses) if losses else math.nan,
            last_loss=losses[-1] if losses else math.nan,
            losses=losses,
            tokens=int(stacked[:, 1].sum().item()),
            seconds=seconds,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A `fresh` epoch's state may hold the clock alone (`DiLoCoWorker.state_dict`): its moments are
        zero at the next round's start whatever they were, so the optimizer restarts."""
        needed = {"step"} if self.config.round_state == "fresh" else {"optimizer", "step"}
        missing = needed - set(state)
        if missing:
            raise ValueError(f"inner trainer state lacks {sorted(missing)}")
        if "optimizer" not in state:
            self.restart(int(state["step"]))
            return
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded: FSDP2's DTensor) tensor this process holds."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, sync: GradSync | None = None) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most `max_norm`; returns the norm (fp32).

    torch's `clip_grad_norm_` formula (coefficient max_norm / (norm + 1e-6), clamped to 1, in fp32),
    with the norm summed in fp64 and rounded to fp32 once: the sum's rounding then depends on how the
    gradients are split over the rig only with probability ~1e-8 per step, so a sharded rig scales by
    the very coefficient one process does (fp32 sums of shard norms would differ in the last bits).
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        for chunk in grad.reshape(-1).split(1 << 24):  # bounds the fp64 temporary
            wide = chunk.double()
            local += torch.dot(wide, wide)
    total = sync.grad_sq_total(local) if sync is not None else local
    norm = total.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef)
    return norm


@torch.no_grad()
def evaluate(model: Llama, batches: Iterable[Batch], autocast: AutocastMode = "auto") -> float:
    """Mean cross-entropy per target token over `batches` (held-out loss)."""
    device = next(model.parameters()).device
    context = _autocast_context(autocast, device)
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    try:
        for inputs, targets in batches:
            with context():
                loss = model.loss(inputs.to(device), targets.to(device))
            total += loss.double() * targets.numel()
            count += targets.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got no batches")
    return total.item() / count
