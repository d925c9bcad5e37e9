"""The opening of a challenged top-k submission: which chunks, the signed header, and the body's bytes.

A host picked for the replay of a top-k round opens its residual before and after the round's compress
(e_{r−1}, e_r) on chunks sampled from the round's seed (docs/PROTOCOL.md "Challenge and opening"). Both
sides compute the sample here (`challenge`), so a host refuses a challenge that is not the seed's and the
aggregator cannot pick chunks after seeing the residual's roots. The header is a fixed-width record
signed like the submission envelope (core/envelope.py), so an opening that does not verify against the
roots the host signed is itself signed evidence; the body is a serialized `ResidualOpening`, bound to
the header by its sha256 and length.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from nacl.signing import SigningKey

from gonka_node.core.envelope import SignedRecord, check_bytes, check_u64
from proto.gonka.v1 import aggregator_pb2 as pb
from training.residual_commit import ChunkLayout, Opening, sample_chunks

OPENING_TAG = b"gonka/opening".ljust(16, b"\x00")
OPENING_LAYOUT_VERSION = 1
CHALLENGE_TAG = b"gonka-residual-challenge-v1"
# tag, version, chain id, registry, epoch, round, host, previous root, residual root, body sha, length, time
_OPENING = struct.Struct(">16sHQ20sQQ20s32s32s32sQQ")
OPENING_BYTES = _OPENING.size  # 194


class OpeningError(ValueError):
    """An opening body that is not a well-formed answer to its challenge (what it lacks, one line)."""


@dataclass(frozen=True)
class OpeningRecord(SignedRecord):
    """What a host signs when it opens: the two roots it opens against, bound to one round of one
    registry on one chain, and the digest of the body that carries the chunks."""

    chain_id: int
    registry: bytes  # 20-byte contract address
    epoch: int
    round: int
    host: bytes  # 20-byte EVM address
    previous_root: bytes  # e_{r−1}'s root: the one signed in the host's last submitted round, or the zero root
    residual_root: bytes  # e_r's root: the one signed in this round's submission
    body_sha256: bytes
    body_length: int
    timestamp_ms: int

    def __post_init__(self) -> None:
        for name in ("chain_id", "epoch", "round", "body_length", "timestamp_ms"):
            check_u64(name, getattr(self, name))
        check_bytes("registry", self.registry, 20)
        check_bytes("host", self.host, 20)
        for name in ("previous_root", "residual_root", "body_sha256"):
            check_bytes(name, getattr(self, name), 32)

    def canonical_bytes(self) -> bytes:
        return _OPENING.pack(
            OPENING_TAG,
            OPENING_LAYOUT_VERSION,
            self.chain_id,
            bytes(self.registry),
            self.epoch,
            self.round,
            bytes(self.host),
            bytes(self.previous_root),
            bytes(self.residual_root),
            bytes(self.body_sha256),
            self.body_length,
            self.timestamp_ms,
        )


def challenge_seed(round_seed: bytes, round_: int, host: bytes) -> bytes:
    """The seed of one host's sample: different per host and round, public once the round's seed is."""
    return hashlib.sha256(CHALLENGE_TAG + bytes(round_seed) + round_.to_bytes(8, "big") + bytes(host)).digest()


def challenge(
    round_seed: bytes, round_: int, host: bytes, layout: ChunkLayout, fraction: float, min_elements: int
) -> tuple[int, ...]:
    """The chunk indices `host` must open in `round_` (ascending): a `fraction` of the layout's chunks,
    and at least `min_elements` elements' worth of chunks. The minimum is in elements because what the
    verdict's cosine needs is elements (a 4-chunk sample of a tiny model let another slot's update pass
    where the same fraction of a large model does not: docs/PROTOCOL.md "Top-k epochs")."""
    minimum = max(1, math.ceil(min_elements / layout.chunk))
    return sample_chunks(challenge_seed(round_seed, round_, host), layout.n_chunks, fraction, minimum)


def encode_body(previous: Opening, current: Opening) -> bytes:
    """The serialized `ResidualOpening` of both residuals' openings (the same indices, ascending)."""
    if previous.indices != current.indices:
        raise OpeningError("the two openings must open the same chunks")
    body = pb.ResidualOpening()
    for i, index in enumerate(current.indices):
        body.chunks.add(
            index=index,
            previous=previous.chunks[i],
            previous_path=list(previous.paths[i]),
            current=current.chunks[i],
            current_path=list(current.paths[i]),
        )
    return body.SerializeToString(deterministic=True)


def decode_body(data: bytes, sample: tuple[int, ...]) -> tuple[Opening, Opening]:
    """(e_{r−1}'s opening, e_r's opening) from a body that must open exactly `sample`, in its order.
    Raises OpeningError naming what is wrong; whether the chunks verify against the roots is
    `training.residual_commit.verify_opening`'s question, asked by the caller."""
    body = pb.ResidualOpening()
    try:
        body.ParseFromString(data)
    except DecodeError as exc:
        raise OpeningError(f"the opening body is not a ResidualOpening: {exc}") from None
    indices = tuple(int(c.index) for c in body.chunks)
    if indices != sample:
        raise OpeningError(
            f"the opening opens {len(indices)} chunks, not the challenge's {len(sample)} (in ascending order)"
        )
    previous = Opening(indices, tuple(c.previous for c in body.chunks),
                       tuple(tuple(c.previous_path) for c in body.chunks))
    current = Opening(indices, tuple(c.current for c in body.chunks),
                      tuple(tuple(c.current_path) for c in body.chunks))
    return previous, current


def opening_header(record: OpeningRecord, signature: bytes) -> pb.OpeningHeader:
    """The wire form of a signed opening record."""
    return pb.OpeningHeader(
        chain_id=record.chain_id, registry=record.registry, epoch=record.epoch, round=record.round,
        host=record.host, previous_root=record.previous_root, residual_root=record.residual_root,
        body_sha256=record.body_sha256, body_length=record.body_length, timestamp_unix_ms=record.timestamp_ms,
        signature=signature,
    )


def record_of(header: pb.OpeningHeader) -> OpeningRecord:
    """The record a header's signature must cover, rebuilt from its fields (never from signed bytes on
    the wire); raises `EnvelopeError` naming a field of the wrong width."""
    return OpeningRecord(
        chain_id=header.chain_id, registry=header.registry, epoch=header.epoch, round=header.round,
        host=header.host, previous_root=header.previous_root, residual_root=header.residual_root,
        body_sha256=header.body_sha256, body_length=header.body_length, timestamp_ms=header.timestamp_unix_ms,
    )


def signed_opening(
    info: pb.RoundInfo, round_: int, host: bytes, previous_root: bytes, residual_root: bytes, body: bytes,
    key: SigningKey,
) -> pb.OpeningHeader:
    """The signed header of `body`, the host's opening of `round_` of `info`'s epoch and registry."""
    record = OpeningRecord(
        chain_id=info.chain_id, registry=info.registry, epoch=info.epoch, round=round_, host=host,
        previous_root=previous_root, residual_root=residual_root, body_sha256=hashlib.sha256(body).digest(),
        body_length=len(body), timestamp_ms=time.time_ns() // 1_000_000,
    )
    return opening_header(record, record.sign(key))
