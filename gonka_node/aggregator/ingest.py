"""Receive one payload stream: bounded chunks, bounded total, bounded time, incremental sha256, spooled to disk.

Nothing is read past the declared length (plus the one chunk that proves an overrun), and the bytes
go to a private file under `incoming/` that the store renames into place only once everything checked.

No stream may hold the aggregator (`StreamGuard`): each waits at most `StreamLimits.idle_s` for its
next message, the whole upload must finish within `setup_s + declared_length / min_bytes_per_s` (a
stated minimum upload rate, so the limit grows with the payload and a slow honest link knows what it
must sustain), and the stream ends as LATE the moment its round closes, whatever it still had to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from gonka_node.aggregator.reasons import Reason, Rejected


@dataclass(frozen=True)
class StreamLimits:
    """How long a stream may take (docs/PROTOCOL.md "Stream deadlines")."""

    idle_s: float = 30.0  # longest wait for the header, or between two chunks
    setup_s: float = 30.0  # allowance on top of the bytes' transfer time
    min_bytes_per_s: float = 128 * 1024  # ~1 Mbit/s: a payload must arrive at least this fast

    def total_s(self, declared_length: int) -> float:
        return self.setup_s + declared_length / self.min_bytes_per_s


class StreamGuard:
    """Times one Submit stream from its handler's side: a watchdog task cancels the handler when the
    stream breaks a limit or its round closes, and `refused()` turns that cancellation into the
    `Rejected` it stands for. Reads stay plain awaits in the handler's own task (gRPC's request iterator
    is read where the call lives; a read moved to another task does not see a dropped connection).

    Armed from the call's start until the payload is fully received (`disarm`): decoding and storing
    are never interrupted (a round that closes meanwhile refuses the upload as LATE by its own check)."""

    def __init__(self, limits: StreamLimits, closed: asyncio.Event, what: str) -> None:
        self.limits, self.closed, self.what = limits, closed, what
        now = time.monotonic()
        self.last, self.deadline = now, now + limits.idle_s  # the header is due within idle_s
        self.refusal: Rejected | None = None
        self._watch: asyncio.Task[None] | None = None

    def arm(self) -> StreamGuard:
        handler = asyncio.current_task()
        assert handler is not None
        self._watch = asyncio.ensure_future(self._watchdog(handler))
        return self

    def disarm(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def touch(self) -> None:
        """A message arrived: the idle clock starts again."""
        self.last = time.monotonic()

    def allow_total(self, declared_length: int) -> None:
        """From the header on, the whole upload's deadline (the header itself was bounded by idle_s)."""
        self.deadline = time.monotonic() + self.limits.total_s(declared_length)

    def refused(self, cancelled: BaseException) -> Rejected | None:
        """The refusal a cancellation of the handler stands for (None: not ours, e.g. the client left)."""
        if self.refusal is None:
            return None
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # the handler goes on to answer with the refusal
        return self.refusal

    async def _watchdog(self, handler: asyncio.Task[object]) -> None:
        while True:
            now = time.monotonic()
            idle_at = self.last + self.limits.idle_s
            wake = min(idle_at, self.deadline)
            if now >= wake:
                self._refuse(handler, self._too_slow() if now >= self.deadline else Rejected(
                    Reason.STREAM_TIMEOUT, f"{self.what}: nothing received for {self.limits.idle_s:g} s"))
                return
            try:
                await asyncio.wait_for(self.closed.wait(), wake - now)
            except TimeoutError:
                continue
            self._refuse(handler, Rejected(Reason.LATE, f"{self.what}: the round closed while the payload streamed"))
            return

    def _refuse(self, handler: asyncio.Task[object], refusal: Rejected) -> None:
        self.refusal = refusal
        handler.cancel()

    def _too_slow(self) -> Rejected:
        rate = self.limits.min_bytes_per_s / 1024
        return Rejected(
            Reason.STREAM_TIMEOUT,
            f"{self.what}: the upload did not finish in time (the minimum rate is {rate:g} KiB/s after "
            f"{self.limits.setup_s:g} s of setup)",
        )


class _Spool:
    """Hashes and writes a stream's chunks in a worker thread, one chunk behind the receive: the event
    loop only hands chunks over (sha256 and file writes release the GIL), so other streams' messages
    are read while this one's bytes are hashed, and at most two chunks per stream are in memory."""

    def __init__(self, path: Path) -> None:
        self.digest = hashlib.sha256()
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._pending: asyncio.Future[None] | None = None

    async def write(self, chunk: bytes) -> None:
        await self.flush()
        self._pending = asyncio.ensure_future(asyncio.to_thread(self._write, chunk))

    def _write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self._file.write(chunk)

    async def flush(self) -> None:
        if self._pending is not None:
            await asyncio.shield(self._pending)  # a cancelled stream still lets the write finish (close)
            self._pending = None

    async def close(self) -> None:
        """Wait for the write in flight (even when the stream was cancelled), then close the file."""
        try:
            if self._pending is not None:
                with contextlib.suppress(Exception):  # a failed write was raised by flush already
                    await asyncio.shield(self._pending)
        finally:
            self._pending = None
            self._file.close()


async def receive_payload(
    chunks: AsyncIterator[bytes],
    *,
    declared_length: int,
    declared_sha256: bytes,
    max_chunk_bytes: int,
    incoming: Path,
    guard: StreamGuard,
) -> Path:
    """Spool the stream to a new file in `incoming`; returns its path, or raises `Rejected` (file removed)."""
    part = incoming / f"{uuid.uuid4().hex}.part"
    received = 0
    guard.allow_total(declared_length)
    spool = _Spool(part)
    try:
        try:
            async for chunk in chunks:
                guard.touch()
                if len(chunk) > max_chunk_bytes:
                    raise Rejected(
                        Reason.OVERSIZE,
                        f"chunk of {len(chunk)} bytes exceeds the {max_chunk_bytes}-byte chunk limit",
                    )
                received += len(chunk)
                if received > declared_length:
                    raise Rejected(
                        Reason.OVERSIZE, f"stream exceeds the declared payload_length {declared_length}"
                    )
                await spool.write(chunk)
            await spool.flush()
        finally:
            await spool.close()
        if received < declared_length:
            raise Rejected(
                Reason.TRUNCATED, f"stream ended after {received} of {declared_length} declared bytes"
            )
        if not hmac.compare_digest(spool.digest.digest(), declared_sha256):
            raise Rejected(
                Reason.DIGEST_MISMATCH,
                f"payload sha256 is {spool.digest.hexdigest()}, the signed header says {declared_sha256.hex()}",
            )
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return part
