"""DiLoCo in one process: K simulated hosts and one aggregator on one set of training windows.

Each simulated host is the very `DiLoCoWorker` a real host daemon runs, with its own model copy, inner
AdamW state (kept across rounds, as in DiLoCo), error-feedback residual and data assignment (the same
deterministic (seed, round, slot) split real hosts get). A round: every host loads the global model,
takes H inner steps and compresses its pseudo-gradient with the recipe's codec; the "aggregator" decodes
the payloads, averages them in host order and takes the bit-exact outer Nesterov step. Bytes are counted
from the real payloads.

`gonka-node train` (gonka_node/cli/train.py) and scripts/bench_training.py drive it. The epoch recipe is
`gonka_node.core.recipe.Recipe`; this module names only the part of it a local run reads
(`LocalRecipe`), so `training` still imports nothing of ours but itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from training.codecs import Codec, get_codec, round_seed, spec_of
from training.data import Windows
from training.diloco import OuterOptimizer, StreamingAverager
from training.fragments import Fragment
from training.inner import evaluate
from training.model import ModelConfig, build_model
from training.overlap import eager_base, eager_rebases
from training.streaming import StreamedRecipe, StreamSchedule, step_fragment, stream_schedule
from training.worker import Assignment, DiLoCoWorker, Rebase, WorkerRound


class LocalRecipe(StreamedRecipe, Protocol):
    """What a local run reads of an epoch recipe (`gonka_node.core.recipe.Recipe` is one); its streaming
    fields, overlap and inner config are `StreamedRecipe`'s."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def epoch_seed(self) -> int: ...
    @property
    def init_seed(self) -> int: ...
    @property
    def codec(self) -> str: ...
    @property
    def ef_decay(self) -> float: ...
    @property
    def outer_lr(self) -> float: ...
    @property
    def outer_momentum(self) -> float: ...
    @property
    def forecast_step(self) -> int: ...
    @property
    def merge_step(self) -> int: ...


# The recipe type a run carries: callers keep their full recipe (`config.recipe.n_rounds`); the run
# reads only `LocalRecipe`'s part of it.
R = TypeVar("R", bound=LocalRecipe, covariant=True)


StepHook = Callable[[int, int, float], None]  # (worker, epoch-wide step, loss)


@dataclass(frozen=True, kw_only=True)
class LocalRunConfig(Generic[R]):
    """An epoch recipe run by `workers` simulated hosts in one process. The recipe is the one type that
    says how an epoch trains (model, schedule, codec, outer step, seeds), here and on the network."""

    recipe: R
    workers: int = 2
    eval_windows: int = 64

    def __post_init__(self) -> None:
        for name in ("workers", "eval_windows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def seed(self) -> int:
        """Data assignment and held-out sampling (the recipe's epoch seed)."""
        return self.recipe.epoch_seed


@dataclass
class RoundReport:
    round: int
    heldout_loss: float
    inner_loss: float  # mean over hosts of their last inner step's loss
    bytes_per_worker: int  # this round's payload, per host
    seconds: float


def ddp_bytes_per_worker(params: int, steps: int) -> int:
    """What each worker of data-parallel training sends: its fp32 gradient every step.

    The same topology as DiLoCo with an aggregator (each host uploads once per sync). A ring all-reduce
    sends 2(K−1)/K times this (1.5× at K = 4), so ratios quoted against this figure are conservative.
    """
    return 4 * params * steps


class LocalDiLoCo:
    """K simulated hosts and one aggregator, in one process, on one set of training windows."""

    def __init__(
        self,
        config: LocalRunConfig[LocalRecipe],
        windows: Windows,
        initial: Mapping[str, torch.Tensor] | None = None,
        first_round: int = 0,
    ) -> None:
        """`initial`: start from these weights (a state dict of the recipe's model) instead of the
        recipe's random init, e.g. a checkpoint trained further. `first_round`: the data stream's round
        the run starts at (windows of earlier rounds are left to whoever trained `initial`)."""
        if first_round < 0:
            raise ValueError(f"first_round must be >= 0, got {first_round}")
        self.config, self.windows = config, windows
        recipe = config.recipe
        self.global_model = build_model(recipe.model, seed=recipe.init_seed)
        if initial is not None:
            _load_weights(self.global_model, initial)
        self.params = {name: p for name, p in self.global_model.named_parameters()}
        self.spec = spec_of(self.params)
        self.codec: Codec = get_codec(recipe.codec)
        self.outer = OuterOptimizer(
            lr=recipe.outer_lr, momentum=recipe.outer_momentum, nesterov=recipe.outer_momentum > 0
        )
        # Each simulated host is the very object a real host daemon runs (training/worker.py).
        self.hosts = [
            DiLoCoWorker(
                build_model(recipe.model, seed=recipe.init_seed),
                recipe.inner_config(),
                self.codec,
                windows,
                Assignment(recipe.epoch_seed, slot, config.workers),
                recipe.ef_decay,
                first_round=first_round,  # the chain numbers rounds from 1; this simulation from 0
            )
            for slot in range(config.workers)
        ]
        self.heldout = windows.sample_heldout(config.seed, config.eval_windows)
        self.first_round = self.round = first_round
        # With overlap = "delayed" round r trains from the model after r − 2 (training/overlap.py): the
        # model before the last outer step, kept here (the initial model for the first two rounds).
        self.lagged = {name: p.detach().clone() for name, p in self.params.items()}
        # "eager" forecasts round r − 1's model from round r − 2's: the outer momentum there and each
        # host's decoded payload of round r − 1 (None before its first).
        self.lagged_outer = OuterOptimizer(self.outer.lr, self.outer.momentum, self.outer.nesterov)
        self.sent: list[Mapping[str, torch.Tensor] | None] = [None] * len(self.hosts)
        # A streamed epoch syncs one fragment a round (training/streaming.py); each host lands the syncs
        # (`DiLoCoWorker.land`: with overlap "delayed" round r's after round r + 1 trained).
        self.stream = stream_schedule(recipe, self.spec, first_round)

    def heldout_loss(self) -> float:
        return evaluate(self.global_model, self.windows.batches(self.heldout, 32))

    def _base(self, slot: int) -> tuple[Mapping[str, torch.Tensor], list[Rebase]]:
        """The model host `slot` trains this round from (the recipe's overlap rule), and where the round
        moves onto another base on the way (an eager recipe's `forecast_step`, `merge_step`)."""
        recipe = self.config.recipe
        if recipe.overlap == "eager":
            own, outer = self.sent[slot], self.lagged_outer
            return eager_rebases(
                lambda: eager_base(self.lagged, outer, own),
                lambda: eager_base(self.lagged, outer, None if own is None else _zeros(own)),
                lambda: self.params,  # the model after r − 1: this simulation holds it while round r trains
                recipe.forecast_step if own is not None else 0, recipe.merge_step,
            )
        return (self.lagged if recipe.overlap == "delayed" else self.params), []

    def run_round(self, on_step: StepHook | None = None) -> RoundReport:
        started = time.perf_counter()
        fragment = self.stream.fragment_of(self.round) if self.stream is not None else None
        spec = fragment.spec(self.spec) if fragment is not None else self.spec
        averager = StreamingAverager(spec)
        codec = self.codec.for_round(round_seed(self.config.seed, self.round))
        sizes, last_losses = [], []
        for slot, host in enumerate(self.hosts):
            hook = (lambda step, loss, s=slot: on_step(s, step, loss)) if on_step else None
            result = self._train_host(slot, host, hook, fragment)
            sizes.append(len(result.payload))
            last_losses.append(result.last_loss)
            decoded = codec.decode(result.payload, spec)
            if fragment is None:
                self.sent[slot] = decoded
            averager.add(f"host-{slot:05d}", decoded)
        if self.stream is not None and fragment is not None:
            self._step_fragment(self.stream, fragment, averager.result())
        else:
            if self.config.recipe.overlap != "off":
                self.lagged = {name: p.detach().clone() for name, p in self.params.items()}
                self.lagged_outer.restore(self.outer.steps, self.outer.buffers)
            self.outer.step(self.params, averager.result())
        self.round += 1
        return RoundReport(
            round=self.round,
            heldout_loss=self.heldout_loss(),
            inner_loss=sum(last_losses) / len(last_losses),
            bytes_per_worker=max(sizes),
            seconds=time.perf_counter() - started,
        )

    def _train_host(self, slot: int, host: DiLoCoWorker, hook: Callable[[int, float], None] | None,
                    fragment: Fragment | None) -> WorkerRound:
        """Host `slot`'s round: from the recipe's base, or (streamed) on from its own model, sending
        `fragment`'s pseudo-gradient alone."""
        if fragment is None:
            base, rebases = self._base(slot)
            return host.train_round(self.round, base, hook, rebases=rebases)
        if host.landed is None:  # the epoch's model, once: the host trains on from its own after it
            host.begin_stream(self.params, self.round - 1)
        return host.stream_round(self.round, self.params, fragment.names, hook)

    def _step_fragment(self, stream: StreamSchedule, fragment: Fragment, average: Mapping[str, torch.Tensor]) -> None:
        """A streamed round's outer step, on its fragment alone, and the synced fragment landing on the
        hosts: this round's, or with "delayed" the one synced the round before, which this round trained
        without. Its global values are as its sync left them either way (this step moved another one)."""
        step_fragment(self.outer, self.params, average)
        upto = self.round if self.config.recipe.overlap == "off" else self.round - 1
        for host in self.hosts:
            host.land(stream, self.params, upto, held=self.round)


def _zeros(like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in like.items()}


def _load_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` into `model`, refusing (ValueError naming the tensor) anything but its exact names
    and shapes, before changing any parameter."""
    params = dict(model.named_parameters())
    missing, unknown = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unknown:
        raise ValueError(
            f"the weights do not fit this model: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    for name, p in params.items():
        if tuple(weights[name].shape) != tuple(p.shape):
            raise ValueError(
                f"the weights do not fit this model: {name} has shape {tuple(weights[name].shape)}, "
                f"the model's is {tuple(p.shape)}"
            )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
