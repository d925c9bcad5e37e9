"""The replay verdict at its edges: direction and length are both required, each bound inclusive.

A host that sends its honest update scaled by 2 points exactly where the replay does (cosine 1) and must
still fail on length; the end-to-end replay runs (test_adversary.py) are too slow for a quick run.
"""

from __future__ import annotations

import pytest

from gonka_node.aggregator.replay import MISMATCH, verdict

MIN_COS, TOL = 0.875, 0.25  # binary fractions: 1 ± 0.25 and the cosine bar are exact in floating point


def test_an_update_of_the_replays_direction_and_twice_its_length_fails() -> None:
    passed, why = verdict(4, 2, 1.0, 2.0, MIN_COS, TOL)
    assert not passed
    assert why == (
        f"{MISMATCH}: cosine +1.0000, norm ratio 2.0000 with the replay of slot 2's round 4 from the round's "
        "base (needs cosine ≥ 0.875 and norm ratio within 1 ± 0.25): not the training of its assignment "
        "that the recipe prescribes"
    )


def test_the_replay_itself_passes_with_its_measures_in_the_reason() -> None:
    assert verdict(4, 2, 0.99993, 1.00002, MIN_COS, TOL) == (
        True, "replay: cosine +0.9999, norm ratio 1.0000 with the replay of slot 2's round 4"
    )


@pytest.mark.parametrize(
    ("cos", "ratio", "passed"),
    [
        (MIN_COS, 1.0, True),  # the cosine bar is inclusive
        (1.0, 1.0 + TOL, True),  # so are both ends of the length band
        (1.0, 1.0 - TOL, True),
        (0.8749999, 1.0, False),
        (1.0, 1.2500001, False),
        (1.0, 0.7499999, False),
        (1.0, 0.0, False),  # a zero update
        (-1.0, 1.0, False),  # reversed
        (1.0, float("inf"), False),  # the replay came out zero
    ],
)
def test_bounds(cos: float, ratio: float, passed: bool) -> None:
    assert verdict(1, 0, cos, ratio, MIN_COS, TOL)[0] is passed
