"""Receive one payload stream: bounded chunks, bounded total, incremental sha256, spooled to disk.

Nothing is read past the declared length (plus the one chunk that proves an overrun), and the bytes
go to a private file under `incoming/` that the store renames into place only once everything checked.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from gonka_node.aggregator.reasons import Reason, Rejected


async def receive_payload(
    chunks: AsyncIterator[bytes],
    *,
    declared_length: int,
    declared_sha256: bytes,
    max_chunk_bytes: int,
    incoming: Path,
) -> Path:
    """Spool the stream to a new file in `incoming`; returns its path, or raises `Rejected` (file removed)."""
    part = incoming / f"{uuid.uuid4().hex}.part"
    digest = hashlib.sha256()
    received = 0
    try:
        with open(part, "wb") as f:
            async for chunk in chunks:
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


def discard(part: Path) -> None:
    part.unlink(missing_ok=True)
