"""An upload thread's outer step taken ahead of the round's update (`PendingUpload` with `speculate`):
when it starts, what `prepare` gets, what a failure or a cancel does, and what the upload lets go of."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from gonka_node.host.upload import PendingUpload
from proto.gonka.v1 import aggregator_pb2 as pb

BASE = b"\x01" * 32


class Aggregator:
    """Round 1 open until the payload is submitted, round 2 open after it (round 1 closed)."""

    def __init__(self) -> None:
        self.submitted = threading.Event()

    def open_round(self) -> pb.RoundInfo:
        return pb.RoundInfo(round=2 if self.submitted.is_set() else 1, base_checkpoint_sha256=BASE)

    def submit(self, info: pb.RoundInfo, payload: bytes, tokens: int, cancelled: Callable[[], bool]) -> tuple[bool, str]:
        self.submitted.set()
        return True, ""


def upload(agg: Aggregator, prepare: Callable[..., Any], speculate: Callable[..., Any] | None) -> PendingUpload:
    return PendingUpload(1, BASE, b"payload", 1, agg.open_round, agg.submit, 0.01, lambda: b"update", prepare,
                         None, speculate)


def test_the_step_is_taken_ahead_from_the_release_and_handed_to_prepare() -> None:
    agg, seen, order = Aggregator(), [], []
    released = threading.Event()

    def speculate(cancelled: Callable[[], bool]) -> str:
        order.append("speculate")
        assert released.is_set()  # not before the daemon holds the base and says so
        return "taken ahead"

    cancels: list[Callable[[], bool]] = []

    def prepare(data: bytes, speculated: Any, cancelled: Callable[[], bool]) -> None:
        seen.append((data, speculated))
        cancels.append(cancelled)

    pending = upload(agg, prepare, speculate).start()
    agg.submitted.wait(5)
    released.set()
    pending.release_base(True)
    result = pending.wait()
    assert result.accepted and result.update == b"update"
    assert seen == [(b"update", "taken ahead")] and order == ["speculate"]
    assert pending._speculation is None  # let go of once handed over (it holds the model it was taken from)
    assert not cancels[0]()
    pending.cancel()  # what `prepare` was given to stop the next round's step taken ahead
    assert cancels[0]()


def test_a_failed_prepare_keeps_the_upload_and_its_update(caplog: pytest.LogCaptureFixture) -> None:
    agg = Aggregator()

    def prepare(data: bytes, speculated: Any, cancelled: Callable[[], bool]) -> None:
        raise ValueError("taken ahead from other tensors")

    pending = upload(agg, prepare, None).start()
    with caplog.at_level(logging.ERROR, logger="gonka_node.host.upload"):
        pending.release_base(True)
        result = pending.wait()
    assert result.accepted and result.reason == "" and result.update == b"update" and result.ahead is None
    assert "round 1: the next model could not be computed ahead from the update" in caplog.text


def test_a_step_already_taken_ahead_is_used_and_none_is_taken_again() -> None:
    agg, seen = Aggregator(), []

    def speculate(cancelled: Callable[[], bool]) -> str:
        raise AssertionError("the thread takes no step of its own when given one")

    pending = upload(agg, lambda data, speculated, cancelled: seen.append(speculated), speculate).start()
    pending.release_base(True, "from the adopted model")
    pending.wait()
    assert seen == ["from the adopted model"]


def test_a_base_not_held_gets_no_step_and_no_next_model() -> None:
    agg, seen = Aggregator(), []
    pending = upload(agg, lambda *args: seen.append(args), lambda cancelled: "never").start()
    pending.release_base(False, "ignored")
    result = pending.wait()
    assert result.accepted and result.ahead is None and seen == []


def test_a_failed_step_ahead_leaves_the_whole_step_to_prepare(caplog: pytest.LogCaptureFixture) -> None:
    agg, seen = Aggregator(), []

    def speculate(cancelled: Callable[[], bool]) -> str:
        raise MemoryError("no room for a second model")

    pending = upload(agg, lambda data, speculated, cancelled: seen.append(speculated), speculate).start()
    with caplog.at_level(logging.ERROR, logger="gonka_node.host.upload"):
        pending.release_base(True)
        result = pending.wait()
    assert result.accepted and seen == [None]
    assert "round 1: the outer step ahead of the update failed" in caplog.text


def test_a_cancel_reaches_the_step_ahead_and_wait_joins_it() -> None:
    agg = Aggregator()
    started, stopped = threading.Event(), threading.Event()

    def speculate(cancelled: Callable[[], bool]) -> None:
        started.set()
        while not cancelled():  # a step checks between tensors
            threading.Event().wait(0.01)
        stopped.set()

    # The round never closes here: the thread waits for the next round until cancelled.
    pending = PendingUpload(1, BASE, b"payload", 1, lambda: pb.RoundInfo(round=1, base_checkpoint_sha256=BASE),
                            agg.submit, 0.01, lambda: b"update", lambda *args: None, None, speculate).start()
    pending.release_base(True)
    assert started.wait(5)
    pending.cancel()
    pending.wait()
    assert stopped.is_set()
