"""The sketch checks at scale (matrix products, one sort per coordinate) decide exactly as the
pair-by-pair and host-by-host loops they replaced, which are kept here as the reference."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from gonka_node.aggregator import checks
from gonka_node.aggregator.checks import (
    arrival_order,
    find_copies,
    find_dissenters,
    find_resubmissions,
    leave_one_out_medians,
    mixture_residuals,
    sketch_of,
    span_residuals,
)
from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import cosine


def row(i: int, sketch: Tensor, round_: int = 1, started: int | None = None) -> SubmissionRow:
    return SubmissionRow(1, round_, i.to_bytes(20, "big"), b"", 0, 0, 0, b"", 1000 + i, 1.0,
                         sketch.float().numpy().tobytes(), "", started_ms=i if started is None else started)  # fmt: skip


def round_of(n: int, seed: int = 0, round_: int = 1) -> list[SubmissionRow]:
    """Honest-looking sketches (a shared direction plus noise) with near-copies, mixtures of the two
    previous hosts, sign flips and a zero update mixed in; arrival order differs from host order."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(4096, generator=gen)
    out: list[Tensor] = []
    for i in range(n):
        noise = torch.randn(4096, generator=gen)
        kind = i % 7 if i > 5 else 0
        if i == 9:
            out.append(torch.zeros(4096))
        elif kind == 3:  # a near-copy of the host three before
            out.append(out[i - 3] * 1.0001 + noise * 1e-3)
        elif kind == 5:  # a mixture of the two hosts before
            out.append(0.5 * out[i - 1] + 0.5 * out[i - 2])
        elif kind == 6:  # a sign flip
            out.append(-(shared + noise))
        else:
            out.append(shared + noise)
    return [row(i, t, round_, started=(i * 7919) % n) for i, t in enumerate(out)]


def naive_copies(subs: Sequence[SubmissionRow], threshold: float) -> dict[bytes, str]:
    order = arrival_order(subs)
    sketch = {s.host: sketch_of(s) for s in subs}
    found: dict[bytes, str] = {}
    for i, later in enumerate(order):
        for earlier in order[:i]:
            if earlier.host in found:
                continue
            c = cosine(sketch[later.host], sketch[earlier.host])
            if c >= threshold:
                found[later.host] = f"copy: sketch cosine {c:.4f} with 0x{earlier.host.hex()}, whose header arrived earlier"
                break
    return found


def naive_medians(rows: Tensor) -> Tensor:
    idx = range(rows.shape[0])
    return torch.stack([rows[[j for j in idx if j != i]].median(dim=0).values for i in idx])


def naive_residuals(vectors: Sequence[Tensor]) -> list[float]:
    """Vector-by-vector Gram–Schmidt with one re-orthogonalisation: the check's definition."""
    basis: list[Tensor] = []
    out = []
    for v in vectors:
        x = v.double()
        if float(x.norm()) == 0.0:
            out.append(0.0)
            continue
        r = x.clone()
        for _ in range(2):
            if basis:
                q = torch.stack(basis)
                r -= q.T @ (q @ r)
        out.append(float(r.norm()) / float(x.norm()))
        if out[-1] > checks.DEPENDENT:
            basis.append(r / r.norm())
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 40])
def test_copies_as_the_pairwise_loop(n: int) -> None:
    subs = round_of(n)
    assert find_copies(subs, 0.99) == naive_copies(subs, 0.99)


def test_copies_found_and_a_copy_of_a_copy_names_the_original() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    subs = [row(0, a), row(1, b), row(2, a * 2), row(3, a * 3)]
    found = find_copies(subs, 0.99)
    assert sorted(found) == [(2).to_bytes(20, "big"), (3).to_bytes(20, "big")]
    assert f"with 0x{(0).to_bytes(20, 'big').hex()}" in found[(3).to_bytes(20, "big")]  # not host 2, a copy


def test_screen_margin_keeps_pairs_at_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair exactly at the threshold is still found (the fp32 screen must not drop it)."""
    gen = torch.Generator().manual_seed(4)
    a, noise = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    b = a + noise * 0.05
    subs = [row(0, a), row(1, b)]
    c = cosine(sketch_of(subs[1]), sketch_of(subs[0]))
    assert set(find_copies(subs, c)) == {(1).to_bytes(20, "big")}
    monkeypatch.setattr(checks, "SCREEN_MARGIN", -1e-3)  # a screen without margin would lose it
    assert find_copies(subs, c) == {} or c >= 1.0  # shows the margin is what keeps the pair


def test_resubmissions_as_the_host_by_host_loop() -> None:
    earlier = round_of(30, seed=1, round_=0)
    subs = round_of(30, seed=2)
    subs[4] = row(4, sketch_of(earlier[7]) * 1.5)  # someone's old work
    subs[8] = row(8, sketch_of(earlier[8]))  # its own old work
    found = find_resubmissions(subs, earlier, 0.99)
    assert set(found) == {(4).to_bytes(20, "big"), (8).to_bytes(20, "big")}
    assert "its own earlier submission" in found[(8).to_bytes(20, "big")]


@pytest.mark.parametrize("n", [4, 5, 9, 30])
def test_leave_one_out_medians_equal_torch_median_of_the_others(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    rows = torch.randn(n, 700, generator=gen)
    rows[:, :50] = torch.randint(0, 3, (n, 50), generator=gen).float()  # ties
    assert torch.equal(leave_one_out_medians(rows), naive_medians(rows))


def test_dissenters_found_as_before() -> None:
    subs = round_of(40)
    live = [s for s in subs]
    sketches = torch.stack([sketch_of(s) for s in live])
    medians = naive_medians(sketches)
    flips = {s.host for i, s in enumerate(live) if cosine(sketches[i], medians[i]) <= 0}
    found = find_dissenters(subs, set(), 0.25)
    assert flips and flips <= set(found)
    assert all(int.from_bytes(h, "big") % 7 == 6 or int.from_bytes(h, "big") == 9 for h in found)


def test_span_residuals_equal_the_vector_by_vector_definition() -> None:
    subs = round_of(70)
    vectors = [sketch_of(s) for s in arrival_order(subs)]
    got, want = span_residuals(vectors), naive_residuals(vectors)
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-9
    assert min(got) == 0.0 and sum(1 for g in got if g < 0.05) >= 9  # the zero update and the mixtures


def test_public_residuals_as_one_span_per_host() -> None:
    subs = round_of(20)
    gen = torch.Generator().manual_seed(5)
    public = [("base", torch.randn(4096, generator=gen)), ("reuse", sketch_of(subs[2]) * 2.0)]
    got = mixture_residuals(subs, public)
    for s in subs:
        want = naive_residuals([t for _, t in public] + [sketch_of(s)])[-1]
        assert abs(got[s.host][1] - want) < 1e-9
    assert got[subs[2].host][1] < 1e-9  # host 2 sent what is public
