"""The model-free checks on count sketches (gonka_node/aggregator/checks.py): span residuals and the
mixture check, which judge in header-arrival order against public tensors and earlier submissions."""

from __future__ import annotations

import torch

from gonka_node.aggregator.checks import find_mixtures, span_residuals
from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import SKETCH_BUCKETS


def sub(host: bytes, sketch: torch.Tensor, started_ms: int) -> SubmissionRow:
    return SubmissionRow(1, 1, host, b"\0" * 32, 0, 0, 0, b"", started_ms + 5, 1.0,
                         sketch.float().numpy().tobytes(), "", started_ms)


def honest_like(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Updates that share a common direction (cosine ~0.5 between them), each with its own part."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(SKETCH_BUCKETS, generator=g)
    return [common + torch.randn(SKETCH_BUCKETS, generator=g) for _ in range(n)]


def test_span_residuals_measure_what_each_vector_adds_to_those_before_it() -> None:
    a, b = torch.zeros(8), torch.zeros(8)
    a[0], b[1] = 3.0, 2.0
    mix = 0.25 * a + 4.0 * b
    got = span_residuals([a, b, mix, torch.zeros(8), a + 1e-3 * torch.ones(8)])
    assert got[0] == 1.0 and got[1] == 1.0  # nothing before a; b orthogonal to a
    assert got[2] < 1e-12  # a combination of a and b
    assert got[3] == 0.0  # a zero vector adds nothing
    assert abs(got[4] - (1e-3 * 6**0.5) / float((a + 1e-3 * torch.ones(8)).norm())) < 1e-9
    # A dependent vector adds no direction: a later vector is judged against the span of a and b only.
    c = torch.zeros(8)
    c[2] = 1.0
    assert span_residuals([a, b, mix, c])[3] == 1.0


def test_a_mix_of_earlier_updates_is_flagged_and_its_sources_are_not() -> None:
    a, b, c = honest_like(3)
    rows = [sub(b"A" * 20, a, 1), sub(b"B" * 20, b, 2), sub(b"C" * 20, c, 3),
            sub(b"M" * 20, 0.5 * a + 0.5 * b + 1e-3 * c, 4)]
    found = find_mixtures(rows, [], 0.05)
    assert list(found) == [b"M" * 20] and "a combination of others' work" in found[b"M" * 20]
    # Arrival order decides who mixed whom: had the mix's header come first, B (= 2M − A) is the one
    # inside the span of what arrived before it. A mixer cannot arrive first without its sources.
    early = [sub(b"M" * 20, 0.5 * a + 0.5 * b, 0), *rows[:3]]
    assert list(find_mixtures(early, [], 0.05)) == [b"B" * 20]


def test_reusing_public_tensors_and_sending_nothing_are_flagged() -> None:
    a, b = honest_like(2, seed=1)
    aggregate = torch.randn(SKETCH_BUCKETS, generator=torch.Generator().manual_seed(9))
    rows = [sub(b"A" * 20, a, 1), sub(b"R" * 20, 0.97 * aggregate + 0.01 * b, 2),
            sub(b"Z" * 20, torch.zeros(SKETCH_BUCKETS), 3)]
    found = find_mixtures(rows, [("round 4's aggregate", aggregate)], 0.05)
    assert set(found) == {b"R" * 20, b"Z" * 20}
    assert "outside the span of public tensors (round 4's aggregate)" in found[b"R" * 20]
    assert found[b"Z" * 20] == "mix: a zero update: no training of its own"


def test_honest_updates_keep_their_own_part_far_above_the_bar() -> None:
    """64 hosts whose updates share one direction: each still adds a residual of ~0.7 (its own half,
    less what 63 random vectors in 4096 dimensions happen to span), 14× the 0.05 bar."""
    ups = honest_like(64, seed=2)
    rows = [sub(bytes([i]) * 20, u, i) for i, u in enumerate(ups)]
    assert find_mixtures(rows, [("the base model", torch.randn(SKETCH_BUCKETS))], 0.05) == {}
    residuals = span_residuals(ups)[1:]
    assert 0.85 < residuals[0] < 0.88  # the second host against the first: √(1 − 0.5²)
    assert 0.65 < residuals[-1] < 0.75 and min(residuals) > 0.65  # √(½ (1 − 63/4096)) ≈ 0.70 at the end
