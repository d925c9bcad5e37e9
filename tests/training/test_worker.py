"""DiLoCoWorker: a round's payload is what the aggregator decodes, with per-round codec state."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from training.codecs import CodecError, get_codec, round_seed, spec_of
from training.data import Windows
from training.inner import InnerConfig
from training.model import ModelConfig, build_model
from training.worker import Assignment, DiLoCoWorker, replay_round

CFG = ModelConfig.preset("tiny")


def windows() -> Windows:
    rng = np.random.RandomState(0)
    return Windows(rng.randint(0, 256, size=40_000).astype(np.uint8), seq_len=16, heldout_fraction=0.1)


def inner_config(round_state: str = "carry") -> InnerConfig:
    return InnerConfig(steps=3, lr=1e-3, warmup_steps=1, total_steps=30, micro_batch=2, seq_len=16,
                       round_state=round_state)  # type: ignore[arg-type]


def worker(codec: str, seed: int = 5, round_state: str = "carry", slot: int = 1) -> DiLoCoWorker:
    return DiLoCoWorker(build_model(CFG, 0), inner_config(round_state), get_codec(codec), windows(),
                        Assignment(seed, slot, 4))


def global_params() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(CFG, 0).named_parameters()}


def test_shared_mask_payload_decodes_only_with_its_rounds_codec() -> None:
    name = "mask:stride=2,bits=2"
    params = global_params()
    spec = spec_of(params)
    result = worker(name).train_round(3, params)
    own = get_codec(name).for_round(round_seed(5, 3))
    decoded = own.decode(result.payload, spec)
    assert set(decoded) == set(params)
    with pytest.raises(CodecError):  # another round's mask (what a seedless decoder would use)
        get_codec(name).for_round(round_seed(5, 4)).decode(result.payload, spec)


def test_state_dict_resumes_the_next_round_bit_for_bit() -> None:
    params = global_params()
    a = worker("int8")
    a.train_round(1, params)
    b = worker("int8")
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # a restarted host: AdamW state and residual
    assert a.train_round(2, params).payload == b.train_round(2, params).payload


def test_a_fresh_epochs_state_is_the_residuals_and_the_clock_and_resumes_bit_for_bit() -> None:
    """A `fresh` round restarts AdamW, so what crosses rounds is the two residuals and the step: a worker
    restored from that alone (saved to a file, as a host keeps it) trains round 3 exactly as the one that
    never stopped. A `carry` trainer refuses such a state (its moments would be lost)."""
    params = global_params()
    a = worker("int8", round_state="fresh")
    a.train_round(1, params)
    a.train_round(2, _moved(params, 0.01))
    state = a.state_dict()
    assert state["inner"] == {"step": a.trainer.step} and set(state["feedback"]["previous"]) == set(params)
    assert a.snapshot()["inner"] == {"step": a.trainer.step}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    b = worker("int8", round_state="fresh")
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.trainer.step == a.trainer.step and not b.trainer.optimizer.state
    base = _moved(params, 0.02)
    assert a.train_round(3, base).payload == b.train_round(3, base).payload
    assert all(torch.equal(a.feedback.residual[n], b.feedback.residual[n]) for n in params)
    assert "optimizer" in worker("int8").state_dict()["inner"]  # carry: the moments cross rounds
    with pytest.raises(ValueError, match="lacks"):
        worker("int8").load_state_dict(state)


def test_a_snapshot_is_a_rollback_point_that_copies_the_optimizer_and_shares_the_residuals() -> None:
    """A refused round's rollback point: training on changes nothing in it (AdamW's moments are updated
    in place, so they are copied), yet it holds the residuals' tensors themselves (a compress replaces
    them, so sharing is safe and saves two residual-sized copies), and loading it back retrains the
    round byte for byte."""
    params = global_params()
    a = worker("int8")
    a.train_round(1, params)
    a.train_round(2, params)  # both residuals exist
    snap = a.snapshot()
    live = a.state_dict()
    assert all(snap["feedback"][k][n] is a.feedback.__dict__[k][n] for k in ("residual", "previous")
               for n in live["feedback"][k])
    moments = {i: s["exp_avg"].clone() for i, s in snap["inner"]["optimizer"]["state"].items()}
    first = a.train_round(3, params).payload
    assert all(snap["feedback"]["residual"][n] is not a.feedback.residual[n] for n in params)  # replaced
    assert all(torch.equal(snap["inner"]["optimizer"]["state"][i]["exp_avg"], m) for i, m in moments.items())
    a.load_state_dict(snap)
    assert a.train_round(3, params).payload == first


def _moved(params: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {n: t + by * torch.randn(t.shape, generator=gen) for n, t in params.items()}


def test_fresh_round_is_replayed_bit_for_bit_by_anyone() -> None:
    """With round_state = 'fresh' a host's round 3 depends only on the base model, its windows and the
    round: a replay from scratch (no AdamW history, no earlier rounds) equals it exactly."""
    host = worker("fp32", round_state="fresh")
    params = global_params()
    host.train_round(1, params)
    host.train_round(2, _moved(params, 0.01))  # AdamW history a replayer never sees
    base = _moved(params, 0.02)
    delta, _ = host.local_delta(3, base)
    replay = replay_round(build_model(CFG, 0), inner_config("fresh"), windows(), Assignment(5, 1, 4), 3, base)
    assert all(torch.equal(delta[n], replay[n]) for n in delta)
    # Another slot's windows give a different update, as does carrying AdamW state across rounds.
    other = replay_round(build_model(CFG, 0), inner_config("fresh"), windows(), Assignment(5, 2, 4), 3, base)
    assert not torch.equal(delta["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    carried = worker("fp32", round_state="carry")
    carried.train_round(1, params)
    carried.train_round(2, _moved(params, 0.01))
    assert not torch.equal(carried.local_delta(3, base)[0]["lm_head.weight"], delta["lm_head.weight"])


def test_fresh_round_starts_on_the_epochs_schedule() -> None:
    host = worker("fp32", round_state="fresh")
    host.train_round(4, global_params())  # a late joiner's first round
    assert host.trainer.step == 4 * 3  # rounds 1..4 of H = 3 steps: it ends where everyone does
    with pytest.raises(ValueError, match="precedes the first round"):
        host.round_start_step(0)


def test_replay_refuses_carried_state() -> None:
    with pytest.raises(ValueError, match="round_state = 'fresh'"):
        replay_round(build_model(CFG, 0), inner_config("carry"), windows(), Assignment(5, 1, 4), 1, global_params())
