"""Keep the host's copy of the global model equal to the chain's, round by round.

After round r is finalized the host applies the round's aggregated update with the same bit-exact
outer Nesterov step the aggregator took, and checks the result against the checkpoint sha256 the chain
recorded. When it cannot (it fell behind, its outer momentum is gone, or the hash differs), it pulls
the full checkpoint instead and checks that. Nothing unverified is ever trained on. In a sharded epoch
the chain records the Merkle root over the model's fragments (`core.fragments.model_root`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, cast

from safetensors.torch import load as load_safetensors
from torch import Tensor

from gonka_node.core.fragments import model_root
from training.checkpoint import tensors_view
from training.diloco import OuterOptimizer, SpeculativeStep, Update
from training.streaming import step_fragment

log = logging.getLogger(__name__)


class FollowError(RuntimeError):
    """The global model could not be brought to a state the chain vouches for."""


class RoundHashes(Protocol):
    def checkpoint_sha256(self, round_: int) -> bytes:
        """The checkpoint sha256 the chain records for a finalized round (raises if not finalized)."""
        ...


@dataclass
class GlobalModel:
    """The held global model and the outer state mirrored from the aggregator."""

    params: dict[str, Tensor]
    sha256: bytes
    round_done: int
    outer: OuterOptimizer | None  # None: not mirrored (after a pulled checkpoint); updates can't apply
    shards: int = 1  # the epoch's aggregator shards: how the chain hashes a model (model_root)

    def hash_of(self, params: Mapping[str, Tensor]) -> bytes:
        return model_root(params, self.shards)


@dataclass
class NextModel:
    """The global model after `round`, computed ahead of need (off the training path), not yet checked
    against the chain: `adopt` does that."""

    round: int
    params: dict[str, Tensor]
    outer: OuterOptimizer
    sha256: bytes
    # the next round's outer step from this model, taken ahead of its update (`speculate`), or None
    next_step: SpeculativeStep | None = None


def speculate(model: GlobalModel, round_: int, cancelled: Callable[[], bool]) -> SpeculativeStep | None:
    """The part of round `round_`'s outer step that needs no update, on copies of `model` (which must stay
    as it is until the step is finished): the dense work, done while the round's payload is uploading
    and its update pending. None when `model` does not hold round_ − 1 with its momentum, or `cancelled()`
    stopped it."""
    if model.outer is None or model.round_done != round_ - 1:
        return None
    step = SpeculativeStep(model.outer, model.params)
    return step if step.run(cancelled) else None


def step_ahead(
    model: GlobalModel, round_: int, update: Update, speculated: SpeculativeStep | None = None,
    speculate_next: bool = False, cancelled: Callable[[], bool] = lambda: False,
) -> NextModel | None:
    """The model after `round_` on copies of `model`'s tensors and outer state, which stay untouched (a
    round may be training from them). None when `model` does not hold round_ − 1 with its momentum.
    `speculated`: `speculate(model, round_, …)`, finished here on the update's entries (dense, or sparse:
    `Codec.decode_sparse`; without `speculated` the update must be dense).
    `speculate_next`: also take round_ + 1's step from the new model ahead of its update (`next_step`;
    left None when that fails or `cancelled()` stops it: the next round's step is then taken whole)."""
    if model.outer is None or model.round_done != round_ - 1:
        return None
    if speculated is not None and not speculated.steps_from(model.params):
        raise ValueError(f"step_ahead: round {round_}'s step was taken ahead from other tensors than the held model's")
    if speculated is not None:
        params, outer = speculated.finish(update)
    else:
        if not all(isinstance(t, Tensor) for t in update.values()):
            raise ValueError("step_ahead: a sparse update needs the step taken ahead (`speculated`)")
        update = cast(Mapping[str, Tensor], update)
        params, outer = {name: t.clone() for name, t in model.params.items()}, model.outer.copy()
        step_fragment(outer, params, update)  # a streamed round's update holds its fragment alone
    ahead = NextModel(round_, params, outer, model.hash_of(params))
    if speculate_next:
        try:  # taken ahead of the update already (`SpeculativeStep.take_after`): fixed at its entries only
            after = speculated.after_finish() if speculated is not None else None
            ahead.next_step = after if after is not None else \
                speculate(GlobalModel(params, ahead.sha256, round_, outer), round_ + 1, cancelled)
        except Exception:  # the model computed is good all the same
            log.exception("round %d: the next round's outer step ahead of its update failed", round_ + 1)
    return ahead


def adopt(model: GlobalModel, ahead: NextModel, chain: RoundHashes) -> bool:
    """Take `ahead` as the held model when it is the next round's and hashes to what the chain records."""
    if ahead.round != model.round_done + 1 or model.outer is None:
        return False
    if ahead.sha256 != chain.checkpoint_sha256(ahead.round):
        log.warning("round %d: the model computed ahead hashes to %s…, not the chain's; following again",
                    ahead.round, ahead.sha256.hex()[:16])
        return False
    model.params, model.outer, model.sha256, model.round_done = ahead.params, ahead.outer, ahead.sha256, ahead.round
    return True


Fetch = Callable[[int], bytes]  # round -> safetensors file bytes
Decode = Callable[[int, bytes], Mapping[str, Tensor]]  # (round, downloaded update) -> the update's tensors


def dense_update(round_: int, data: bytes) -> Mapping[str, Tensor]:
    """A dense broadcast: safetensors, viewed in place."""
    return tensors_view(data)


def follow_to(
    model: GlobalModel,
    target_round: int,
    chain: RoundHashes,
    fetch_update: Fetch,
    fetch_checkpoint: Fetch,
    decode: Decode = dense_update,
) -> str:
    """Advance `model` to the chain's state after `target_round`. Returns how: "current", "updates",
    or "checkpoint". Raises FollowError when even the pulled checkpoint does not match the chain. `decode`
    turns a downloaded update into tensors (a compressed broadcast: the epoch's codec), the round's own
    (every tensor, or a streamed round's fragment: checked there, the step moves the tensors it holds)."""
    if model.round_done == target_round:
        return "current"
    if model.round_done > target_round:
        raise FollowError(f"held model is at round {model.round_done}, past the target {target_round}")
    how = "updates"
    while model.round_done < target_round and model.outer is not None:
        r = model.round_done + 1
        want = chain.checkpoint_sha256(r)
        if want == model.sha256:  # a skipped round leaves the model (and the momentum) as it was
            model.round_done = r
            continue
        try:
            # In place, tensor by tensor, the update a view of the downloaded bytes: the step needs the
            # model, the momentum and one update, nothing more (a 30B model: 360 GB, not 600).
            update = decode(r, fetch_update(r))
            model.sha256 = b""  # from here until the hash matches, the held model is no verified state
            step_fragment(model.outer, model.params, update)  # every tensor, or a streamed round's fragment
        except Exception as exc:  # any failure here falls back to the verified pull below
            log.warning("round %d: cannot apply the aggregated update (%s); pulling the checkpoint", r, exc)
            model.outer = None
            break
        got = model.hash_of(model.params)
        if got != want:
            log.warning(
                "round %d: applying the update gave %s, the chain records %s; pulling the checkpoint",
                r, got.hex()[:16], want.hex()[:16],
            )
            model.outer = None
            break
        model.sha256, model.round_done = got, r
    if model.round_done == target_round:
        return how
    want = chain.checkpoint_sha256(target_round)
    params = load_safetensors(fetch_checkpoint(target_round))
    got = model.hash_of(params)
    if got != want:
        raise FollowError(
            f"checkpoint of round {target_round} hashes to {got.hex()}, the chain records {want.hex()}"
        )
    model.params = {n: t.float() for n, t in params.items()}
    model.sha256, model.round_done = got, target_round
    # The outer momentum is not in the checkpoint: later rounds are followed by pulling checkpoints.
    model.outer = None
    return "checkpoint"
