"""A host outlives an aggregator outage while it follows the chain (it used to exit with a traceback)."""

from __future__ import annotations

import grpc
import pytest

from gonka_node.host.settings import patiently


class Refused(grpc.RpcError):
    """What a grpc call raises: an RpcError carrying a status code (grpc's own class needs a live call)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def test_waits_through_an_outage_with_capped_backoff_and_says_so_once() -> None:
    answers = [Refused(grpc.StatusCode.UNAVAILABLE)] * 7 + [Refused(grpc.StatusCode.DEADLINE_EXCEEDED), b"update"]
    slept: list[float] = []
    notes: list[str] = []

    def call() -> bytes:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    got = patiently(call, "aggregator 127.0.0.1:1", "round 3's update", slept.append, notes.append, 0.5, 4.0)
    assert got == b"update"
    assert slept == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]  # doubling, capped, never giving up
    assert notes == [
        "aggregator 127.0.0.1:1 unreachable (UNAVAILABLE) while fetching round 3's update; "
        "waiting for it to come back"
    ]


def test_repeats_the_note_every_five_minutes_of_waiting() -> None:
    failures = iter(range(30))
    notes: list[str] = []

    def call() -> int:
        if next(failures) < 29:
            raise Refused(grpc.StatusCode.UNAVAILABLE)
        return 1

    patiently(call, "agg", "x", lambda s: None, notes.append, 30.0, 30.0)
    assert len(notes) == 3  # at 0 s, 300 s and 600 s of 870 s waited


def test_a_refusal_that_is_not_about_reachability_propagates_at_once() -> None:
    def call() -> int:
        raise Refused(grpc.StatusCode.NOT_FOUND)

    with pytest.raises(Refused):
        patiently(call, "agg", "x", lambda s: pytest.fail("must not wait"), lambda n: None, 0.5)
