"""`follow_to`: the host's copy of the global model only ever takes a state whose hash the chain records.

An honest aggregator is simulated with the real outer step, real safetensors files and the real
canonical hash; `Chain` is the table of finalized rounds' checkpoint hashes that `ChainHashes` reads
from the registry (tests/gonka_node/test_host_trust.py runs the host against the real chain). Every
test asserts what was fetched, so a path that trains on, or pulls, more than it should fails too.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load, save
from torch import Tensor

from gonka_node.core.fragments import model_root
from gonka_node.host.follow import (
    FollowError,
    GlobalModel,
    NextModel,
    adopt,
    follow_to,
    speculate,
    step_ahead,
)
from training.checkpoint import canonical_sha256
from training.diloco import OuterOptimizer, SpeculativeStep

SHAPES = {"w": (4, 3), "b": (5,)}
LR, MOMENTUM = 0.7, 0.9


def tensors(seed: int, scale: float = 1.0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def sha(params: dict[str, Tensor]) -> bytes:
    return bytes.fromhex(canonical_sha256(params))


def bits_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def tampered(params: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {n: t.clone() for n, t in params.items()}
    out["w"][0, 0] += 1e-3  # one element off: a checkpoint of another model
    return out


class Chain:
    """The checkpoint hash of each finalized round (an unfinalized round raises, as on chain)."""

    def __init__(self, hashes: dict[int, bytes]) -> None:
        self.hashes = hashes

    def checkpoint_sha256(self, round_: int) -> bytes:
        if round_ not in self.hashes:
            raise LookupError(f"round {round_} is not finalized")
        return self.hashes[round_]


class Aggregator:
    """Runs the rounds (None: skipped) with the real outer step and serves their files."""

    def __init__(self, updates: list[dict[str, Tensor] | None]) -> None:
        params, outer = tensors(0), OuterOptimizer(LR, MOMENTUM)
        self.params = {0: {n: t.clone() for n, t in params.items()}}
        self.updates: dict[int, bytes] = {}
        for r, update in enumerate(updates, start=1):
            if update is not None:
                outer.step(params, update)
                self.updates[r] = save(update)
            self.params[r] = {n: t.clone() for n, t in params.items()}
        self.checkpoints = {r: save(p) for r, p in self.params.items()}
        self.chain = Chain({r: sha(p) for r, p in self.params.items() if r > 0})
        self.fetched: list[tuple[str, int]] = []

    def update(self, round_: int) -> bytes:
        self.fetched.append(("update", round_))
        return self.updates[round_]

    def checkpoint(self, round_: int) -> bytes:
        self.fetched.append(("checkpoint", round_))
        return self.checkpoints[round_]

    def follow(self, model: GlobalModel, target: int) -> str:
        return follow_to(model, target, self.chain, self.update, self.checkpoint)


def step_from(params: dict[str, Tensor], steps_before: int, update: dict[str, Tensor]) -> dict[str, Tensor]:
    """`params` after the outer step with `update`, momentum as after `steps_before` honest steps."""
    outer, replay = OuterOptimizer(LR, MOMENTUM), tensors(0)
    for r in range(1, steps_before):
        outer.step(replay, tensors(r, 0.1))
    out = {n: t.clone() for n, t in params.items()}
    outer.step(out, update)
    return out


def fresh_model(outer: bool = True) -> GlobalModel:
    params = tensors(0)
    return GlobalModel(params, sha(params), 0, OuterOptimizer(LR, MOMENTUM) if outer else None)


def two_rounds() -> Aggregator:
    return Aggregator([tensors(1, 0.1), tensors(2, 0.1)])


def test_follows_by_applying_each_rounds_update_bit_for_bit() -> None:
    agg, model = two_rounds(), fresh_model()
    assert agg.follow(model, 2) == "updates"
    assert bits_equal(model.params, agg.params[2]) and model.sha256 == agg.chain.hashes[2]
    assert model.round_done == 2 and model.outer is not None and model.outer.steps == 2
    assert agg.fetched == [("update", 1), ("update", 2)]
    assert agg.follow(model, 2) == "current" and agg.fetched == [("update", 1), ("update", 2)]


def test_each_update_is_decoded_with_its_round() -> None:
    # A compressed broadcast decodes with the round's codec (its mask seed): `decode` is told the round.
    agg, model, decoded = two_rounds(), fresh_model(), []

    def decode(round_: int, data: bytes) -> dict[str, Tensor]:
        decoded.append(round_)
        return {n: t.clone() for n, t in load(data).items()}

    assert follow_to(model, 2, agg.chain, agg.update, agg.checkpoint, decode) == "updates"
    assert decoded == [1, 2] and model.sha256 == agg.chain.hashes[2]


def test_a_model_past_the_target_is_refused() -> None:
    agg, model = two_rounds(), fresh_model()
    model.round_done = 2
    with pytest.raises(FollowError, match=r"^held model is at round 2, past the target 1$"):
        agg.follow(model, 1)
    assert agg.fetched == []


def test_a_skipped_round_keeps_the_model_and_its_momentum() -> None:
    agg, model = Aggregator([None, tensors(2, 0.1)]), fresh_model()
    assert agg.chain.hashes[1] == model.sha256  # the chain records the unchanged base
    assert agg.follow(model, 2) == "updates"
    assert agg.fetched == [("update", 2)]  # nothing to fetch for the skipped round
    assert bits_equal(model.params, agg.params[2]) and model.outer is not None and model.outer.steps == 1


def test_an_update_that_misses_the_chains_hash_falls_back_to_the_checkpoint(caplog) -> None:
    agg, model = two_rounds(), fresh_model()
    agg.updates[2] = save(tampered(tensors(2, 0.1)))
    with caplog.at_level(logging.WARNING, logger="gonka_node.host.follow"):
        assert agg.follow(model, 2) == "checkpoint"
    assert agg.fetched == [("update", 1), ("update", 2), ("checkpoint", 2)]
    assert bits_equal(model.params, agg.params[2]) and model.sha256 == agg.chain.hashes[2]
    assert model.round_done == 2 and model.outer is None  # momentum is not in a checkpoint
    got = sha(step_from(agg.params[1], 2, tampered(tensors(2, 0.1)))).hex()[:16]
    assert [r.getMessage() for r in caplog.records] == [
        f"round 2: applying the update gave {got}, the chain records {agg.chain.hashes[2].hex()[:16]}; "
        "pulling the checkpoint"
    ]


def test_an_update_that_cannot_be_read_falls_back_to_the_checkpoint(caplog) -> None:
    agg, model = two_rounds(), fresh_model()
    agg.updates[1] = b"not a safetensors file"
    with caplog.at_level(logging.WARNING, logger="gonka_node.host.follow"):
        assert agg.follow(model, 2) == "checkpoint"
    assert agg.fetched == [("update", 1), ("checkpoint", 2)]
    assert bits_equal(model.params, agg.params[2]) and model.outer is None
    [record] = caplog.records
    assert record.getMessage().startswith("round 1: cannot apply the aggregated update (")
    assert record.getMessage().endswith("); pulling the checkpoint") and "header" in record.getMessage().lower()


def test_without_the_outer_momentum_only_the_targets_checkpoint_is_pulled() -> None:
    agg, model = two_rounds(), fresh_model(outer=False)
    assert agg.follow(model, 2) == "checkpoint"
    assert agg.fetched == [("checkpoint", 2)]
    assert bits_equal(model.params, agg.params[2]) and (model.sha256, model.round_done) == (agg.chain.hashes[2], 2)


def test_a_tampered_checkpoint_is_refused_and_the_model_keeps_its_verified_state() -> None:
    agg, model = two_rounds(), fresh_model()
    agg.updates[2] = save(tampered(tensors(2, 0.1)))
    agg.checkpoints[2] = save(tampered(agg.params[2]))
    with pytest.raises(FollowError) as refused:
        agg.follow(model, 2)
    got, want = sha(tampered(agg.params[2])), agg.chain.hashes[2]
    assert str(refused.value) == f"checkpoint of round 2 hashes to {got.hex()}, the chain records {want.hex()}"
    # The tampered update was applied in place (bounded memory: no second copy of the model) and did not
    # hash to the chain's: from then on the held model claims no verified state, so no base the
    # aggregator offers can match it and nothing is trained on it (the node stops on FollowError and
    # resumes from its last saved, verified round).
    assert model.round_done == 1 and model.sha256 == b""
    assert not bits_equal(model.params, agg.params[1])
    assert model.outer is None  # its momentum no longer mirrors the aggregator's: later rounds pull checkpoints


def test_a_tampered_checkpoint_changes_nothing_held() -> None:
    agg, model = two_rounds(), fresh_model(outer=False)
    agg.checkpoints[2] = save(tampered(agg.params[2]))
    with pytest.raises(FollowError, match="checkpoint of round 2 hashes to"):
        agg.follow(model, 2)
    assert bits_equal(model.params, tensors(0)) and model.sha256 == sha(tensors(0)) and model.round_done == 0


def test_a_pulled_checkpoint_is_held_in_fp32() -> None:
    agg, model = two_rounds(), fresh_model(outer=False)
    half = {n: t.to(torch.bfloat16) for n, t in agg.params[2].items()}
    agg.checkpoints[2], agg.chain.hashes[2] = save(half), sha(half)  # the chain vouches for bf16 tensors
    assert agg.follow(model, 2) == "checkpoint"
    assert all(t.dtype == torch.float32 for t in model.params.values())
    assert all(torch.equal(model.params[n], half[n].float()) for n in half)


def test_after_an_unreadable_update_and_a_refused_checkpoint_the_momentum_is_given_up() -> None:
    agg, model = two_rounds(), fresh_model()
    agg.updates[1] = b"not a safetensors file"
    agg.checkpoints[2] = save(tampered(agg.params[2]))
    with pytest.raises(FollowError, match="checkpoint of round 2 hashes to"):
        agg.follow(model, 2)
    assert model.outer is None and model.round_done == 0 and bits_equal(model.params, tensors(0))


def test_a_sharded_epochs_model_is_followed_by_its_fragment_root() -> None:
    agg = two_rounds()
    agg.chain = Chain({r: model_root(p, 2) for r, p in agg.params.items() if r > 0})
    params = tensors(0)
    model = GlobalModel(params, model_root(params, 2), 0, OuterOptimizer(LR, MOMENTUM), shards=2)
    assert agg.follow(model, 2) == "updates" and bits_equal(model.params, agg.params[2])
    assert model.sha256 == agg.chain.hashes[2] != sha(agg.params[2])
    pulled = GlobalModel(tensors(0), b"", 0, None, shards=2)
    assert agg.follow(pulled, 2) == "checkpoint" and pulled.sha256 == agg.chain.hashes[2]
    unsharded = fresh_model()  # the canonical hash is not the root: the update and the checkpoint are refused
    with pytest.raises(FollowError, match="checkpoint of round 2 hashes to"):
        agg.follow(unsharded, 2)


def test_a_model_stepped_ahead_is_the_next_rounds_and_the_held_one_stays_untouched() -> None:
    agg, model = two_rounds(), fresh_model()
    before = {n: t.clone() for n, t in model.params.items()}
    ahead = step_ahead(model, 1, tensors(1, 0.1))
    assert ahead is not None and ahead.round == 1
    assert bits_equal(ahead.params, agg.params[1]) and ahead.sha256 == agg.chain.hashes[1]
    assert ahead.outer.steps == 1 and model.outer is not None and model.outer.steps == 0
    assert set(ahead.outer.buffers) == set(before) and model.outer.buffers == {}  # its momentum untouched too
    assert bits_equal(model.params, before) and model.round_done == 0 and model.sha256 == sha(before)
    assert step_ahead(model, 2, tensors(2, 0.1)) is None  # not the round after the one held
    assert step_ahead(fresh_model(outer=False), 1, tensors(1, 0.1)) is None  # no momentum to step with


def test_a_step_taken_ahead_gives_the_same_next_model_and_takes_the_one_after(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    agg, model = two_rounds(), fresh_model()
    speculated = speculate(model, 1, lambda: False)
    assert speculated is not None
    assert speculate(model, 2, lambda: False) is None  # not the round after the one held
    assert speculate(model, 1, lambda: True) is None  # cancelled before its first tensor
    ahead = step_ahead(model, 1, tensors(1, 0.1), speculated, speculate_next=True)
    assert ahead is not None and bits_equal(ahead.params, agg.params[1]) and ahead.sha256 == agg.chain.hashes[1]
    assert bits_equal(model.params, tensors(0))  # the held model untouched
    # The next round's step, taken ahead from the new model: finished with round 2's update it is round 2's.
    assert ahead.next_step is not None and ahead.next_step.steps_from(ahead.params)
    adopt(model, ahead, agg.chain)
    after = step_ahead(model, 2, tensors(2, 0.1), ahead.next_step)
    assert after is not None and bits_equal(after.params, agg.params[2]) and after.sha256 == agg.chain.hashes[2]
    # A step taken ahead from other tensors is refused; one that fails to take the next leaves it out.
    with pytest.raises(ValueError, match="taken ahead from other tensors than the held model's"):
        step_ahead(fresh_model(), 1, tensors(1, 0.1), speculate(fresh_model(), 1, lambda: False))
    monkeypatch.setattr(SpeculativeStep, "run", lambda self, cancelled=None: (_ for _ in ()).throw(MemoryError()))
    caplog.set_level(logging.ERROR, "gonka_node.host.follow")
    again = step_ahead(fresh_model(), 1, tensors(1, 0.1), speculate_next=True)
    assert again is not None and again.next_step is None and again.sha256 == agg.chain.hashes[1]
    assert "round 2: the next round's outer step ahead of its update failed" in caplog.text


def test_a_model_ahead_is_adopted_only_as_the_next_round_with_the_chains_hash(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.host.follow")
    agg, model = two_rounds(), fresh_model()
    ahead = step_ahead(model, 1, tensors(1, 0.1))
    assert ahead is not None
    other = tampered(ahead.params)
    assert not adopt(model, NextModel(1, other, ahead.outer, sha(other)), agg.chain)
    assert model.round_done == 0 and "hashes to" in caplog.text and "not the chain's" in caplog.text
    assert not adopt(model, NextModel(2, ahead.params, ahead.outer, ahead.sha256), agg.chain)
    assert not adopt(fresh_model(outer=False), ahead, agg.chain)
    assert model.round_done == 0 and bits_equal(model.params, tensors(0))
    assert adopt(model, ahead, agg.chain)
    assert (model.round_done, model.sha256) == (1, agg.chain.hashes[1])
    assert model.params is ahead.params and model.outer is ahead.outer
    assert agg.follow(model, 2) == "updates" and bits_equal(model.params, agg.params[2])  # on from the adopted state
