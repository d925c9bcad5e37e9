"""The host follows the chain's model: the outer step in place on its copy, checked by the chain's hash."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from gonka_node.host.follow import FollowError, GlobalModel, follow_to
from training.checkpoint import canonical_sha256
from training.diloco import OuterOptimizer


def params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(40, 8, generator=g), "b.weight": torch.randn(9, generator=g)}


class Chain:
    def __init__(self, hashes: dict[int, bytes]) -> None:
        self.hashes = hashes

    def checkpoint_sha256(self, round_: int) -> bytes:
        return self.hashes[round_]


def expected_after(updates: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[bytes]]:
    """The aggregator's side: the same outer steps on its own copy."""
    model, outer, hashes = params(0), OuterOptimizer(0.7, 0.9), []
    for update in updates:
        outer.step(model, update)
        hashes.append(bytes.fromhex(canonical_sha256(model)))
    return model, hashes


def test_updates_apply_in_place_bit_for_bit_with_the_update_a_view_of_the_bytes() -> None:
    updates = [params(1), params(2)]
    want, hashes = expected_after(updates)
    held = GlobalModel(params(0), bytes.fromhex(canonical_sha256(params(0))), 0, OuterOptimizer(0.7, 0.9))
    storage = {n: t.untyped_storage().data_ptr() for n, t in held.params.items()}
    fetched = []
    how = follow_to(held, 2, Chain({1: hashes[0], 2: hashes[1]}),
                    lambda r: fetched.append(r) or save(updates[r - 1]), lambda r: pytest.fail("no pull"))
    assert how == "updates" and fetched == [1, 2] and held.round_done == 2 and held.sha256 == hashes[1]
    assert all(torch.equal(held.params[n], want[n]) for n in want)
    assert {n: t.untyped_storage().data_ptr() for n, t in held.params.items()} == storage  # no copy


def test_a_wrong_hash_or_garbage_update_falls_back_to_the_verified_checkpoint() -> None:
    updates = [params(1)]
    want, hashes = expected_after(updates)
    for served in (save(params(5)), b"\x08" + b"\0" * 7 + b"{garbage"):  # a wrong update; not safetensors
        held = GlobalModel(params(0), bytes.fromhex(canonical_sha256(params(0))), 0, OuterOptimizer(0.7, 0.9))
        how = follow_to(held, 1, Chain({1: hashes[0]}), lambda r, s=served: s, lambda r: save(want))
        assert how == "checkpoint" and held.outer is None and held.sha256 == hashes[0]
        assert all(torch.equal(held.params[n], want[n]) for n in want)
    held = GlobalModel(params(0), bytes.fromhex(canonical_sha256(params(0))), 0, OuterOptimizer(0.7, 0.9))
    with pytest.raises(FollowError, match="checkpoint of round 1 hashes to"):
        follow_to(held, 1, Chain({1: hashes[0]}), lambda r: save(params(5)), lambda r: save(params(6)))
