"""Checks on the round's updates that need no model, only their count sketches (validate.count_sketch).

A count sketch is linear: the sketch of a weighted sum of updates is the same weighted sum of their
sketches (up to the codec's rounding), and inner products are preserved in expectation. So whether an
update is another's copy, a mixture of others, a reuse of public tensors, or points away from the
round's consensus can be decided from 4096 numbers per host, without holding any update in memory.

Each check returns `{host: reason}` for the hosts it excludes; reasons are what the host is told in
`GetRoundResult` and what `gonka_node.slashing` reads back (keep their prefixes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import cosine

Labelled = tuple[str, Tensor]  # (what a public tensor is, its sketch)
DEPENDENT = 1e-9  # a residual below this adds no direction to the basis (exactly dependent)
SCREEN_MARGIN = 1e-3  # fp32 screens keep every pair within this of a cosine bar (their error ≤ 2.4e-4)
SCREEN_ROWS = 512  # rows of a screening block: its products hold 512 × n floats
SPAN_BLOCK = 64  # vectors projected off the span at once: one matrix product instead of 64 matrix-vector ones
MEDIAN_COLUMNS = 512  # sketch coordinates sorted at once by the dissent check (n × 512 values)


def sketch_of(s: SubmissionRow) -> Tensor:
    return torch.frombuffer(bytearray(s.sketch), dtype=torch.float32)


def arrival_order(subs: Sequence[SubmissionRow]) -> list[SubmissionRow]:
    """Submissions in the order their signed headers arrived (then completion, then address): the
    header commits to the payload's digest before any payload byte is sent, so a host that copies what
    it saw of another's upload always comes later in this order, however fast its own stream is."""
    return sorted(subs, key=lambda s: (s.started_ms, s.received_ms, s.host))


def find_copies(subs: Sequence[SubmissionRow], threshold: float) -> dict[bytes, str]:
    """Hosts whose update's sketch is within `threshold` cosine of an earlier-arrived one's (the first
    such host that is not itself a copy).

    All pairs, by necessity: no exact sub-quadratic search exists for an inner-product threshold in
    4,096 dimensions (hashing schemes miss pairs with some probability, which a copier would play).
    So the pairs are screened as blocks of one fp32 matrix product of unit sketches (BLAS: ~2·n²·4096
    flops, 0.3 s at 1,000 hosts here) with a margin far above fp32's error on unit vectors (≤ 4096 ×
    2^-24 ≈ 2.4e-4), and only the candidates are decided by the exact fp64 `cosine`, in arrival
    order, as a pair-by-pair loop would decide them."""
    order = arrival_order(subs)
    sketches = [sketch_of(s) for s in order]
    copies: dict[bytes, str] = {}
    for i, j in _screened_pairs(sketches, threshold - SCREEN_MARGIN):
        later, earlier = order[i], order[j]
        if later.host in copies or earlier.host in copies:
            continue
        c = cosine(sketches[i], sketches[j])
        if c >= threshold:
            copies[later.host] = (
                f"copy: sketch cosine {c:.4f} with 0x{earlier.host.hex()}, whose header arrived earlier"
            )
    return copies


def _screened_pairs(sketches: Sequence[Tensor], bar: float) -> Iterator[tuple[int, int]]:
    """(i, j), j < i, whose fp32 cosine is at least `bar`: for each i in order, its js in order."""
    if len(sketches) < 2:
        return
    unit = _unit_rows(torch.stack(list(sketches))).float()
    for start in range(0, len(sketches), SCREEN_ROWS):
        block = unit[start : start + SCREEN_ROWS] @ unit[: start + SCREEN_ROWS].T
        for row, i in enumerate(range(start, min(len(sketches), start + SCREEN_ROWS))):
            for j in torch.nonzero(block[row, :i] >= bar).flatten().tolist():
                yield i, j


def _unit_rows(m: Tensor) -> Tensor:
    m = m.double()
    return m / m.norm(dim=1, keepdim=True).clamp_min(1e-300)


def find_resubmissions(
    subs: Sequence[SubmissionRow], earlier: Sequence[SubmissionRow], threshold: float
) -> dict[bytes, str]:
    """Hosts whose update's sketch is within `threshold` cosine of a submission of an *earlier round*
    (their own — a stale resubmission — or anyone's): old work, which the round's base has moved past.

    n new × m earlier pairs (m grows with the epoch's rounds): screened in blocks by one fp32 matrix
    product, and a host is decided by the exact fp64 products only when its screen comes near the bar."""
    if not earlier or not subs:
        return {}
    old = _unit_rows(torch.stack([sketch_of(s) for s in earlier]))
    old32 = old.float()
    found: dict[bytes, str] = {}
    for start in range(0, len(subs), SCREEN_ROWS):
        block = list(subs[start : start + SCREEN_ROWS])
        screen = (_unit_rows(torch.stack([sketch_of(s) for s in block])).float() @ old32.T).amax(dim=1)
        for s, near in zip(block, screen.tolist(), strict=True):
            if near >= threshold - SCREEN_MARGIN:
                found.update(_resubmission(s, earlier, old, threshold))
    return found


def _resubmission(
    s: SubmissionRow, earlier: Sequence[SubmissionRow], old: Tensor, threshold: float
) -> dict[bytes, str]:
    new = sketch_of(s).double()
    if float(new.norm()) == 0.0:
        return {}
    sims = old @ (new / new.norm())
    best = int(sims.argmax())
    if float(sims[best]) < threshold:
        return {}
    src = earlier[best]
    whose = "its own" if src.host == s.host else f"0x{src.host.hex()}'s"
    return {
        s.host: f"copy: sketch cosine {float(sims[best]):.4f} with 0x{src.host.hex()}, round {src.round} "
        f"({whose} earlier submission): stale work, the base has moved on"
    }


def span_residuals(vectors: Sequence[Tensor]) -> list[float]:
    """For each vector in order, its distance to the span of the vectors before it, relative to its own
    length (1: orthogonal to all of them; 0: a linear combination of them; 0 for a zero vector).

    Gram–Schmidt with one re-orthogonalisation (numerically a QR without its pitfall: a dependent
    vector adds no arbitrary direction to the basis, so later residuals are measured against exactly
    the span of the earlier vectors), by blocks: each block of SPAN_BLOCK vectors is projected off the
    basis so far by two matrix products, then off its own earlier members one by one. The same
    residuals as vector by vector (to ~1e-12), at matrix-product speed. Per vector the work is
    O(4096 · min(n, 4096)): it stops growing once the basis fills the sketch's 4,096 dimensions
    (from then on every vector lies in the span: the check needs fewer hosts than sketch buckets)."""
    if not vectors:
        return []
    dim = vectors[0].numel()
    span = _Span(dim, min(len(vectors), dim))
    out: list[float] = []
    for start in range(0, len(vectors), SPAN_BLOCK):
        out += span.extend(torch.stack([v.double().flatten() for v in vectors[start : start + SPAN_BLOCK]], dim=1))
    return out


class _Span:
    """An orthonormal basis grown one direction per independent vector (rows `rows[:k]`: contiguous,
    so the products below read it in place)."""

    def __init__(self, dim: int, capacity: int) -> None:
        self.rows = torch.zeros(capacity, dim, dtype=torch.float64)
        self.k = 0

    def project_out(self, x: Tensor, first: int = 0) -> Tensor:
        """x (a vector or columns) minus its part in basis directions [first, k), twice."""
        q = self.rows[first : self.k]
        for _ in range(2):
            x = x - q.T @ (q @ x)
        return x

    def extend(self, block: Tensor) -> list[float]:
        """Residuals of the block's columns in order, each against the basis and the columns before it;
        the independent ones join the basis."""
        lengths = block.norm(dim=0).tolist()
        rest = self.project_out(block)
        first, out = self.k, []
        for j, length in enumerate(lengths):
            if length == 0.0:
                out.append(0.0)
                continue
            r = self.project_out(rest[:, j], first)
            residual = float(r.norm()) / length
            out.append(residual)
            if residual > DEPENDENT and self.k < self.rows.shape[0]:
                self.rows[self.k] = r / r.norm()
                self.k += 1
        return out


def mixture_residuals(
    subs: Sequence[SubmissionRow], public: Sequence[Labelled]
) -> dict[bytes, tuple[float, float]]:
    """host → (relative residual of its sketch against the public tensors and the submissions whose
    headers arrived before it, against the public tensors alone)."""
    order = arrival_order(subs)
    public_sketches = [t for _, t in public]
    mine = [sketch_of(s) for s in order]
    against_all = span_residuals(public_sketches + mine)[len(public_sketches):]
    against_public = _public_residuals(public_sketches, mine) if public else [1.0] * len(mine)
    return {s.host: (whole, pub) for s, whole, pub in zip(order, against_all, against_public, strict=True)}


def _public_residuals(public: Sequence[Tensor], mine: Sequence[Tensor]) -> list[float]:
    """Each vector's residual against the public span alone: one basis, all vectors projected at once."""
    if not mine:
        return []
    span = _Span(public[0].numel(), min(len(public), public[0].numel()))
    span.extend(torch.stack([p.double().flatten() for p in public], dim=1))
    out: list[float] = []
    for start in range(0, len(mine), SPAN_BLOCK):
        block = torch.stack([m.double().flatten() for m in mine[start : start + SPAN_BLOCK]], dim=1)
        lengths = block.norm(dim=0)
        residual = span.project_out(block).norm(dim=0) / lengths.clamp_min(1e-300)
        out += [0.0 if length == 0.0 else r for length, r in zip(lengths.tolist(), residual.tolist(), strict=True)]
    return out


def find_mixtures(
    subs: Sequence[SubmissionRow], public: Sequence[Labelled], bar: float,
    residuals: Mapping[bytes, tuple[float, float]] | None = None,
) -> dict[bytes, str]:
    """Updates that bring no direction of their own: within `bar` (relative residual) of the span of the
    public tensors (the round's base model, earlier rounds' aggregated updates) and the submissions whose
    headers arrived before theirs. That covers a resubmitted aggregate, the base model sent as an
    update, a zero update, and any weighted mix of other hosts' updates (which the copy check misses:
    a 50/50 mix has cosine ~0.9 with each source). Honest updates of one round share a direction but
    each carries its own data's part, far above the bar (docs/benchmarks.md); arrival order decides who
    mixed whom: the sources came first. `residuals`: `mixture_residuals(subs, public)`, if at hand."""
    found: dict[bytes, str] = {}
    names = ", ".join(label for label, _ in public) or "none"
    residuals = mixture_residuals(subs, public) if residuals is None else residuals
    for s in arrival_order(subs):
        whole, pub = residuals[s.host]
        if float(sketch_of(s).norm()) == 0.0:
            found[s.host] = "mix: a zero update: no training of its own"
        elif pub <= bar:
            found[s.host] = (
                f"mix: sketch residual {pub:.4f} outside the span of public tensors ({names}), at or below "
                f"{bar:g}: a reuse of what everyone holds, no training of its own"
            )
        elif whole <= bar:
            found[s.host] = (
                f"mix: sketch residual {whole:.4f} outside the span of the earlier-arrived submissions and "
                f"public tensors, at or below {bar:g}: a combination of others' work"
            )
    return found


def find_dissenters(
    subs: Sequence[SubmissionRow], excluded: set[bytes], fraction: float
) -> dict[bytes, str]:
    """Hosts whose update points away from the round's consensus.

    Each remaining host's sketch is compared with the coordinate-wise median of the *other* remaining
    hosts' sketches (robust to a minority of attackers among them). Honest DiLoCo pseudo-gradients of
    one round agree (measured on the devnet model: leave-one-out cosine 0.4–0.77 over four rounds),
    while a sign-flipped update scores about −0.6 and matched-norm noise about 0. A host is excluded when
    its cosine is at or below `fraction` × the median cosine of all remaining hosts (and at or below 0
    whatever the median). Needs at least four remaining hosts, so that each host's reference is a
    median over three or more others (with two, one attacker drags an honest host's reference away).
    """
    live = [s for s in subs if s.host not in excluded]
    if len(live) < 4 or fraction <= 0:
        return {}
    sketches = torch.stack([sketch_of(s) for s in live])
    references = leave_one_out_medians(sketches)
    agreement = {s.host: cosine(sketches[i], references[i]) for i, s in enumerate(live)}
    typical = float(torch.tensor(list(agreement.values())).median())
    bar = max(0.0, fraction * typical)
    return {
        host: f"dissent: sketch cosine {c:+.3f} with the other hosts' median update, at or below {bar:.3f} "
        f"({fraction:g} × the round's median agreement {typical:+.3f})"
        for host, c in agreement.items()
        if c <= bar
    }


def leave_one_out_medians(rows: Tensor) -> Tensor:
    """Row i: the coordinate-wise median of every row but i, as `torch.median(dim=0)` gives it (the
    lower middle value when the count is even), value for value. One sort per column instead of a
    median per row: removing row i from a sorted column shifts the middle by at most one place, so
    the median of the others is the middle-rank value, or the next one if row i sat at or below it
    (O(n log n) per coordinate, not O(n²)). Columns in blocks of MEDIAN_COLUMNS bound the memory."""
    n = rows.shape[0]
    k = (n - 2) // 2  # the lower median's rank among n - 1 values
    out = torch.empty_like(rows)
    ranks = torch.arange(n).unsqueeze(1)
    for start in range(0, rows.shape[1], MEDIAN_COLUMNS):
        values, order = rows[:, start : start + MEDIAN_COLUMNS].sort(dim=0)
        rank = torch.empty_like(order).scatter_(0, order, ranks.expand_as(order))
        out[:, start : start + MEDIAN_COLUMNS] = torch.where(rank > k, values[k], values[k + 1])
    return out
