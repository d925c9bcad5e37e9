"""The dissent check: updates that point away from the other hosts' median are excluded at close."""

from __future__ import annotations

import torch

from gonka_node.aggregator.checks import find_dissenters
from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import count_sketch

SPEC = {"w": (64, 48), "b": (200,)}


def row(host: bytes, update: dict[str, torch.Tensor]) -> SubmissionRow:
    sketch = count_sketch(update).numpy().tobytes()
    return SubmissionRow(1, 1, host, b"\0" * 32, 0, 0, 0, b"", 0, 1.0, sketch, "")


def honest_updates(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A shared direction plus each host's own part: pairwise cosine ≈ 0.5, like measured DiLoCo deltas."""
    gen = torch.Generator().manual_seed(seed)
    common = {k: torch.randn(s, generator=gen) for k, s in SPEC.items()}
    return [{k: common[k] + torch.randn(s, generator=gen) for k, s in SPEC.items()} for _ in range(n)]


def test_sign_flip_and_noise_dissent_honest_hosts_do_not() -> None:
    *honest, victim = honest_updates(4)
    gen = torch.Generator().manual_seed(9)
    flip = {k: -t for k, t in victim.items()}  # the sign-flip of an honest host's update
    noise = {k: torch.randn(s, generator=gen) * 1.4 for k, s in SPEC.items()}
    rows = [row(bytes([i]) * 20, u) for i, u in enumerate(honest)]
    rows += [row(b"F" * 20, flip), row(b"N" * 20, noise)]
    out = find_dissenters(rows, excluded=set(), fraction=0.25)
    assert set(out) == {b"F" * 20, b"N" * 20}
    assert "dissent" in out[b"F" * 20] and "-0." in out[b"F" * 20]  # a negative cosine is reported


def test_needs_four_hosts_and_skips_excluded_ones() -> None:
    a, b, c = honest_updates(3)
    flip = {k: -t for k, t in a.items()}
    rows = [row(b"A" * 20, a), row(b"B" * 20, b), row(b"C" * 20, c), row(b"F" * 20, flip)]
    # With C already excluded (say, as a copy) only three remain: too few to judge anyone.
    assert find_dissenters(rows, excluded={b"C" * 20}, fraction=0.25) == {}
    assert find_dissenters(rows, excluded=set(), fraction=0.0) == {}  # switched off
    assert set(find_dissenters(rows, excluded=set(), fraction=0.25)) == {b"F" * 20}
