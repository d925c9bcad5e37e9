"""The host's saves, written by one thread of their own, in the order they were asked for.

A host's saves are large: a round kept before its upload holds both error-feedback residuals, and the
snapshot of each adopted model holds the model and its outer momentum (24 bytes a parameter a round
before this writer: 29.7 GB at 1.2B; scripts/bench_wan.py `measure_seal`). Written on the daemon's
thread they sat between one round's training and the next. Here they run beside the next round: what
they save is captured when they are asked for and is never written in place afterwards (the residuals
are replaced by each compress, an adopted model replaces the held one, and the daemon waits for the
writes before it steps a held model in place: `HostNode._follow`).

Order is what makes the saves' hard links safe: a save that links a file another save writes (a
round's rollback point, the snapshot's worker state) is asked for after it, so it runs after it. A
failed save fails every later one (they may link what it did not write) and is raised on the daemon's
thread at its next `submit` or `flush`: the daemon stops as it did when it wrote them itself, and an
upload waiting for its round to be kept (`Written.wait`) is not sent.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class WriteError(RuntimeError):
    """A save failed; the message says which and why."""


class Written:
    """One save asked of the writer: `wait` returns once it is on disk and raises WriteError if it failed."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once written; False when `timeout` passed first. Raises WriteError if the save failed."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise WriteError(f"{self.what}: {type(self._error).__name__}: {self._error}") from self._error
        return True

    @property
    def done(self) -> bool:
        return self._done.is_set()


class StoreWriter:
    def __init__(self, name: str = "host-writer") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Written] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: WriteError | None = None
        self._last: Written | None = None
        self._lock = threading.Lock()

    def submit(self, what: str, save: Callable[[], None]) -> Written:
        """Run `save` after every save asked for before it. Raises the first failed save's WriteError."""
        self._raise_failed()
        written = Written(what)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._last = written
            self._jobs.put((save, written))
        return written

    def flush(self) -> None:
        """Wait until every save asked for so far is on disk; raises the first failed one's WriteError."""
        last = self._last
        if last is not None:
            with contextlib.suppress(WriteError):  # the first failure is the one to report
                last.wait()
        self._raise_failed()

    def close(self) -> None:
        """Flush, then stop the thread (a later `submit` starts another)."""
        try:
            self.flush()
        finally:
            with self._lock:
                thread, self._thread = self._thread, None
                if thread is not None:
                    self._jobs.put(None)
            if thread is not None:
                thread.join()

    def check(self) -> None:
        """Raise the first failed save's WriteError, if one failed so far (no wait)."""
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            save, written = job
            if self._failed is not None:  # it may link what the failed save did not write
                written._finish(self._failed)
                continue
            try:
                save()
            except BaseException as exc:  # reported on the daemon's thread, never lost
                log.exception("%s failed", written.what)
                self._failed = WriteError(f"{written.what}: {type(exc).__name__}: {exc}")
                self._failed.__cause__ = exc
                written._finish(exc)
                continue
            written._finish(None)
