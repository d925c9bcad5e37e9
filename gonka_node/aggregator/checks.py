"""Checks on the round's updates that need no model, only their count sketches (validate.count_sketch).

A count sketch is linear: the sketch of a weighted sum of updates is the same weighted sum of their
sketches (up to the codec's rounding), and inner products are preserved in expectation. So whether an
update is another's copy, a mixture of others, a reuse of public tensors, or points away from the
round's consensus can be decided from 4096 numbers per host, without holding any update in memory.

Each check returns `{host: reason}` for the hosts it excludes; reasons are what the host is told in
`GetRoundResult` and what `gonka_node.slashing` reads back (keep their prefixes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import cosine

Labelled = tuple[str, Tensor]  # (what a public tensor is, its sketch)
DEPENDENT = 1e-9  # a residual below this adds no direction to the basis (exactly dependent)


def sketch_of(s: SubmissionRow) -> Tensor:
    return torch.frombuffer(bytearray(s.sketch), dtype=torch.float32)


def arrival_order(subs: Sequence[SubmissionRow]) -> list[SubmissionRow]:
    """Submissions in the order their signed headers arrived (then completion, then address): the
    header commits to the payload's digest before any payload byte is sent, so a host that copies what
    it saw of another's upload always comes later in this order, however fast its own stream is."""
    return sorted(subs, key=lambda s: (s.started_ms, s.received_ms, s.host))


def find_copies(subs: Sequence[SubmissionRow], threshold: float) -> dict[bytes, str]:
    """Hosts whose update's sketch is within `threshold` cosine of an earlier-arrived one's."""
    order = arrival_order(subs)
    sketches = {s.host: sketch_of(s) for s in subs}
    copies: dict[bytes, str] = {}
    for i, later in enumerate(order):
        for earlier in order[:i]:
            if earlier.host in copies:
                continue
            c = cosine(sketches[later.host], sketches[earlier.host])
            if c >= threshold:
                copies[later.host] = (
                    f"copy: sketch cosine {c:.4f} with 0x{earlier.host.hex()}, whose header arrived earlier"
                )
                break
    return copies


def find_resubmissions(
    subs: Sequence[SubmissionRow], earlier: Sequence[SubmissionRow], threshold: float
) -> dict[bytes, str]:
    """Hosts whose update's sketch is within `threshold` cosine of a submission of an *earlier round*
    (their own — a stale resubmission — or anyone's): old work, which the round's base has moved past."""
    if not earlier or not subs:
        return {}
    old = torch.stack([sketch_of(s) for s in earlier]).double()
    old = old / old.norm(dim=1, keepdim=True).clamp_min(1e-300)
    found: dict[bytes, str] = {}
    for s in subs:
        new = sketch_of(s).double()
        if float(new.norm()) == 0.0:
            continue
        sims = old @ (new / new.norm())
        best = int(sims.argmax())
        if float(sims[best]) >= threshold:
            src = earlier[best]
            whose = "its own" if src.host == s.host else f"0x{src.host.hex()}'s"
            found[s.host] = (
                f"copy: sketch cosine {float(sims[best]):.4f} with 0x{src.host.hex()}, round {src.round} "
                f"({whose} earlier submission): stale work, the base has moved on"
            )
    return found


def span_residuals(vectors: Sequence[Tensor]) -> list[float]:
    """For each vector in order, its distance to the span of the vectors before it, relative to its own
    length (1: orthogonal to all of them; 0: a linear combination of them; 0 for a zero vector).

    Gram–Schmidt with one re-orthogonalisation (numerically a QR without its pitfall: a dependent
    vector adds no arbitrary direction to the basis, so later residuals are measured against exactly
    the span of the earlier vectors)."""
    if not vectors:
        return []
    dim = vectors[0].numel()
    basis = torch.zeros(dim, min(len(vectors), dim), dtype=torch.float64)
    k = 0
    out = []
    for v in vectors:
        x = v.double().flatten()
        length = float(x.norm())
        if length == 0.0:
            out.append(0.0)
            continue
        r = x.clone()
        for _ in range(2):
            q = basis[:, :k]
            r -= q @ (q.T @ r)
        residual = float(r.norm()) / length
        out.append(residual)
        if residual > DEPENDENT and k < basis.shape[1]:
            basis[:, k] = r / r.norm()
            k += 1
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
    against_public = [span_residuals([*public_sketches, m])[-1] for m in mine] if public else [1.0] * len(mine)
    return {s.host: (whole, pub) for s, whole, pub in zip(order, against_all, against_public, strict=True)}


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
    sketches = {s.host: sketch_of(s) for s in live}
    agreement: dict[bytes, float] = {}
    for s in live:
        others = torch.stack([sketches[o.host] for o in live if o.host != s.host])
        agreement[s.host] = cosine(sketches[s.host], others.median(dim=0).values)
    typical = float(torch.tensor(list(agreement.values())).median())
    bar = max(0.0, fraction * typical)
    return {
        host: f"dissent: sketch cosine {c:+.3f} with the other hosts' median update, at or below {bar:.3f} "
        f"({fraction:g} × the round's median agreement {typical:+.3f})"
        for host, c in agreement.items()
        if c <= bar
    }
