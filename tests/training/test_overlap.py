"""The eager overlap rule (training/overlap.py): a host trains round r from its forecast of round r − 1's
model, the outer step on round r − 2's model with its own decoded payload of round r − 1 as the average.

The forecast is a pure function of public inputs, so a worker fed only those (the checkpoint after round
r − 2, the outer momentum there, the payload the host sent) reproduces the host's next payload bit for bit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import Tensor

from gonka_node.cli.train import local_recipe
from gonka_node.core.recipe import Recipe, RecipeError, check_network_overlap
from training.codecs import get_codec, round_seed
from training.data import Windows
from training.diloco import OuterOptimizer
from training.local import LocalDiLoCo, LocalRunConfig
from training.model import ModelConfig, build_model
from training.overlap import base_round, eager_base
from training.worker import Assignment, DiLoCoWorker, Rebase, WorkerRound


def _tensors(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


def _public_rounds(
    run: LocalDiLoCo, rounds: int
) -> tuple[list[dict[str, Tensor]], list[OuterOptimizer], list[Mapping[str, Tensor]]]:
    """Run `rounds` rounds and return what is public of each: the global model before it (checkpoints),
    the outer momentum there (the aggregator's state), slot 0's decoded payload (what it sent)."""
    models, outers, sent = [], [], []
    for _ in range(rounds):
        models.append({n: p.detach().clone() for n, p in run.params.items()})
        twin = OuterOptimizer(run.outer.lr, run.outer.momentum)
        twin.restore(run.outer.steps, run.outer.buffers)
        outers.append(twin)
        run.run_round()
        decoded = run.sent[0]
        assert decoded is not None
        sent.append(decoded)
    return models, outers, sent


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
    models, outers, sent = _public_rounds(run, 3)
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


# ---- late forecast and merge (recipe forecast_step, merge_step): a round moves onto another base ----


def _worker(recipe: Recipe, windows: Windows, slot: int = 0, slots: int = 2) -> DiLoCoWorker:
    return DiLoCoWorker(build_model(recipe.model, recipe.init_seed), recipe.inner_config(), get_codec(recipe.codec),
                        windows, Assignment(recipe.epoch_seed, slot, slots), recipe.ef_decay, first_round=0)


def _tiny(**fields: Any) -> Recipe:
    return local_recipe(ModelConfig.preset("tiny"), n_rounds=3, inner_steps=4, micro_batch=4, seq_len=32,
                        codec="int8:block=64", round_state="fresh", **fields)


def test_a_rebase_shifts_the_local_model_by_the_bases_difference_and_measures_from_the_new_one(
    small_windows: Windows,
) -> None:
    torch.set_num_threads(1)
    recipe = _tiny()
    start = {n: p.detach().clone() for n, p in build_model(recipe.model, 1).named_parameters()}
    target = {n: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) for n, t in start.items()}
    called: list[int] = []

    def later() -> dict[str, Tensor]:
        called.append(worker.trainer.step)  # asked for when the round gets there, not before
        return target

    worker = _worker(recipe, small_windows)
    delta, result = worker.local_delta(0, start, rebases=[Rebase(1, later)])
    assert called == [1]
    assert len(result.losses) == 4
    # By hand, in one pass of the same loop: one step from `start`, the shift, three steps, Δ from `target`.
    twin = _worker(recipe, small_windows)
    with torch.no_grad():
        for n, p in twin.model.named_parameters():
            p.copy_(start[n])
    batches = iter(twin.start_round(0, twin.micro_batch))
    first = twin.trainer.run(batches, steps=1)
    with torch.no_grad():
        for n, p in twin.model.named_parameters():
            p.add_(target[n] - start[n])
    rest = twin.trainer.run(batches, steps=3)
    local = dict(twin.model.named_parameters())
    for n in start:
        assert torch.equal(delta[n], target[n] - local[n].detach()), n
    assert result.losses == first.losses + rest.losses and result.tokens == first.tokens + rest.tokens
    # Not a round from either base alone.
    plain = _worker(recipe, small_windows).local_delta(0, start)[0]
    from_target = _worker(recipe, small_windows).local_delta(0, target)[0]
    assert not any(torch.equal(delta[n], plain[n]) or torch.equal(delta[n], from_target[n]) for n in start)


@pytest.mark.parametrize("steps", [[0], [4], [2, 2], [3, 1]])
def test_a_rebase_outside_the_round_or_out_of_order_is_refused(small_windows: Windows, steps: list[int]) -> None:
    worker = _worker(_tiny(), small_windows)
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    with pytest.raises(ValueError, match=r"rebase steps .* must be increasing and strictly between 0 and the round's 4"):
        worker.local_delta(0, params, rebases=[Rebase(s, lambda: params) for s in steps])


@pytest.mark.parametrize(("fields", "message"), [
    ({"forecast_step": 2}, "forecast_step: 2 needs overlap = \"eager\" (this recipe's is 'delayed')"),
    ({"overlap": "eager", "merge_step": 4}, "merge_step: 4 must be below inner_steps (4)"),
    ({"overlap": "eager", "merge_step": -1}, "merge_step: must be a non-negative integer"),
    ({"overlap": "eager", "forecast_step": 2, "merge_step": 2}, "forecast_step (2) must come before merge_step (2)"),
])
def test_the_recipe_refuses_rebases_it_cannot_make(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=re.escape(message)):
        _tiny(**{"overlap": "delayed", **fields})


def test_rebases_stay_out_of_the_canonical_recipe_at_zero_and_are_served_in_the_network() -> None:
    plain, late = _tiny(overlap="eager"), _tiny(overlap="eager", forecast_step=1, merge_step=3)
    assert b"forecast_step" not in plain.canonical_json() and b"merge_step" not in plain.canonical_json()
    assert json.loads(late.canonical_json())["forecast_step"] == 1 and plain.sha256() != late.sha256()
    check_network_overlap(plain)
    check_network_overlap(late)


def test_eager_rounds_moved_late_onto_the_forecast_and_then_onto_the_model_after_r_minus_1_replay_from_public_inputs(
    small_windows: Windows,
) -> None:
    """Slot 0 of an eager run with forecast_step 1 and merge_step 3: round r trains from the outer step on
    G(r−2) with an all-zero update, moves onto its forecast after 1 step and onto G(r−1) after 3; a
    fresh worker fed only public inputs sends the same bytes."""
    torch.set_num_threads(1)
    recipe = _tiny(overlap="eager", forecast_step=1, merge_step=3)
    run = LocalDiLoCo(LocalRunConfig(recipe=recipe, workers=2, eval_windows=4), small_windows)
    payloads: list[WorkerRound] = []
    train = run.hosts[0].train_round

    def recorded(*args: Any, **kwargs: Any) -> WorkerRound:
        payloads.append(train(*args, **kwargs))
        return payloads[-1]

    run.hosts[0].train_round = recorded  # type: ignore[method-assign]
    models, outers, sent = _public_rounds(run, 3)
    worker = _worker(recipe, small_windows)
    for r in range(3):
        if r == 0:  # nothing sent before: from the forecast (the initial model) throughout, then onto G(0)
            start, rebases = models[0], [Rebase(3, lambda: models[0])]
        else:
            momentum_part = eager_base(models[r - 1], outers[r - 1], {n: torch.zeros_like(t) for n, t in sent[r - 1].items()})
            forecast = eager_base(models[r - 1], outers[r - 1], sent[r - 1])
            assert not any(torch.equal(momentum_part[n], forecast[n]) for n in forecast)
            start = momentum_part
            rebases = [Rebase(1, lambda f=forecast: f), Rebase(3, lambda m=models[r]: m)]
        assert worker.train_round(r, start, rebases=rebases).payload == payloads[r].payload, r
    # The plain eager rule gives other bytes from round 1 on.
    plain = _worker(recipe, small_windows)
    plain.train_round(0, models[0], rebases=[Rebase(3, lambda: models[0])])
    assert plain.train_round(1, eager_base(models[0], outers[0], sent[0])).payload != payloads[1].payload
