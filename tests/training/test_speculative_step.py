"""The outer step taken ahead of its update (`SpeculativeStep`): bit for bit the step it stands for."""

from __future__ import annotations

import pytest
import torch

from training.diloco import OuterOptimizer, SpeculativeStep

TINY = 2.0**-149  # the smallest fp32 subnormal


def _bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.int32).tolist()


def _model(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = {"a.weight": torch.randn(37, 41, generator=gen), "b.bias": torch.randn(333, generator=gen) * 1e-3}
    # Edges of the fp32 step where a shortcut would round differently: signed zeros, subnormals, huge.
    model["b.bias"][:6] = torch.tensor([0.0, -0.0, TINY, -TINY * 3, 3e38, -1e-38])
    return model


def _sparse_update(model: dict[str, torch.Tensor], seed: int, density: float) -> dict[str, torch.Tensor]:
    """A decoded top-k broadcast's shape: mostly +0, a few entries set, among them −0 and subnormals
    (a +0 entry is the only one the speculation may skip; −0 has other bits)."""
    gen = torch.Generator().manual_seed(seed)
    update = {}
    for name, p in model.items():
        g = torch.randn(p.shape, generator=gen) * 1e-2
        g[torch.rand(p.shape, generator=gen) >= density] = 0.0
        flat = g.view(-1)
        flat[7], flat[8], flat[9], flat[10] = -0.0, TINY, -TINY, 1e-39
        update[name] = g
    return update


@pytest.mark.parametrize(("lr", "momentum", "nesterov"), [(0.7, 0.9, True), (1.0, 0.5, False), (0.3, 0.0, False)])
def test_the_speculated_step_finished_with_the_update_is_the_step_bit_for_bit(
    lr: float, momentum: float, nesterov: bool
) -> None:
    """Three rounds (the first without momentum buffers), each speculated from the previous round's
    result and finished with a sparse update: model and momentum equal the plain step's, every bit."""
    plain_model, ahead_model = _model(0), _model(0)
    plain, ahead = OuterOptimizer(lr, momentum, nesterov), OuterOptimizer(lr, momentum, nesterov)
    for r in range(3):
        update = _sparse_update(plain_model, 10 + r, density=0.05)
        plain.step(plain_model, update)
        before = {name: t.clone() for name, t in ahead_model.items()}
        buffers_before = {name: b.clone() for name, b in ahead.buffers.items()}
        base_model, base_buffers = ahead_model, dict(ahead.buffers)
        spec = SpeculativeStep(ahead, ahead_model)
        assert spec.run()
        ahead_model, ahead = spec.finish(update)
        for name in plain_model:
            assert _bits(ahead_model[name]) == _bits(plain_model[name]), (r, name)
        assert ahead.steps == plain.steps == r + 1
        assert sorted(ahead.buffers) == sorted(plain.buffers)
        for name, buf in plain.buffers.items():
            assert _bits(ahead.buffers[name]) == _bits(buf), (r, name)
        # The base it was speculated from is untouched (a round may be training from it).
        for name, t in before.items():
            assert _bits(base_model[name]) == _bits(t)
        for name, b in buffers_before.items():
            assert _bits(base_buffers[name]) == _bits(b)
        with pytest.raises(RuntimeError, match="finished already"):
            spec.finish(update)  # a second finish would write over the model it returned
        with pytest.raises(RuntimeError, match="finished already"):
            spec.run()  # would reset the step count of the optimizer it returned
        assert spec._base == {} and spec._base_outer.buffers == {}  # the base is let go of


def test_the_entries_recomputed_are_exactly_the_update_s_that_are_not_plus_zero() -> None:
    """The speculation is the step with a +0 update: the finish recomputes every entry whose bits are not
    those of +0 (−0 and subnormals included) and no other, and leaves the others as the run made them."""
    model, outer = _model(1), OuterOptimizer(0.7, 0.9)
    outer.step(model, _sparse_update(model, 1, 1.0))  # momentum buffers everywhere
    spec = SpeculativeStep(outer, model)
    spec.run()
    ran = {name: t.clone() for name, t in spec.params.items()}
    update = {name: torch.zeros_like(t) for name, t in model.items()}
    update["b.bias"][100], update["b.bias"][101] = 0.5, TINY
    update["a.weight"][0, 3] = -0.0
    where, _, _ = spec._entries(update)
    assert {name: idx.tolist() for name, idx in where.items()} == {"a.weight": [3], "b.bias": [100, 101]}
    stepped, _ = spec.finish(update)
    changed = {
        (name, i)
        for name in model
        for i, (x, y) in enumerate(zip(_bits(stepped[name]), _bits(ran[name]), strict=True))
        if x != y
    }
    assert ("b.bias", 100) in changed
    assert changed <= {("b.bias", 100), ("b.bias", 101), ("a.weight", 3)}


def test_an_update_the_step_refuses_changes_nothing() -> None:
    model, outer = _model(2), OuterOptimizer(0.7, 0.9)
    outer.step(model, _sparse_update(model, 2, 0.5))
    spec = SpeculativeStep(outer, model)
    spec.run()
    ran = {name: t.clone() for name, t in spec.params.items()}
    bad = _sparse_update(model, 3, 0.05)
    bad["a.weight"][5, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        spec.finish(bad)
    with pytest.raises(ValueError, match=r"update b.bias is torch.float32 of shape \(3,\), expected torch.float32 of shape \(333,\)"):
        spec.finish({"a.weight": bad["a.weight"], "b.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="parameter names differ"):
        spec.finish({"a.weight": bad["a.weight"]})
    for name, t in ran.items():
        assert _bits(spec.params[name]) == _bits(t)
    ran_buffers = {name: b.clone() for name, b in spec.outer.buffers.items()}
    with pytest.raises(ValueError, match="NaN or infinity"):
        spec.forecast(bad)
    with pytest.raises(ValueError, match=r"update a.weight is torch.float64"):
        spec.finish({name: t.double() for name, t in bad.items()})
    for name, t in ran.items():
        assert _bits(spec.params[name]) == _bits(t)
        assert _bits(spec.outer.buffers[name]) == _bits(ran_buffers[name])
    assert spec.outer.steps == outer.steps + 1 and not spec.forecasted and not spec.finished
    # A forecast taken, then a refused finish: the forecast's tensors and the speculation stay as they were.
    forecast = spec.forecast(_sparse_update(model, 4, 0.05))
    kept = {name: t.clone() for name, t in forecast.items()}
    with pytest.raises(ValueError, match="NaN or infinity"):
        spec.finish(bad)
    assert spec.forecasted and all(_bits(forecast[name]) == _bits(t) for name, t in kept.items())


def test_a_cancelled_run_is_completed_by_finish() -> None:
    model, outer = _model(3), OuterOptimizer(0.7, 0.9)
    expected = {name: t.clone() for name, t in model.items()}
    update = _sparse_update(model, 4, 0.1)
    outer.copy().step(expected, update)
    calls = []
    spec = SpeculativeStep(outer, model)
    assert not spec.run(cancelled=lambda: calls.append(1) is None and len(calls) > 1)  # one tensor, then stop
    assert list(spec.params) == ["a.weight"]
    stepped, stepped_outer = spec.finish(update)
    for name in model:
        assert _bits(stepped[name]) == _bits(expected[name])
    assert stepped_outer.steps == 1


def test_a_copy_of_the_optimizer_steps_without_touching_the_original() -> None:
    model, outer = _model(4), OuterOptimizer(0.7, 0.9)
    outer.step(model, _sparse_update(model, 5, 1.0))
    saved = {name: b.clone() for name, b in outer.buffers.items()}
    other = outer.copy()
    other.step({name: t.clone() for name, t in model.items()}, _sparse_update(model, 6, 1.0))
    assert other.steps == 2 and outer.steps == 1
    for name, b in saved.items():
        assert _bits(outer.buffers[name]) == _bits(b)
        assert _bits(other.buffers[name]) != _bits(b)


def test_a_forecast_with_one_update_then_a_finish_with_another_are_each_the_step() -> None:
    """An eager host forecasts with its own payload, then the round's broadcast finishes the same
    speculation: both are the plain step with their update, bit for bit, and the forecast's tensors (a
    round trains from them) are left as they were by the finish."""
    model, outer = _model(5), OuterOptimizer(0.7, 0.9)
    outer.step(model, _sparse_update(model, 7, 1.0))
    own, broadcast = _sparse_update(model, 8, 0.05), _sparse_update(model, 9, 0.05)
    expected = {}
    for label, update in (("own", own), ("broadcast", broadcast)):
        params = {name: t.clone() for name, t in model.items()}
        outer.copy().step(params, update)
        expected[label] = params
    spec = SpeculativeStep(outer, model)
    spec.run()
    forecast = spec.forecast(own)
    assert spec.forecasted
    for name in model:
        assert _bits(forecast[name]) == _bits(expected["own"][name])
        assert forecast[name] is spec.params[name]  # written over the speculation's own tensors: no copy
    with pytest.raises(RuntimeError, match="a forecast was taken already"):
        spec.forecast(own)
    stepped, stepped_outer = spec.finish(broadcast)
    assert not spec.forecasted
    for name in model:
        assert _bits(stepped[name]) == _bits(expected["broadcast"][name])
        assert _bits(forecast[name]) == _bits(expected["own"][name])  # the round's base is untouched
    assert stepped_outer.steps == 2


def test_a_sparse_update_is_the_dense_one_s_entries() -> None:
    """`Codec.decode_sparse`'s form: (positions, values) per tensor, +0 elsewhere; checked like a dense one."""
    model, outer = _model(7), OuterOptimizer(0.7, 0.9)
    outer.step(model, _sparse_update(model, 10, 1.0))
    dense = _sparse_update(model, 11, 0.05)
    sparse = {}
    for name, g in dense.items():
        idx = g.reshape(-1).view(torch.int32).nonzero().squeeze(1)
        sparse[name] = (idx, g.reshape(-1)[idx])
    expected = {name: t.clone() for name, t in model.items()}
    outer.copy().step(expected, dense)
    spec = SpeculativeStep(outer, model)
    for name, t in spec.finish(sparse)[0].items():
        assert _bits(t) == _bits(expected[name])
    for bad in ((sparse["b.bias"][0] + 333, sparse["b.bias"][1]), (sparse["b.bias"][0].int(), sparse["b.bias"][1]),
                (sparse["b.bias"][0], sparse["b.bias"][1][:-1])):
        with pytest.raises(ValueError, match=r"sparse update b.bias must be int64 positions in \[0, 333\)"):
            SpeculativeStep(outer, model).finish({**sparse, "b.bias": bad})


def test_a_speculation_knows_the_tensors_it_steps_from() -> None:
    model, outer = _model(6), OuterOptimizer(0.7, 0.9)
    spec = SpeculativeStep(outer, model)
    assert spec.steps_from(model)
    assert spec.steps_from(dict(model))  # another mapping of the same tensors
    assert not spec.steps_from({name: t.clone() for name, t in model.items()})  # equal values, other tensors
    assert not spec.steps_from({"a.weight": model["a.weight"]})


@pytest.mark.parametrize(("lr", "momentum", "nesterov"), [(0.7, 0.9, True), (1.0, 0.5, False), (0.3, 0.0, False)])
@pytest.mark.parametrize("forecast", [False, True])
def test_the_next_step_taken_before_the_update_and_fixed_after_it_is_the_next_step_bit_for_bit(
    lr: float, momentum: float, nesterov: bool, forecast: bool,
) -> None:
    """`take_after` steps the +0 model ahead of the update (a forecast written over it or not, as an eager
    host's late round does); `after_finish` fixes it at the entries the update and the forecast changed:
    the model and momentum are `SpeculativeStep(outer, finished).run()`'s, every bit, and the finished
    model is the step's base. Three rounds chained so, the first from a model with no momentum yet."""
    model, outer = _model(3), OuterOptimizer(lr, momentum, nesterov)
    spec = SpeculativeStep(outer, model)
    spec.run()
    for r in range(3):
        if forecast:
            spec.forecast(_sparse_update(model, 30 + r, 0.05))
        assert spec.take_after()
        update = _sparse_update(model, 20 + r, 0.05)
        model, outer = spec.finish(update)
        expected = SpeculativeStep(outer, model)
        expected.run()
        after = spec.after_finish()
        assert after is not None and after.done and after.steps_from(model)
        assert after.outer.steps == expected.outer.steps == r + 2
        for name in model:
            assert _bits(after.params[name]) == _bits(expected.params[name]), (r, name)
        assert sorted(after.outer.buffers) == sorted(expected.outer.buffers)
        for name, buf in expected.outer.buffers.items():
            assert _bits(after.outer.buffers[name]) == _bits(buf), (r, name)
        assert spec.after_finish() is None  # once
        spec = after


def test_without_the_next_step_taken_ahead_there_is_none_to_fix_and_a_cancelled_one_is_not_kept() -> None:
    model, outer = _model(4), OuterOptimizer(0.7, 0.9)
    spec = SpeculativeStep(outer, model)
    with pytest.raises(RuntimeError, match="the step is not finished"):
        spec.after_finish()
    assert not spec.take_after(cancelled=lambda: True)
    spec.finish(_sparse_update(model, 1, 0.05))
    assert spec.after_finish() is None
    with pytest.raises(RuntimeError, match="take_after: finished already"):
        spec.take_after()
