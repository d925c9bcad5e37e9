"""Property-based tests of the canonical envelope and of the protobuf header that feeds it.

Claims: whatever the field values, building a `Submission`/`ReceiptBody` either succeeds with a
266/133-byte record that unpacks to the same fields, or raises `EnvelopeError` (never another
exception); the server's header parser (`submission_from_pb`) turns any decodable `SubmitRequest` into
a `Submission` or a MALFORMED rejection; and a signature verifies only over the exact bytes it signed —
any flipped bit in the record, the signature or the key makes `verify` return False, never raise.
"""

from __future__ import annotations

import struct

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.server import submission_from_pb
from gonka_node.core.envelope import (
    RECEIPT_BYTES,
    SUBMISSION_BYTES,
    SUBMISSION_TAG,
    EnvelopeError,
    ReceiptBody,
    Submission,
    encode_codec,
)
from proto.gonka.v1 import aggregator_pb2 as pb

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = SigningKey(b"\x07" * 32)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
ANY_INT = st.one_of(U64, st.integers(min_value=-(2**70), max_value=2**70))
# Mostly the right width, sometimes not: the interesting inputs are the near misses.
def width(n: int) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(min_size=n, max_size=n), st.binary(max_size=n + 3))


CODEC = st.one_of(
    st.sampled_from(["int8", "fp32", "topk:chunk=64,k=4", "x" * 64]),
    st.text(max_size=70),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64),
)


def valid_submissions() -> st.SearchStrategy[Submission]:
    return st.builds(
        Submission,
        chain_id=U64,
        registry=st.binary(min_size=20, max_size=20),
        epoch=U64,
        round=U64,
        host=st.binary(min_size=20, max_size=20),
        base_checkpoint_sha256=st.binary(min_size=32, max_size=32),
        codec=st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64),
        payload_sha256=st.binary(min_size=32, max_size=32),
        payload_length=U64,
        tokens_trained=U64,
        timestamp_ms=U64,
        residual_root=st.binary(min_size=32, max_size=32),
    )


@FUZZ
@given(
    chain_id=ANY_INT, registry=width(20), epoch=ANY_INT, round_=ANY_INT, host=width(20),
    base=width(32), codec=CODEC, digest=width(32), length=ANY_INT, tokens=ANY_INT, ts=ANY_INT, root=width(32),
)
def test_any_field_values_build_a_canonical_record_or_raise_envelope_error(
    chain_id: int, registry: bytes, epoch: int, round_: int, host: bytes, base: bytes, codec: str,
    digest: bytes, length: int, tokens: int, ts: int, root: bytes,
) -> None:
    try:
        sub = Submission(chain_id, registry, epoch, round_, host, base, codec, digest, length, tokens, ts, root)
    except EnvelopeError:
        return
    raw = sub.canonical_bytes()
    assert len(raw) == SUBMISSION_BYTES
    fields = struct.unpack(">16sHQ20sQQ20s32s64s32sQQQ32s", raw)
    assert fields[0] == SUBMISSION_TAG and fields[1] == 2
    assert fields[2:8] == (chain_id, registry, epoch, round_, host, base)
    assert fields[8].rstrip(b"\x00").decode("ascii") == codec
    assert fields[9:] == (digest, length, tokens, ts, root)


@FUZZ
@given(codec=st.text(max_size=80))
def test_codec_field_is_64_printable_bytes_or_envelope_error(codec: str) -> None:
    try:
        field = encode_codec(codec)
    except EnvelopeError:
        printable = codec.isascii() and 1 <= len(codec) <= 64 and all(0x21 <= ord(c) <= 0x7E for c in codec)
        assert not printable
        return
    assert len(field) == 64 and field.rstrip(b"\x00").decode("ascii") == codec


@FUZZ
@given(data=st.binary(max_size=600))
def test_any_bytes_parse_to_a_submission_or_a_malformed_rejection(data: bytes) -> None:
    """What the server does with one request message off the wire, whatever its bytes."""
    try:
        msg = pb.SubmitRequest.FromString(data)
    except DecodeError:
        return  # grpc answers INTERNAL for an undeserializable request; no handler code runs
    if msg.WhichOneof("part") != "header":
        return
    try:
        sub = submission_from_pb(msg.header)
    except Rejected as exc:
        assert exc.reason is Reason.MALFORMED and exc.message.startswith("header: ")
        return
    assert len(sub.canonical_bytes()) == SUBMISSION_BYTES


@FUZZ
@given(
    header=st.builds(
        pb.SubmitHeader,
        chain_id=U64, registry=width(20), epoch=U64, round=U64, host=width(20),
        base_checkpoint_sha256=width(32), codec=CODEC, payload_sha256=width(32),
        payload_length=U64, tokens_trained=U64, timestamp_unix_ms=U64, signature=width(64),
        residual_root=width(32),
    )
)
def test_protobuf_headers_round_trip_through_the_parser(header: pb.SubmitHeader) -> None:
    wire = pb.SubmitRequest(header=header).SerializeToString()
    parsed = pb.SubmitRequest.FromString(wire).header
    try:
        sub = submission_from_pb(parsed)
    except Rejected as exc:
        assert exc.reason is Reason.MALFORMED
        return
    assert (sub.chain_id, sub.registry, sub.epoch, sub.round, sub.host) == (
        header.chain_id, header.registry, header.epoch, header.round, header.host,
    )
    assert (sub.payload_sha256, sub.payload_length, sub.timestamp_ms, sub.residual_root) == (
        header.payload_sha256, header.payload_length, header.timestamp_unix_ms, header.residual_root,
    )


@FUZZ
@given(sub=valid_submissions(), where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_a_signature_covers_every_bit_of_the_record(sub: Submission, where: int, bit: int) -> None:
    sig = sub.sign(KEY)
    pub = bytes(KEY.verify_key)
    assert sub.verify(sig, pub)
    raw = bytearray(sub.canonical_bytes())
    raw[where % len(raw)] ^= 1 << bit
    assert not _verify_raw(bytes(raw), sig, pub)
    bad_sig = bytearray(sig)
    bad_sig[where % 64] ^= 1 << bit
    assert not sub.verify(bytes(bad_sig), pub)
    bad_key = bytearray(pub)
    bad_key[where % 32] ^= 1 << bit
    assert not sub.verify(sig, bytes(bad_key))  # another key, or not a curve point: False, no exception


@FUZZ
@given(sub=valid_submissions(), sig=st.binary(max_size=80), key=st.binary(max_size=40))
def test_verify_never_raises_on_arbitrary_signature_and_key_bytes(sub: Submission, sig: bytes, key: bytes) -> None:
    assert sub.verify(sig, key) in (True, False)
    assert not sub.verify(sig, key) or (len(sig) == 64 and len(key) == 32)


@FUZZ
@given(
    chain_id=ANY_INT, registry=width(20), epoch=ANY_INT, round_=ANY_INT, host=width(20),
    digest=width(32), length=ANY_INT, accepted=st.booleans(),
    reason=st.integers(min_value=-5, max_value=70_000), ts=ANY_INT,
)
def test_receipt_bodies_are_133_bytes_or_envelope_error(
    chain_id: int, registry: bytes, epoch: int, round_: int, host: bytes, digest: bytes, length: int,
    accepted: bool, reason: int, ts: int,
) -> None:
    try:
        body = ReceiptBody(chain_id, registry, epoch, round_, host, digest, length, accepted, reason, ts)
    except EnvelopeError:
        return
    raw = body.canonical_bytes()
    assert len(raw) == RECEIPT_BYTES
    assert struct.unpack(">16sHQ20sQQ20s32sQBHQ", raw)[2:] == (
        chain_id, registry, epoch, round_, host, digest, length, int(accepted), reason, ts,
    )
    assert body.verify(body.sign(KEY), bytes(KEY.verify_key))


def _verify_raw(message: bytes, sig: bytes, pub: bytes) -> bool:
    from nacl.exceptions import BadSignatureError
    from nacl.signing import VerifyKey

    try:
        VerifyKey(pub).verify(message, sig)
    except BadSignatureError:
        return False
    return True


@pytest.mark.parametrize("codec", ["\ud800", "int8\udcff"])
def test_unencodable_codec_strings_are_envelope_errors(codec: str) -> None:
    """Lone surrogates cannot be UTF-8: the documented error, not a UnicodeEncodeError."""
    with pytest.raises(EnvelopeError):
        encode_codec(codec)
