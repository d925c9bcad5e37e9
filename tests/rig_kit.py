"""A one-process rig's loop served in a thread of the test (a stand-in for the torchrun job the daemon
starts), shared by the rig service's tests and the daemon's rig tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from training.rig import Rig
from training.rig_service import Mailbox, RigService, RoundWorker, StateVersions


@contextlib.contextmanager
def serving(mailbox: Mailbox, versions: StateVersions, rig: Rig, worker: RoundWorker) -> Iterator[threading.Thread]:
    """`rig` and its `worker` serving `mailbox` in a thread while the block runs; on leaving, its daemon
    is gone (`alive` cleared), so its loop ends by itself."""
    alive = threading.Event()
    alive.set()
    service = RigService(rig, mailbox, versions, worker, alive.is_set, poll_s=0.01)
    thread = threading.Thread(target=service.serve)
    thread.start()
    try:
        yield thread
    finally:
        alive.clear()
        thread.join(30)
