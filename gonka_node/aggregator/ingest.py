"""Receive one payload stream: bounded chunks, bounded total, bounded time, incremental sha256, spooled to disk.

Nothing is read past the declared length (plus the one chunk that proves an overrun), and the bytes
go to a private file under `incoming/` that the store renames into place only once everything checked.

No stream may hold the aggregator: each waits at most `StreamLimits.idle_s` for its next message, the
whole upload must finish within `setup_s + declared_length / min_bytes_per_s` (a stated minimum upload
rate, so the limit grows with the payload and a slow honest link knows what it must sustain), and the
stream ends as LATE the moment its round closes (`closed` is set), whatever it still had to send.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gonka_node.aggregator.reasons import Reason, Rejected

T = TypeVar("T")


@dataclass(frozen=True)
class StreamLimits:
    """How long a stream may take (docs/PROTOCOL.md "Stream deadlines")."""

    idle_s: float = 30.0  # longest wait for the header, or between two chunks
    setup_s: float = 30.0  # allowance on top of the bytes' transfer time
    min_bytes_per_s: float = 128 * 1024  # ~1 Mbit/s: a payload must arrive at least this fast

    def total_s(self, declared_length: int) -> float:
        return self.setup_s + declared_length / self.min_bytes_per_s


class StreamGuard:
    """Reads a stream's messages one at a time within the limits; raises `Rejected` when one is broken.

    `closed` is the round's "closed for submissions" event: set, it ends every stream still reading."""

    def __init__(self, limits: StreamLimits, closed: asyncio.Event, what: str) -> None:
        self.limits, self.closed, self.what = limits, closed, what
        self.deadline = time.monotonic() + limits.idle_s

    def allow_total(self, declared_length: int) -> None:
        """From the header on, the whole upload's deadline (the header itself was bounded by idle_s)."""
        self.deadline = time.monotonic() + self.limits.total_s(declared_length)

    async def next(self, stream: AsyncIterator[T]) -> T | None:
        """The stream's next message, None at its end."""
        wait = min(self.limits.idle_s, self.deadline - time.monotonic())
        if wait <= 0:
            raise self._too_slow()
        reading = asyncio.ensure_future(anext(stream, None))
        closing = asyncio.ensure_future(self.closed.wait())
        try:
            done, _ = await asyncio.wait({reading, closing}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        if reading in done:
            return reading.result()
        reading.cancel()
        if closing in done:
            raise Rejected(Reason.LATE, f"{self.what}: the round closed while the payload streamed")
        if time.monotonic() >= self.deadline:
            raise self._too_slow()
        raise Rejected(
            Reason.STREAM_TIMEOUT, f"{self.what}: nothing received for {self.limits.idle_s:g} s"
        )

    def _too_slow(self) -> Rejected:
        rate = self.limits.min_bytes_per_s / 1024
        return Rejected(
            Reason.STREAM_TIMEOUT,
            f"{self.what}: the upload did not finish in time (the minimum rate is {rate:g} KiB/s after "
            f"{self.limits.setup_s:g} s of setup)",
        )


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
    digest = hashlib.sha256()
    received = 0
    guard.allow_total(declared_length)
    try:
        with open(part, "wb") as f:
            while (chunk := await guard.next(chunks)) is not None:
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
                digest.update(chunk)
                f.write(chunk)
            if received < declared_length:
                raise Rejected(
                    Reason.TRUNCATED, f"stream ended after {received} of {declared_length} declared bytes"
                )
            if not hmac.compare_digest(digest.digest(), declared_sha256):
                raise Rejected(
                    Reason.DIGEST_MISMATCH,
                    f"payload sha256 is {digest.hexdigest()}, the signed header says {declared_sha256.hex()}",
                )
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return part
