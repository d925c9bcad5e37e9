"""Streaming fragments (Streaming DiLoCo, Douillard et al. 2025): the model synced one fragment a round.

A streamed epoch (`stream_fragments = P` in the recipe) cuts the model's tensors into P fragments
balanced by size (`training.fragments.plan_fragments`, the plan sharded aggregators use) and syncs
fragment (r − first) mod P at the end of round r. Each fragment thus syncs every P rounds, offset from
the others by one round: a round's upload and download carry 1/P of the model, and the exchange of one
fragment overlaps the training of all of them. A streamed recipe with the sync period of a whole-model
one with H inner steps a round sets `inner_steps` = H / P (and P times the rounds): the same compute.

A host never reloads the whole global model after its first round: it trains on from its own, and a
fragment's sync measures the pseudo-gradient θ_global,f − θ_local,f from the global model's fragment
(as its last sync left it: no other round's outer step touches it), the outer step moves that fragment
alone (its own Nesterov buffers), and the host takes it back by `merge_fragment`: θ_f ← mix·θ_local,f
+ (1 − mix)·θ_global,f. With overlap "delayed" the synced fragment lands one round late, after the host
trained the next round on its own values (Streaming DiLoCo's overlap with τ = one round, H / P steps;
`mix` > 0 keeps part of those steps, as the paper's α).

No round of a streamed epoch is a pure function of public inputs (a host's other fragments are its own,
trained since their last syncs), so streamed epochs carry AdamW state and are never replayed
(docs/PROTOCOL.md "Streaming fragments").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from training.diloco import OuterOptimizer
from training.fragments import Fragment, Spec, plan_fragments
from training.inner import InnerConfig


class StreamedRecipe(Protocol):
    """What a recipe says of streaming (gonka_node's `Recipe`, or a local run's)."""

    @property
    def stream_fragments(self) -> int: ...
    @property
    def stream_mix(self) -> float: ...
    @property
    def overlap(self) -> str: ...
    def inner_config(self) -> InnerConfig: ...


@dataclass(frozen=True)
class StreamSchedule:
    """Which fragment each round of a streamed epoch syncs, and how a host takes a synced one back."""

    fragments: tuple[Fragment, ...]
    mix: float = 0.0
    first_round: int = 0  # the epoch's first round, which syncs fragment 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix < 1.0:
            raise ValueError(f"stream mix must be in [0, 1), got {self.mix}")

    @classmethod
    def plan(cls, spec: Spec, count: int, mix: float = 0.0, first_round: int = 0) -> StreamSchedule:
        return cls(tuple(plan_fragments(spec, count, what="stream_fragments")), mix, first_round)

    def fragment_of(self, round_index: int) -> Fragment:
        if round_index < self.first_round:
            raise ValueError(f"round {round_index} precedes the epoch's first round {self.first_round}")
        return self.fragments[(round_index - self.first_round) % len(self.fragments)]

    def landing(self, landed: int, upto: int, held: int | None = None, skipped: Collection[int] = ()) -> list[Fragment]:
        """The fragments a host takes back to bring its model from the syncs of rounds through `landed`
        to those through `upto`, from the global model it holds as of round `held` (≥ `upto`; default
        `upto`): each fragment synced in rounds `landed` + 1 … `upto` once, in the order of its latest
        sync there, but none synced again after `upto` (the held model shows that later sync, which lands
        with it). So a host that missed rounds (a late joiner, a restart) never merges one sync twice,
        which with a mix would not be idempotent. `skipped`: rounds that synced nothing (the chain skipped
        them: no update, the model unchanged), so a fragment is not taken back from a sync it never had."""
        held = upto if held is None else held
        if held < upto:
            raise ValueError(f"landing: the held model (round {held}) precedes the syncs to land (through {upto})")
        later = {self.fragment_of(r).index for r in range(max(upto + 1, self.first_round), held + 1) if r not in skipped}
        latest: dict[int, int] = {}  # fragment -> the round of its latest sync to land
        for r in range(max(landed + 1, self.first_round), upto + 1):
            if r not in skipped:
                latest[self.fragment_of(r).index] = r
        return [self.fragment_of(r) for r in sorted(latest.values()) if self.fragment_of(r).index not in later]


def step_fragment(outer: OuterOptimizer, params: Mapping[str, Tensor], update: Mapping[str, Tensor]) -> None:
    """The outer step on the tensors `update` names alone (a streamed round's fragment, or every tensor),
    each with its own momentum; the others of `params` and their momentum untouched. The step is element
    by element, so stepping a fragment is stepping those tensors of the whole."""
    unknown = sorted(set(update) - set(params))
    if unknown or not update:
        raise ValueError(f"step_fragment: the update's tensors {unknown[:3] or '(none)'} are not the model's")
    outer.step({name: params[name] for name in update}, update)


def merge_fragment(model: torch.nn.Module, synced: Mapping[str, Tensor], names: Sequence[str], mix: float) -> None:
    """Take a synced fragment back into a host's model: `merge_tensor` for each tensor of `names`."""
    params = dict(model.named_parameters())
    missing = sorted(set(names) - set(params) | set(names) - set(synced))
    if missing:
        raise ValueError(f"merge_fragment: {missing[:3]} not in both the model and the synced fragment")
    for name in names:
        merge_tensor(params[name], synced[name], mix)


@torch.no_grad()
def merge_tensor(param: Tensor, synced: Tensor, mix: float) -> None:
    """θ ← θ_synced + mix·(θ − θ_synced), in place (torch.lerp: `mix` = 0 copies the synced values
    exactly). Element by element, so a rig process that holds some rows of a tensor merges those rows
    as one process merges the whole."""
    g = synced.to(param.device, torch.float32)
    if mix == 0.0:
        param.copy_(g)
    else:
        param.copy_(torch.lerp(g, param.detach().float(), mix))


def stream_schedule(recipe: StreamedRecipe, spec: Mapping[str, tuple[int, ...]], first_round: int) -> StreamSchedule | None:
    """A streamed recipe's schedule (None when it streams nothing), refused (ValueError) where a streamed
    round cannot run: from a fresh AdamW state or an eager forecast, both whole-model rules (a `Recipe`
    refuses them itself; this guards any other recipe)."""
    if recipe.stream_fragments <= 1:
        return None
    if recipe.overlap == "eager" or recipe.inner_config().round_state != "carry":
        raise ValueError(f"stream_fragments = {recipe.stream_fragments} needs round_state 'carry' and overlap 'off' or "
                         f"'delayed' (got {recipe.inner_config().round_state!r}, {recipe.overlap!r})")
    return StreamSchedule.plan(spec, recipe.stream_fragments, recipe.stream_mix, first_round)
