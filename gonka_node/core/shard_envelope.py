"""Canonical signed bytes of a message one shard sends another (docs/PROTOCOL.md "The Shard service").

Like `envelope.Submission`: a fixed-width, big-endian record starting with a 16-byte domain tag and a
layout version, signed with the sender's ed25519 node key. It names the chain, registry, epoch, round,
the kind of message, the sender's index and the shard count, the blob key, and the body's sha256 and
length (the body itself is not signed, its digest is: a blob may be gigabytes), so a message signed for
one round, kind, slot or deployment verifies for no other. `sequence` orders the messages a sender signs
for one slot (epoch, round, kind, sender, key): a receiver keeps the highest, so an older one replayed
never replaces a newer one.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass

from gonka_node.core.envelope import EnvelopeError, SignedRecord

SHARD_TAG = b"gonka/shard-msg".ljust(16, b"\x00")
SHARD_LAYOUT_VERSION = 1
KEY_FIELD_BYTES = 64
# tag, version, chain id, registry, epoch, round, kind, sender, count, key, body sha, body length, sequence
_SHARD = struct.Struct(">16sHQ20sQQBHH64s32sQQ")
SHARD_MESSAGE_BYTES = _SHARD.size  # 179
_BLOB_KEY = re.compile(r"base|payload-[0-9a-f]{40}")
_U64_MAX = 2**64 - 1


class ShardKind(enum.IntEnum):
    """What a message carries (the numbers are `gonka.v1.ShardKind`'s)."""

    REPORT = 1
    VERDICT = 2
    HASH = 3
    BLOB = 4


@dataclass(frozen=True)
class ShardMessage(SignedRecord):
    """The signed header of one shard-to-shard message."""

    chain_id: int
    registry: bytes  # 20-byte contract address
    epoch: int
    round: int
    kind: ShardKind
    sender: int  # the sending shard's index
    count: int  # the epoch's shard count
    key: str  # a blob's key ("base", "payload-<host hex>"); "" for the other kinds
    body_sha256: bytes
    body_length: int
    sequence: int

    def __post_init__(self) -> None:
        for name in ("chain_id", "epoch", "round", "body_length", "sequence"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U64_MAX:
                raise EnvelopeError(f"{name} must be an integer in [0, 2^64), got {value!r}")
        if not 0 <= self.sender < self.count <= 0xFFFF:
            raise EnvelopeError(f"sender {self.sender} is not a shard of {self.count}")
        if len(self.registry) != 20 or len(self.body_sha256) != 32:
            raise EnvelopeError("registry must be 20 bytes and body_sha256 32 bytes")
        if (self.kind == ShardKind.BLOB) != bool(_BLOB_KEY.fullmatch(self.key)) or (
            self.kind != ShardKind.BLOB and self.key
        ):
            raise EnvelopeError(f"key {self.key!r} does not fit a {self.kind.name} message")

    @property
    def slot(self) -> tuple[int, int, ShardKind, int, str]:
        """What a newer message from the same sender replaces."""
        return (self.epoch, self.round, self.kind, self.sender, self.key)

    def canonical_bytes(self) -> bytes:
        return _SHARD.pack(
            SHARD_TAG, SHARD_LAYOUT_VERSION, self.chain_id, bytes(self.registry), self.epoch, self.round,
            int(self.kind), self.sender, self.count, self.key.encode("ascii").ljust(KEY_FIELD_BYTES, b"\x00"),
            bytes(self.body_sha256), self.body_length, self.sequence,
        )

    @classmethod
    def from_canonical(cls, data: bytes) -> ShardMessage:
        """The header `canonical_bytes` wrote (stored messages are read back through this)."""
        tag, version, chain, registry, epoch, round_, kind, sender, count, key, sha, length, seq = _SHARD.unpack(data)
        if tag != SHARD_TAG or version != SHARD_LAYOUT_VERSION:
            raise EnvelopeError("not a shard message of this layout version")
        return cls(chain, registry, epoch, round_, ShardKind(kind), sender, count,
                   key.rstrip(b"\x00").decode("ascii"), sha, length, seq)
