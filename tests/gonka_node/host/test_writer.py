"""The host's saves written behind (`StoreWriter`): in the order asked for, a failure reported on the
daemon's thread and failing every later save, an upload that waits for its round's save and is not sent
when it failed, and a snapshot that links the worker state a kept round already holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gonka_node.host.store import HostStore, Progress
from gonka_node.host.upload import PendingUpload
from gonka_node.host.writer import StoreWriter, WriteError
from proto.gonka.v1 import aggregator_pb2 as pb

BASE = b"\x02" * 32


def test_saves_run_in_the_order_asked_for_beside_the_caller() -> None:
    writer, order, gate = StoreWriter(), [], threading.Event()
    writer.check()  # nothing failed: nothing raised
    first = writer.submit("first", lambda: (gate.wait(5), order.append(1)))
    second = writer.submit("second", lambda: order.append(2))
    assert not first.done and not second.done and order == []  # the caller did not wait for them
    gate.set()
    writer.flush()
    assert order == [1, 2] and first.wait(0) and second.wait(0)
    writer.close()
    assert writer.submit("after a close", lambda: order.append(3)).wait(5) and order == [1, 2, 3]
    writer.close()


def test_a_failed_save_fails_every_later_one_and_is_raised_on_the_caller_s_thread() -> None:
    writer, ran = StoreWriter(), []

    def full() -> None:
        raise OSError(28, "No space left on device")

    failed = writer.submit("round 3's save before its upload", full)
    later = writer.submit("the snapshot after round 2", lambda: ran.append("snapshot"))
    with pytest.raises(WriteError, match=r"round 3's save before its upload: OSError: \[Errno 28\] No space left"):
        failed.wait(5)
    with pytest.raises(WriteError, match="round 3's save"):
        later.wait(5)
    assert ran == []  # it might have linked a file the failed save did not write
    with pytest.raises(WriteError, match="No space left on device"):
        writer.check()  # what the daemon asks once an upload is settled, without waiting
    with pytest.raises(WriteError, match="No space left on device"):
        writer.flush()
    with pytest.raises(WriteError, match="No space left on device"):
        writer.submit("another", lambda: None)
    with pytest.raises(WriteError):
        writer.close()


class Aggregator:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def open_round(self) -> pb.RoundInfo:
        return pb.RoundInfo(round=2 if self.payloads else 1, base_checkpoint_sha256=BASE)

    def submit(self, info: pb.RoundInfo, payload: bytes, tokens: int, cancelled: Callable[[], bool]) -> tuple[bool, str]:
        self.payloads.append(payload)
        return True, ""


def test_an_upload_is_sent_once_its_round_is_saved_and_not_at_all_when_the_save_failed() -> None:
    writer, agg, gate = StoreWriter(), Aggregator(), threading.Event()
    kept = writer.submit("round 1's save before its upload", lambda: gate.wait(5))
    pending = PendingUpload(1, BASE, b"payload", 1, agg.open_round, agg.submit, 0.01, kept=kept).start()
    time.sleep(0.1)
    assert agg.payloads == []  # round 1 is open, but its save is not on disk yet
    gate.set()
    assert pending.wait().accepted and agg.payloads == [b"payload"]

    def broken() -> None:
        raise OSError(5, "Input/output error")

    refused = PendingUpload(1, BASE, b"other", 1, Aggregator().open_round, agg.submit, 0.01,
                            kept=StoreWriter().submit("round 1's save before its upload", broken)).start()
    result = refused.wait()
    assert not result.accepted and agg.payloads == [b"payload"]
    assert result.reason.startswith("round 1 was not sent: its save before the upload failed")
    assert "Input/output error" in result.reason
    writer.close()


def test_a_snapshot_links_the_worker_state_a_kept_round_holds(tmp_path: Path) -> None:
    store = HostStore(tmp_path, epoch=1)
    residual = {"w": torch.randn(64)}
    state = {"inner": {"step": 8}, "feedback": {"residual": residual, "previous": {}}}
    store.save_sent(1, b"payload", bytes(32), state)
    params = {"w": torch.randn(64)}
    store.save(Progress(1, 0, 1, "00" * 32), params, {"w": torch.zeros(64)}, state, store.sent_state_path(1))
    snap = tmp_path / "snap-000001" / "worker.pt"
    assert snap.stat().st_ino == store.sent_state_path(1).stat().st_ino  # linked, not written again
    store.save(Progress(1, 0, 2, "00" * 32), params, None, state)  # no file holds it: written
    written = tmp_path / "snap-000002" / "worker.pt"
    assert written.stat().st_ino != store.sent_state_path(1).stat().st_ino
    assert torch.equal(torch.load(written)["feedback"]["residual"]["w"], residual["w"])
