"""One admitted shard message's body on its way to its slot (docs/PROTOCOL.md "The Shard service").

The body is written, chunk by chunk as it arrives, to a temporary file beside its slot that starts with
the signed header and signature (the slot's own layout), and hashed as it goes: a receiver holds one
chunk of it in memory, however large the body. Bytes past the signed length are refused at once
(`OVERSIZE`); at the end the length and the digest must be the signed ones (`DIGEST_MISMATCH`), a report
or verdict must name its signed round and sender, and only then is the file moved into its slot
(`Inbox.settle`). A refused or broken stream leaves no file and gives its quota back.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

from gonka_node.aggregator.shard_inbox import Inbox, ShardReason, ShardRefused, check_body
from gonka_node.core.envelope import SIGNATURE_BYTES
from gonka_node.core.shard_envelope import SHARD_MESSAGE_BYTES, ShardKind, ShardMessage

PARSED = (ShardKind.REPORT, ShardKind.VERDICT)  # bodies read back whole to check what they name


class Incoming:
    """The body of `header` (already admitted: screened, signature checked) being received into `inbox`."""

    def __init__(self, inbox: Inbox, header: ShardMessage, signature: bytes) -> None:
        self.inbox, self.header, self.signature = inbox, header, signature
        self.got = 0
        self._digest = hashlib.sha256()
        self._token: int | None = None
        self._file: BinaryIO | None = None
        self.tmp: Path | None = None

    def open(self) -> Incoming:
        """Reserve the sender's quota (ShardRefused QUOTA, OVERSIZE), then start the temporary file."""
        self._token = self.inbox.reserve(self.header)
        try:
            slot = self.inbox.path(self.header)
            slot.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=slot.parent, prefix=f".{slot.name}.", suffix=".tmp")
            self.tmp, self._file = Path(name), os.fdopen(fd, "wb")
            self._file.write(self.header.canonical_bytes() + self.signature)
        except BaseException:
            self.discard()
            raise
        return self

    def write(self, data: bytes) -> None:
        """The next chunk of the body (ShardRefused OVERSIZE once it runs past the signed length)."""
        assert self._file is not None, "open() first"
        if self.got + len(data) > self.header.body_length:
            raise ShardRefused(ShardReason.OVERSIZE, f"the body runs past the signed {self.header.body_length} bytes")
        self._digest.update(data)
        self._file.write(data)
        self._file.flush()  # on disk as received: the process holds no more than the chunk
        self.got += len(data)

    def finish(self) -> bool:
        """Check the whole body and hold the message; False when exactly it was held already."""
        assert self._file is not None and self.tmp is not None and self._token is not None, "open() first"
        h = self.header
        os.fsync(self._file.fileno())  # here, not under the inbox's lock in `settle`
        self._file.close()
        if self.got != h.body_length or not hmac.compare_digest(self._digest.digest(), bytes(h.body_sha256)):
            raise ShardRefused(ShardReason.DIGEST_MISMATCH, f"the body ({self.got} bytes) is not the signed "
                               f"{h.body_length} bytes with sha256 {bytes(h.body_sha256).hex()}")
        if h.kind in PARSED:  # bounded by the quota's report and verdict sizes
            check_body(h, self.tmp.read_bytes()[SHARD_MESSAGE_BYTES + SIGNATURE_BYTES :])
        stored = self.inbox.settle(h, self.tmp, self._token)
        self._token = None  # settle gave the reservation back
        return stored

    def discard(self) -> None:
        """Remove the temporary file (if it is still there) and give back what is still reserved."""
        if self._file is not None:
            self._file.close()
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
        if self._token is not None:
            self.inbox.release(self.header, self._token)
            self._token = None
