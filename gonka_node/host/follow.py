"""Keep the host's copy of the global model equal to the chain's, round by round.

After round r is finalized the host applies the round's aggregated update with the same bit-exact
outer Nesterov step the aggregator took, and checks the result against the checkpoint sha256 the chain
recorded. When it cannot (it fell behind, its outer momentum is gone, or the hash differs), it pulls
the full checkpoint instead and checks that. Nothing unverified is ever trained on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from safetensors.torch import load as load_safetensors
from torch import Tensor

from training.checkpoint import canonical_sha256, tensors_view
from training.diloco import OuterOptimizer

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


Fetch = Callable[[int], bytes]  # round -> safetensors file bytes


def follow_to(
    model: GlobalModel,
    target_round: int,
    chain: RoundHashes,
    fetch_update: Fetch,
    fetch_checkpoint: Fetch,
) -> str:
    """Advance `model` to the chain's state after `target_round`. Returns how: "current", "updates",
    or "checkpoint". Raises FollowError when even the pulled checkpoint does not match the chain."""
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
            update = tensors_view(fetch_update(r))
            model.sha256 = b""  # from here until the hash matches, the held model is no verified state
            model.outer.step(model.params, update)
        except Exception as exc:  # any failure here falls back to the verified pull below
            log.warning("round %d: cannot apply the aggregated update (%s); pulling the checkpoint", r, exc)
            model.outer = None
            break
        got = bytes.fromhex(canonical_sha256(model.params))
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
    got = bytes.fromhex(canonical_sha256(params))
    if got != want:
        raise FollowError(
            f"checkpoint of round {target_round} hashes to {got.hex()}, the chain records {want.hex()}"
        )
    model.params = {n: t.float() for n, t in params.items()}
    model.sha256, model.round_done = got, target_round
    # The outer momentum is not in the checkpoint: later rounds are followed by pulling checkpoints.
    model.outer = None
    return "checkpoint"
