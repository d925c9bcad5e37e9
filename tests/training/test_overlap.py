"""The eager overlap rule (training/overlap.py): a host trains round r from its forecast of round r − 1's
model, the outer step on round r − 2's model with its own decoded payload of round r − 1 as the average.

The forecast is a pure function of public inputs, so a worker fed only those (the checkpoint after round
r − 2, the outer momentum there, the payload the host sent) reproduces the host's next payload bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from gonka_node.cli.train import local_recipe
from training.codecs import get_codec, round_seed
from training.data import Windows
from training.diloco import OuterOptimizer
from training.local import LocalDiLoCo, LocalRunConfig
from training.model import ModelConfig, build_model
from training.overlap import base_round, eager_base
from training.worker import Assignment, DiLoCoWorker


def _tensors(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


def test_the_eager_base_is_the_outer_step_with_the_own_payload_and_leaves_the_momentum_alone() -> None:
    anchor, earlier, own = _tensors(1), _tensors(2), _tensors(3)
    outer = OuterOptimizer(0.9, 0.5)
    outer.step({n: t.clone() for n, t in anchor.items()}, earlier)  # momentum from one earlier step
    before = {n: b.clone() for n, b in outer.buffers.items()}
    forecast = eager_base(anchor, outer, own)
    twin = OuterOptimizer(0.9, 0.5)
    twin.restore(outer.steps, outer.buffers)
    expected = {n: t.clone() for n, t in anchor.items()}
    twin.step(expected, own)
    for name in anchor:
        assert torch.equal(forecast[name], expected[name])
        assert not torch.equal(forecast[name], anchor[name])
        assert torch.equal(outer.buffers[name], before[name])  # the caller's optimizer is not stepped
    assert outer.steps == 1
    alone = eager_base(anchor, outer, None)  # nothing sent yet: the anchor itself, as a copy
    assert all(torch.equal(alone[n], anchor[n]) and alone[n] is not anchor[n] for n in anchor)


def test_eager_and_delayed_share_the_schedule() -> None:
    assert [base_round(r, "eager") for r in (1, 2, 3, 4)] == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="overlap: must be one of off, delayed, eager, got 'streaming'"):
        base_round(3, "streaming")


def test_an_eager_local_run_trains_from_the_forecast_that_public_inputs_reproduce(small_windows: Windows) -> None:
    torch.set_num_threads(1)
    recipe = local_recipe(ModelConfig.preset("tiny"), n_rounds=3, inner_steps=3, micro_batch=4, seq_len=32,
                          codec="int8:block=64", round_state="fresh", overlap="eager")
    run = LocalDiLoCo(LocalRunConfig(recipe=recipe, workers=2, eval_windows=4), small_windows)
    models: list[dict[str, Tensor]] = []  # the global model before each round (public: checkpoints)
    outers: list[OuterOptimizer] = []  # the outer momentum there (public: the aggregator's state)
    sent: list[Mapping[str, Tensor]] = []  # slot 0's decoded payload of each round (public: what it sent)
    for _ in range(3):
        models.append({n: p.detach().clone() for n, p in run.params.items()})
        twin = OuterOptimizer(run.outer.lr, run.outer.momentum)
        twin.restore(run.outer.steps, run.outer.buffers)
        outers.append(twin)
        run.run_round()
        decoded = run.sent[0]
        assert decoded is not None
        sent.append(decoded)
    # A fresh worker fed only those replays slot 0's rounds (the simulation numbers them from 0): round
    # 0 from the initial model, round r from the outer step on the model before round r − 1 with the
    # payload it sent in round r − 1.
    worker = DiLoCoWorker(build_model(recipe.model, recipe.init_seed), recipe.inner_config(),
                          get_codec(recipe.codec), small_windows, Assignment(recipe.epoch_seed, 0, 2),
                          recipe.ef_decay, first_round=0)
    spec = {n: tuple(t.shape) for n, t in models[0].items()}
    for r in range(3):
        base = models[0] if r == 0 else eager_base(models[r - 1], outers[r - 1], sent[r - 1])
        if r == 2:  # a forecast: neither the lagged model nor the one the outer step landed on
            assert not any(torch.equal(base[n], models[1][n]) or torch.equal(base[n], models[2][n]) for n in base)
        payload = worker.train_round(r, base).payload
        replayed = get_codec(recipe.codec).for_round(round_seed(recipe.epoch_seed, r)).decode(payload, spec)
        assert all(torch.equal(replayed[n], sent[r][n]) for n in spec), r
