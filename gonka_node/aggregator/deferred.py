"""The checks that need a payload decoded, drained by a bounded pool while uploads go on.

A receipt follows the sha256 and the durable store only (docs/PROTOCOL.md "Receipt"): what needs the
payload decoded (names, shapes, finiteness, the norm bound, the CountSketch) runs here afterwards, in
at most `slots` worker threads, so at most `slots` payloads are decoded at once whatever the backlog
(the queue holds store rows, not payloads). The workers run at a lower CPU priority than the process's
other threads (Linux: a thread's nice value is its own), so on cores the transport also needs, the
uploads' receive, hash and store go first and the checks take what is left; torch and numpy release
the GIL in the heavy parts. The round's close waits for its pending checks (`drain`) before it reads the
round's submissions: a payload that fails a check is then no submission, as if refused at upload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from gonka_node.aggregator.store import SubmissionRow

log = logging.getLogger(__name__)
CHECK_NICE = 10  # added to a check thread's nice value: transport threads go first on a shared core

RoundKey = tuple[int, int]  # (epoch, round)
RowKey = tuple[int, int, bytes]  # (epoch, round, host)


def _lower_priority() -> None:
    """Run this worker thread at a lower priority (Linux: per thread; elsewhere: as is)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + CHECK_NICE)


class CheckPool:
    """Runs `check(row)` (which records its own verdict) for each scheduled row, `slots` at a time.

    `running` is how many checks run now and `peak` the most that ever ran at once (≤ slots)."""

    def __init__(self, slots: int, check: Callable[[SubmissionRow], None]) -> None:
        self.slots, self._check = slots, check
        self._executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="check",
                                            initializer=_lower_priority)
        self._tasks: dict[RoundKey, set[asyncio.Future[None]]] = {}
        self._queued: set[RowKey] = set()
        self._lock = threading.Lock()
        self.running = self.peak = 0

    def schedule(self, row: SubmissionRow) -> bool:
        """Queue the row's checks (on the event loop) unless they are queued already; `drain` of its round
        waits for them. True if queued now."""
        if (row.epoch, row.round, row.host) in self._queued:
            return False
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._run, row)
        key = (row.epoch, row.round)
        self._queued.add((row.epoch, row.round, row.host))
        self._tasks.setdefault(key, set()).add(future)
        future.add_done_callback(lambda f: self._done(row, f))
        return True

    def prepare(self, job: Callable[[], object], what: str) -> Future[object]:
        """Run `job` on a check thread ahead of every check scheduled after it (the threads take work in
        order), at the checks' priority: work the first checks would otherwise do while uploads stream.
        A failure is logged; `close` cancels the job if no thread has taken it yet."""

        def logged(future: Future[object]) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.error("%s failed (the checks will do it themselves): %r", what, future.exception())

        future = self._executor.submit(job)
        future.add_done_callback(logged)
        return future

    def pending(self, epoch: int, round_: int) -> int:
        """Checks of the round queued or running."""
        return len(self._tasks.get((epoch, round_), ()))

    async def drain(self, epoch: int, round_: int) -> None:
        """Wait until every check of the round scheduled so far has recorded its verdict."""
        while waiting := list(self._tasks.get((epoch, round_), ())):
            await asyncio.wait(waiting)

    def close(self) -> None:
        """Stop: the checks queued are dropped (their rows stay pending: a restart resumes them), the ones
        running finish (before the store they write to is closed)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _run(self, row: SubmissionRow) -> None:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            self._check(row)
        finally:
            with self._lock:
                self.running -= 1

    def _done(self, row: SubmissionRow, future: asyncio.Future[None]) -> None:
        key = (row.epoch, row.round)
        self._queued.discard((row.epoch, row.round, row.host))
        tasks = self._tasks.get(key)
        if tasks is not None:
            tasks.discard(future)
            if not tasks:
                del self._tasks[key]
        if not future.cancelled() and future.exception() is not None:
            # A failure of ours (a disk, a bug), not the host's: its row stays pending, and the round's
            # close queues it again and waits (RoundEngine.close), as a restart would.
            log.error("checking the payload of 0x%s in round %d/%d failed: %r", row.host.hex(), row.epoch,
                      row.round, future.exception())
