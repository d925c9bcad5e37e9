"""Canonical signed bytes of a submission and of the aggregator's receipt.

Both are fixed-width, big-endian records starting with a 16-byte domain-separation tag and a uint16
layout version (docs/PROTOCOL.md gives the tables). They are deliberately not protobuf bytes: protobuf
serialization is not canonical (field order, default omission, unknown fields), and a signature must
cover exactly one byte string per meaning. The server rebuilds these bytes from the header's fields, so
nothing signed is ever taken from the wire as-is.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

SUBMISSION_TAG = b"gonka/submission"
RECEIPT_TAG = b"gonka/receipt".ljust(16, b"\x00")
LAYOUT_VERSION = 1  # the receipt's layout
# The submission's layout: 2 added `residual_root`. Version 1 is verified nowhere (no network runs hosts
# that sign it), so a signature over the old bytes simply does not verify.
SUBMISSION_LAYOUT_VERSION = 2
CODEC_FIELD_BYTES = 64  # the chain's EpochSpec allows codec strings of 1..64 bytes
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32

# tag, version, chain id, registry, epoch, round, host, base sha, codec, payload sha, length, tokens, time,
# residual root
_SUBMISSION = struct.Struct(">16sHQ20sQQ20s32s64s32sQQQ32s")
# tag, version, chain id, registry, epoch, round, host, payload sha, length, accepted, reason, time
_RECEIPT = struct.Struct(">16sHQ20sQQ20s32sQBHQ")
SUBMISSION_BYTES = _SUBMISSION.size  # 266
RECEIPT_BYTES = _RECEIPT.size  # 133

_U64_MAX = 2**64 - 1


class EnvelopeError(ValueError):
    """A field does not fit the canonical layout (wrong width, out of range, non-ASCII codec)."""


def check_bytes(name: str, value: bytes, width: int) -> None:
    if not isinstance(value, bytes | bytearray) or len(value) != width:
        got = len(value) if isinstance(value, bytes | bytearray) else type(value).__name__
        raise EnvelopeError(f"{name} must be {width} bytes, got {got}")


def check_u64(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U64_MAX:
        raise EnvelopeError(f"{name} must be an integer in [0, 2^64), got {value!r}")


def encode_codec(codec: str) -> bytes:
    """The codec string as its 64-byte field: printable ASCII, 1..64 bytes, right-padded with NUL."""
    raw = codec.encode("utf-8", "surrogatepass")  # a lone surrogate fails the printable check below
    if not 1 <= len(raw) <= CODEC_FIELD_BYTES or not all(0x21 <= b <= 0x7E for b in raw):
        raise EnvelopeError(f"codec must be 1..64 printable ASCII characters without spaces, got {codec!r}")
    return raw.ljust(CODEC_FIELD_BYTES, b"\x00")


class SignedRecord:
    """A fixed-layout record signed with ed25519 over its `canonical_bytes()` (never over protobuf)."""

    def canonical_bytes(self) -> bytes:
        raise NotImplementedError

    def sign(self, key: SigningKey) -> bytes:
        """The 64-byte ed25519 signature over `canonical_bytes()`."""
        return key.sign(self.canonical_bytes()).signature

    def verify(self, signature: bytes, public_key: bytes) -> bool:
        """True when `signature` is `public_key`'s signature over these exact fields; never raises."""
        return _verify(self.canonical_bytes(), signature, public_key)


@dataclass(frozen=True)
class Submission(SignedRecord):
    """What a host signs: the payload's digest bound to one round of one registry on one chain, and the
    root of its error-feedback residual after the round's compress (training/residual_commit.py; the
    zero residual's root where it keeps none), which a replay challenge opens against."""

    chain_id: int
    registry: bytes  # 20-byte contract address
    epoch: int
    round: int
    host: bytes  # 20-byte EVM address
    base_checkpoint_sha256: bytes
    codec: str
    payload_sha256: bytes
    payload_length: int
    tokens_trained: int
    timestamp_ms: int
    residual_root: bytes  # 32 bytes: residual_root(e_r) with the epoch's layout, chunk 4096

    def __post_init__(self) -> None:
        for name in ("chain_id", "epoch", "round", "payload_length", "tokens_trained", "timestamp_ms"):
            check_u64(name, getattr(self, name))
        check_bytes("registry", self.registry, 20)
        check_bytes("host", self.host, 20)
        check_bytes("base_checkpoint_sha256", self.base_checkpoint_sha256, 32)
        check_bytes("payload_sha256", self.payload_sha256, 32)
        check_bytes("residual_root", self.residual_root, 32)
        encode_codec(self.codec)

    def canonical_bytes(self) -> bytes:
        return _SUBMISSION.pack(
            SUBMISSION_TAG,
            SUBMISSION_LAYOUT_VERSION,
            self.chain_id,
            bytes(self.registry),
            self.epoch,
            self.round,
            bytes(self.host),
            bytes(self.base_checkpoint_sha256),
            encode_codec(self.codec),
            bytes(self.payload_sha256),
            self.payload_length,
            self.tokens_trained,
            self.timestamp_ms,
            bytes(self.residual_root),
        )


@dataclass(frozen=True)
class ReceiptBody(SignedRecord):
    """What the aggregator signs when it answers a submission (accepted or not)."""

    chain_id: int
    registry: bytes
    epoch: int
    round: int
    host: bytes
    payload_sha256: bytes
    payload_length: int
    accepted: bool
    reason: int  # gonka.v1.RejectReason number; 0 when accepted
    received_ms: int

    def __post_init__(self) -> None:
        for name in ("chain_id", "epoch", "round", "payload_length", "received_ms"):
            check_u64(name, getattr(self, name))
        check_bytes("registry", self.registry, 20)
        check_bytes("host", self.host, 20)
        check_bytes("payload_sha256", self.payload_sha256, 32)
        if not 0 <= self.reason <= 0xFFFF:
            raise EnvelopeError(f"reason must fit in uint16, got {self.reason}")

    def canonical_bytes(self) -> bytes:
        return _RECEIPT.pack(
            RECEIPT_TAG,
            LAYOUT_VERSION,
            self.chain_id,
            bytes(self.registry),
            self.epoch,
            self.round,
            bytes(self.host),
            bytes(self.payload_sha256),
            self.payload_length,
            1 if self.accepted else 0,
            self.reason,
            self.received_ms,
        )


def _verify(message: bytes, signature: bytes, public_key: bytes) -> bool:
    if len(signature) != SIGNATURE_BYTES or len(public_key) != PUBLIC_KEY_BYTES:
        return False
    try:
        VerifyKey(bytes(public_key)).verify(message, bytes(signature))
    except (BadSignatureError, ValueError):
        # ValueError: a public key that is not a valid curve point; treated as "does not verify".
        return False
    return True
