"""The signed envelope (`envelope`) as the gRPC messages carry it: a submission's header built and signed
from a round's `RoundInfo`, and a receipt read back into the `ReceiptBody` its signature covers. Hosts,
the aggregator's client and the adversary kit all sign and check through these, so the wire format has
one statement here, beside the envelope it carries."""

from __future__ import annotations

import hashlib
import time

from nacl.signing import SigningKey

from gonka_node.core.envelope import ReceiptBody, Submission
from proto.gonka.v1 import aggregator_pb2 as pb


def receipt_body(r: pb.Receipt) -> ReceiptBody:
    return ReceiptBody(
        chain_id=r.chain_id,
        registry=r.registry,
        epoch=r.epoch,
        round=r.round,
        host=r.host,
        payload_sha256=r.payload_sha256,
        payload_length=r.payload_length,
        accepted=r.accepted,
        reason=r.reason,
        received_ms=r.received_unix_ms,
    )


def verify_receipt(r: pb.Receipt, aggregator_key: bytes) -> bool:
    """True when `r` is signed by `aggregator_key` (learned from GetOpenRound or configuration)."""
    return receipt_body(r).verify(r.signature, aggregator_key)


NO_RESIDUAL = bytes(32)  # what a sender that trained nothing signs as its residual root (tools, tests)


def header_for(
    info: pb.RoundInfo,
    host: bytes,
    payload: bytes,
    tokens_trained: int,
    key: SigningKey,
    residual_root: bytes,
    timestamp_ms: int | None = None,
) -> pb.SubmitHeader:
    """The signed header of `payload` in `info`'s round; `residual_root`: the host's residual after the
    round's compress (`training.residual_commit.residual_root`; `zero_root` of the spec when it has none)."""
    sub = Submission(
        chain_id=info.chain_id,
        registry=info.registry,
        epoch=info.epoch,
        round=info.round,
        host=host,
        base_checkpoint_sha256=info.base_checkpoint_sha256,
        codec=info.codec,
        payload_sha256=hashlib.sha256(payload).digest(),
        payload_length=len(payload),
        tokens_trained=tokens_trained,
        timestamp_ms=time.time_ns() // 1_000_000 if timestamp_ms is None else timestamp_ms,
        residual_root=residual_root,
    )
    return header_pb(sub, sub.sign(key))


def header_pb(sub: Submission, signature: bytes) -> pb.SubmitHeader:
    return pb.SubmitHeader(
        chain_id=sub.chain_id,
        registry=sub.registry,
        epoch=sub.epoch,
        round=sub.round,
        host=sub.host,
        base_checkpoint_sha256=sub.base_checkpoint_sha256,
        codec=sub.codec,
        payload_sha256=sub.payload_sha256,
        payload_length=sub.payload_length,
        tokens_trained=sub.tokens_trained,
        timestamp_unix_ms=sub.timestamp_ms,
        signature=signature,
        residual_root=sub.residual_root,
    )
