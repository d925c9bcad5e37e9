"""The outer step's edges: fma32 against exact arithmetic where rounding is hardest, the averager's and
the optimizer's input checks with their messages, and fp32 kept whatever torch's default dtype.

The reference for fma32 is exact rational arithmetic (`fractions`) rounded once to fp32 (nearest, ties
to even) by hand: many cases sit within 2^-70 of a tie between two fp32 numbers, where rounding
through fp64 goes wrong unless the fp64 sum is rounded to odd.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from fractions import Fraction

import pytest
import torch

from training.diloco import (
    _BLOCK,
    _FMA_CHUNK,
    OuterOptimizer,
    StreamingAverager,
    average,
    fma32,
    fma32_reference,
    pseudo_gradient,
)


def round_f32(x: Fraction) -> float:
    """`x` rounded to the nearest fp32 (ties to even); normal range only."""
    if x == 0:
        return 0.0
    sign, x = (-1.0 if x < 0 else 1.0), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    assert -126 <= e <= 127, "reference: outside fp32's normal range"
    scaled = x / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    q, r = divmod(scaled.numerator, scaled.denominator)
    rest = Fraction(r, scaled.denominator)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and q % 2 == 1):
        q += 1
    return sign * q * 2.0 ** (e - 23)


def exact_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[float]:
    return [round_f32(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)]


def near_ties(n: int, seed: int) -> Iterator[tuple[float, float, float]]:
    """c + a·b within j²·2^-70 (relative) of the midpoint between c and its fp32 neighbour, either side:
    on the tie after rounding to fp64 (j < 362), or up to a few fp64 ulps off it."""
    rng = random.Random(seed)
    for _ in range(n):
        k, j = rng.randrange(1 << 23), rng.randrange(1, 1500)
        scale = 2.0 ** rng.randrange(-60, 60)
        side = rng.choice((-1, 1))
        c = (1 + k * 2.0**-23) * scale * rng.choice((-1, 1))
        a = math.copysign(2.0**-24 * (1 + side * j * 2.0**-23) * scale, c) * rng.choice((-1, 1))
        yield a, 1 - side * j * 2.0**-23, c  # a·b = ±2^-24·scale·(1 − j²·2^-46)


def test_fma32_is_exact_then_rounded_once_near_ties_and_at_random() -> None:
    cases = list(near_ties(1500, 0))
    rng = random.Random(1)
    cases += [(rng.uniform(-4, 4), rng.uniform(-4, 4), rng.uniform(-4, 4)) for _ in range(500)]
    a, b, c = (torch.tensor(col, dtype=torch.float32) for col in zip(*cases, strict=True))
    assert fma32(a, b, c).tolist() == exact_fma(a, b, c)  # b a tensor
    for scalar in (0.7, -0.7, 1.5):  # b a scalar, taken as the nearest fp32
        b32 = torch.full_like(a, scalar)
        assert fma32(a, scalar, c).tolist() == exact_fma(a, b32, c)


@pytest.mark.parametrize(
    ("a", "b", "c", "exact"),
    [
        # 4097·16773121 = 2^36 + 1: the fp64 sum drops exactly 1 (err = 1) and lands on a tie of fp32.
        (4097.0, 16773121.0, 2.0**60, 2.0**60 + 2.0**37),
        (4097.0, -16773121.0, -(2.0**60), -(2.0**60) - 2.0**37),
        # An exact tie (err = 0): ties go to even, here upward from an odd c.
        (2.0**-24, 1.0, 1.0 + 2.0**-23, 1.0 + 2.0**-22),
        (2.0**-24, 1.0, 1.0, 1.0),  # and here downward to an even c
    ],
)
def test_fma32_on_constructed_ties(a: float, b: float, c: float, exact: float) -> None:
    assert fma32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c])).item() == exact
    assert fma32(torch.tensor([a]), b, torch.tensor([c])).item() == exact


def test_the_reference_path_alone_is_exact_near_ties() -> None:
    # Off the CPU every element takes `fma32_reference` (on the CPU only ties and subnormals do), so it
    # must round to odd exactly: here also where the fp64 sum lands one ulp above a tie (a·b below it
    # by 0.26 ulp), which a wrong parity test moves back onto the tie, and ties-to-even then rounds down.
    a_up, b_up = 2.0**-24 * (1 + 2863 * 2.0**-23), 1 - 2862 * 2.0**-23
    cases = [*near_ties(600, 2), (a_up, b_up, 1.0), (-a_up, b_up, -1.0), (a_up, b_up, 3.0), (a_up * 4, b_up, 4.0)]
    a, b, c = (torch.tensor(col, dtype=torch.float32) for col in zip(*cases, strict=True))
    assert fma32_reference(a, b, c).tolist() == exact_fma(a, b, c)
    assert fma32_reference(a[-4:-3], b[-4:-3], c[-4:-3]).item() == 1.0 + 2.0**-23


def test_the_reference_path_takes_a_scalar_as_its_nearest_fp32(float64_default: None) -> None:
    # The same bits as the CPU path, whose scalar is fp32 too, whatever torch's default dtype.
    rng = random.Random(4)
    a, c = (torch.tensor([rng.uniform(-4, 4) for _ in range(200)], dtype=torch.float32) for _ in range(2))
    for scalar in (0.1, -0.7):
        expected = exact_fma(a, torch.full_like(a, scalar), c)
        assert fma32_reference(a, scalar, c).tolist() == expected == fma32(a, scalar, c).tolist()


def test_fma32_split_over_threads_gives_the_references_bits() -> None:
    # With several torch threads the CPU path splits the elements between a pool's threads; this also
    # runs where the test process has one thread (the mutation run: OMP_NUM_THREADS=1).
    g = torch.Generator().manual_seed(8)
    n = 3 * _BLOCK + 7  # four parts at four threads, the last one short
    a, b, c = (torch.randn(n, generator=g) for _ in range(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        split = fma32(a, b, c)
    finally:
        torch.set_num_threads(threads)
    assert _bits(split) == _bits(fma32_reference(a, b, c))


def test_fma32_over_several_chunks_equals_it_piece_by_piece() -> None:
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(_FMA_CHUNK + 5, generator=g) for _ in range(3))
    whole = fma32(a, b, c)
    cut = _FMA_CHUNK - 3
    assert torch.equal(whole, torch.cat([fma32(a[:cut], b[:cut], c[:cut]), fma32(a[cut:], b[cut:], c[cut:])]))


@pytest.fixture
def float64_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def outer_and_average() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    deltas = {f"0x{i}": {"w": torch.randn(64, generator=g, dtype=torch.float32)} for i in range(3)}
    avg = StreamingAverager({"w": (64,)})
    for i, key in enumerate(sorted(deltas)):
        avg.add(key, deltas[key], weight=0.1 + 0.2 * i)  # weights with no exact binary form
    params = {"w": torch.randn(64, generator=g, dtype=torch.float32)}
    opt = OuterOptimizer(0.7, 0.9)
    opt.step(params, avg.result())
    opt.step(params, average(deltas))
    return [avg.result()["w"], params["w"], fma32(params["w"], 0.3, params["w"])]


def test_fp32_whatever_torchs_default_dtype(float64_default: None) -> None:
    wide = outer_and_average()
    torch.set_default_dtype(torch.float32)
    narrow = outer_and_average()
    assert all(w.dtype == torch.float32 and torch.equal(w, n) for w, n in zip(wide, narrow, strict=True))


def test_pseudo_gradient_of_wider_or_narrower_locals_is_fp32() -> None:
    g = {"w": torch.tensor([1.0, 2.0**-30])}
    for local in (torch.tensor([0.25, 0.0], dtype=torch.float64), torch.tensor([0.25, 0.0], dtype=torch.bfloat16)):
        delta = pseudo_gradient(g, {"w": local})
        assert delta["w"].dtype == torch.float32 and delta["w"].tolist() == [0.75, 2.0**-30]


def test_pseudo_gradient_refusals_name_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"^local_params: parameter names differ \(missing \['b'\], unexpected \['c'\]\)$"):
        pseudo_gradient({"w": torch.zeros(1), "b": torch.zeros(1)}, {"w": torch.zeros(1), "c": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"^pseudo_gradient: w has shape \(3,\), expected \(2, 2\)$"):
        pseudo_gradient({"w": torch.zeros(2, 2)}, {"w": torch.zeros(3)})


def test_name_lists_in_messages_stop_at_five() -> None:
    names = [f"p{i}" for i in range(7)]
    with pytest.raises(ValueError, match=r"missing \['p0', 'p1', 'p2', 'p3', 'p4'\], unexpected \['q0', 'q1', 'q2', 'q3', 'q4'\]\)$"):
        pseudo_gradient({n: torch.zeros(1) for n in names}, {f"q{i}": torch.zeros(1) for i in range(7)})


def test_the_averagers_first_key_may_be_any_string_and_a_repeat_is_refused() -> None:
    avg = StreamingAverager({"w": (1,)})
    avg.add("", {"w": torch.ones(1)})
    avg.add("b", {"w": torch.ones(1)})
    with pytest.raises(ValueError, match=r"^StreamingAverager\.add: key 'b' is not after 'b'; add contributions in sorted order$"):
        avg.add("b", {"w": torch.ones(1)})
    assert avg.keys == ["", "b"]


@pytest.mark.parametrize("weight", [0.0, -1.0, math.inf, math.nan])
def test_the_averager_refuses_a_weight_that_is_not_finite_and_positive(weight: float) -> None:
    avg = StreamingAverager({"w": (1,)})
    with pytest.raises(ValueError, match=rf"^StreamingAverager\.add: weight for 'a' must be finite and > 0, got {weight}$"):
        avg.add("a", {"w": torch.ones(1)}, weight=weight)
    assert avg.keys == []


def test_the_averagers_refusals_name_the_contribution() -> None:
    avg = StreamingAverager({"w": (2,)})
    with pytest.raises(ValueError, match=r"^delta from 'a': parameter names differ \(missing \['w'\], unexpected \['v'\]\)$"):
        avg.add("a", {"v": torch.ones(2)})
    with pytest.raises(ValueError, match=r"^StreamingAverager\.add: 'a' sent w with shape \(3,\), expected \(2,\)$"):
        avg.add("a", {"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"^StreamingAverager\.result: no contributions were added$"):
        avg.result()
    with pytest.raises(ValueError, match=r"^average: no pseudo-gradients given$"):
        average({})


def test_weights_default_to_one_and_other_weights_scale() -> None:
    d1, d2 = torch.tensor([1.0, 0.1]), torch.tensor([3.0, 0.7])
    avg = StreamingAverager({"w": (2,)})
    avg.add("a", {"w": d1})
    avg.add("b", {"w": d2}, weight=3.0)
    assert torch.equal(avg.result()["w"], (d1 + d2 * 3.0) * torch.tensor(0.25))
    avg = StreamingAverager({"w": (2,)})
    avg.add("a", {"w": d1}, weight=2.0)
    avg.add("b", {"w": d2})
    assert torch.equal(avg.result()["w"], (d1 * 2.0 + d2) * torch.tensor(1 / 3, dtype=torch.float32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr must be finite and > 0, got 0.0"),
        ({"lr": -0.5}, "lr must be finite and > 0, got -0.5"),
        ({"lr": math.inf}, "lr must be finite and > 0, got inf"),
        ({"momentum": -0.1}, r"momentum must be in \[0, 1\), got -0.1"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
        ({"momentum": 1.5}, r"momentum must be in \[0, 1\), got 1.5"),
        ({"momentum": math.nan}, r"momentum must be in \[0, 1\), got nan"),
        ({"momentum": 0.0}, r"Nesterov needs momentum > 0 \(as in torch\.optim\.SGD\)"),
    ],
)
def test_the_outer_optimizer_refuses_bad_hyperparameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^OuterOptimizer: {message}$"):
        OuterOptimizer(**kwargs)


def test_without_momentum_the_outer_step_is_plain_sgd() -> None:
    opt = OuterOptimizer(lr=0.5, momentum=0.0, nesterov=False)
    params = {"w": torch.tensor([1.0, -2.0])}
    opt.step(params, {"w": torch.tensor([0.5, 4.0])})
    assert params["w"].tolist() == [0.75, -4.0] and opt.buffers == {} and opt.steps == 1


def test_bad_step_inputs_are_refused_with_what_is_wrong() -> None:
    opt = OuterOptimizer()
    params = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"^avg_delta: parameter names differ \(missing \['w'\], unexpected \[\]\)$"):
        opt.step(params, {})
    with pytest.raises(ValueError, match=r"^OuterOptimizer\.step: w must be fp32 with shape \(2,\) \(got torch\.float32, \(3,\)\)$"):
        opt.step(params, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"^OuterOptimizer\.step: w must be fp32 with shape \(2,\) \(got torch\.float64, \(2,\)\)$"):
        opt.step({"w": torch.zeros(2, dtype=torch.float64)}, {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"^OuterOptimizer\.step: the averaged pseudo-gradient of w has NaN or infinity$"):
        opt.step(params, {"w": torch.tensor([0.0, math.inf])})
    assert params["w"].tolist() == [0.0, 0.0] and opt.steps == 0


def test_a_finite_pseudo_gradient_whose_fp32_sum_would_overflow_is_stepped() -> None:
    # The finiteness check sums in fp64, where finite fp32 values cannot overflow: 2e38 + 2e38 is
    # infinite in fp32, but this update is finite and valid.
    opt = OuterOptimizer(lr=0.5, momentum=0.0, nesterov=False)
    params = {"w": torch.zeros(2)}
    opt.step(params, {"w": torch.full((2,), 2e38)})
    assert params["w"].tolist() == [-float(torch.tensor(2e38)) / 2] * 2 and opt.steps == 1


def test_a_models_parameters_are_stepped_in_place() -> None:
    layer = torch.nn.Linear(2, 1)
    params = dict(layer.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    OuterOptimizer(lr=1.0, momentum=0.5, nesterov=False).step(params, {n: torch.ones_like(p) for n, p in params.items()})
    assert all(torch.equal(params[n].detach(), before[n] - 1.0) for n in params)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr": 0.5}, r"saved lr=0\.5, this optimizer has 0\.7"),
        ({"momentum": 0.8}, r"saved momentum=0\.8, this optimizer has 0\.9"),
        ({"nesterov": False}, r"saved nesterov=False, this optimizer has True"),
        ({"momentum_buffer": [torch.zeros(2)]}, "momentum_buffer must map names to fp32 tensors"),
        ({"momentum_buffer": {"w": torch.zeros(2, dtype=torch.bfloat16)}}, "momentum_buffer must map names to fp32 tensors"),
        ({"momentum_buffer": {"w": [0.0, 0.0]}}, "momentum_buffer must map names to fp32 tensors"),
    ],
)
def test_a_state_of_another_optimizer_is_refused(change: dict, message: str) -> None:
    opt = OuterOptimizer()
    state = {**opt.state_dict(), "steps": 3, "momentum_buffer": {"w": torch.zeros(2)}, **change}
    with pytest.raises(ValueError, match=rf"^OuterOptimizer\.load_state_dict: {message}$"):
        opt.load_state_dict(state)
    assert opt.steps == 0 and opt.buffers == {}


def test_wider_inputs_are_rounded_to_fp32_first() -> None:
    """A float64 pseudo-gradient is rounded to fp32 before it is summed or stepped (one rounding each)."""
    g = torch.Generator().manual_seed(5)
    wide = {"w": torch.randn(32, generator=g, dtype=torch.float64) / 3}
    narrow = {"w": wide["w"].float()}
    sums = []
    for delta in (wide, narrow):
        avg = StreamingAverager({"w": (32,)})
        avg.add("a", {"w": torch.ones(32) / 3})
        avg.add("b", delta, weight=0.3)
        sums.append(avg.result()["w"])
    assert torch.equal(sums[0], sums[1])
    params = [{"w": torch.ones(32)}, {"w": torch.ones(32)}]
    opts = [OuterOptimizer(), OuterOptimizer()]
    for _ in range(2):
        opts[0].step(params[0], wide)
        opts[1].step(params[1], narrow)
    assert torch.equal(params[0]["w"], params[1]["w"]) and opts[0].buffers["w"].dtype == torch.float32


def _bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()  # bit patterns: tell -0 from +0


def test_fma32_fast_cpu_path_is_bit_identical_to_the_reference_on_random_and_edge_values() -> None:
    # The CPU path rounds a·b + c once in fp64 and recomputes only fp32 midpoints and subnormals; over
    # several blocks and threads, on values where that matters, it must give the reference's bits.
    g = torch.Generator().manual_seed(7)
    n = 3 * _BLOCK + 7
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    c = torch.randn(n, generator=g) * torch.exp2(torch.randint(-120, 120, (n,), generator=g).float())
    edges = [
        (1.0 + 2.0**-12, 1.0 + 2.0**-12, 2.0**-80),  # the fp64 sum lands on an fp32 tie it must not break
        (1.0 + 2.0**-12, 1.0 + 2.0**-12, -(2.0**-80)),
        (4097.0, 16773121.0, 2.0**60),
        (2.0**-24, 1.0, 1.0 + 2.0**-23),  # exact ties, to even
        # a·b = 2^-150 + 2^-186: the fp64 sum drops the 2^-186 onto a tie of fp32's subnormal grid
        (4097.0 * 2.0**-93, 16773121.0 * 2.0**-93, 2.0**-127), (-4097.0 * 2.0**-93, 16773121.0 * 2.0**-93, -(2.0**-127)),
        (1e-20, 1e-20, 0.0), (-1e-20, 1e-20, 1e-45), (1e-22, 3e-23, -1e-44),  # subnormal results
        (1e-45, 1.0, 1e-45), (-1e-45, 1.0, 0.0), (1.1e-38, -1.0, 2.3e-38),  # subnormal operands
        (0.0, 1.0, -0.0), (-0.0, 1.0, -0.0), (0.0, -1.0, 0.0), (-0.0, -0.0, -0.0),  # signed zeros
        (1e19, 1e19, 3e38), (-1.8e19, 1.8e19, 1e30), (3e38, 1.0, -3e38), (1e-30, 1e-8, 1e-38),
    ]
    for i, (x, y, z) in enumerate(edges):  # at block edges (where threads split) and in between
        for at in (i, _BLOCK - 1 - i, _BLOCK + i, 2 * _BLOCK + 3 * i, n - 1 - i):
            a[at], b[at], c[at] = x, y, z
    assert _bits(fma32(a, b, c)) == _bits(fma32_reference(a, b, c))
    for scalar in (0.9, -0.7, 1e-3, -1.5e-38, 0.0):
        assert _bits(fma32(a, scalar, c)) == _bits(fma32_reference(a, scalar, c)), scalar
    assert _bits(fma32(a[:5], b[:5], c[:5])) == _bits(fma32_reference(a[:5], b[:5], c[:5]))  # one block
    assert fma32(a[:0], b[:0], c[:0]).numel() == 0


def streamed_and_whole() -> tuple[StreamingAverager, StreamingAverager, dict[str, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    spec = {"a": (5, 3), "b": (7,)}
    deltas = {f"0x{i}": {n: torch.randn(s, generator=g) / 3.0 for n, s in spec.items()} for i in range(3)}
    return StreamingAverager(spec), StreamingAverager(spec), deltas


def test_parts_fed_in_any_order_sum_bit_for_bit_as_whole_updates() -> None:
    whole, streamed, deltas = streamed_and_whole()
    for i, key in enumerate(sorted(deltas)):
        whole.add(key, deltas[key], weight=0.1 + 0.2 * i)
        order = ["b", "a"] if i % 2 else ["a", "b"]
        streamed.add_parts(key, ((n, deltas[key][n]) for n in order), weight=0.1 + 0.2 * i)
    expected = whole.result()
    # the documented formula, written out: (Σ_i fp32(w_i)·Δ_i) · fp32(1 / Σ_i w_i), summed in key order
    weights = [torch.tensor(0.1 + 0.2 * i, dtype=torch.float32) for i in range(3)]
    inv = torch.tensor(1.0 / sum(float(w) for w in weights), dtype=torch.float32)
    for n in expected:
        total = torch.zeros_like(expected[n])
        for w, key in zip(weights, sorted(deltas), strict=True):
            total.add_(deltas[key][n] * w)
        assert torch.equal(total * inv, expected[n])
    assert streamed.keys == whole.keys
    took = streamed.take_result()
    assert all(torch.equal(took[n], expected[n]) for n in expected)
    with pytest.raises(ValueError, match=r"^StreamingAverager\.result: take_result\(\) already spent this averager$"):
        streamed.result()
    with pytest.raises(ValueError, match=r"^StreamingAverager\.add: take_result\(\) already spent this averager$"):
        streamed.add_parts("0x9", iter([]))


def test_take_result_is_the_mean_in_the_sums_memory() -> None:
    avg = StreamingAverager({"w": (3,)})
    avg.add("a", {"w": torch.tensor([1.0, 2.0, 4.0])})
    avg.add("b", {"w": torch.tensor([3.0, 2.0, 1.0])})
    held = avg._sum["w"]
    mean = avg.take_result()["w"]
    assert mean.tolist() == [2.0, 2.0, 2.5] and mean.data_ptr() == held.data_ptr()


@pytest.mark.parametrize(
    ("parts", "why"),
    [
        ([("a", torch.zeros(5, 3)), ("a", torch.zeros(5, 3))], r"^StreamingAverager\.add_parts: 'k' sent 'a' twice$"),
        ([("c", torch.zeros(1))], r"^StreamingAverager\.add_parts: 'k' sent 'c' which the model does not have$"),
        ([("b", torch.zeros(8))], r"^StreamingAverager\.add: 'k' sent b with shape \(8,\), expected \(7,\)$"),
        ([("a", torch.zeros(5, 3))], r"^delta from 'k': parameter names differ \(missing \['b'\], unexpected \[\]\)$"),
    ],
)
def test_a_stream_of_parts_is_refused_at_the_first_part_out_of_place(
    parts: list[tuple[str, torch.Tensor]], why: str
) -> None:
    avg = StreamingAverager({"a": (5, 3), "b": (7,)})
    with pytest.raises(ValueError, match=why):
        avg.add_parts("k", iter(parts))
    assert avg.keys == []
