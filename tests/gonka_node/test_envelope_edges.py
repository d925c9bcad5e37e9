"""The envelope's field checks at their exact bounds, and refusals that name the field and what it got."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest

from gonka_node.core.envelope import EnvelopeError, ReceiptBody, Submission, encode_codec


def submission(**overrides: object) -> Submission:
    fields: dict[str, object] = dict(
        chain_id=1, registry=bytes(20), epoch=1, round=1, host=bytes(20),
        base_checkpoint_sha256=hashlib.sha256(b"base").digest(), codec="int8",
        payload_sha256=hashlib.sha256(b"payload").digest(), payload_length=1, tokens_trained=0, timestamp_ms=0,
        residual_root=bytes(32),
    )
    return Submission(**{**fields, **overrides})  # type: ignore[arg-type]


def receipt(**overrides: object) -> ReceiptBody:
    fields: dict[str, object] = dict(
        chain_id=1, registry=bytes(20), epoch=1, round=1, host=bytes(20), payload_sha256=bytes(32),
        payload_length=1, accepted=True, reason=0, received_ms=0,
    )
    return ReceiptBody(**{**fields, **overrides})  # type: ignore[arg-type]


BYTE_FIELDS = [("registry", 20), ("host", 20), ("base_checkpoint_sha256", 32), ("payload_sha256", 32),
               ("residual_root", 32)]
INT_FIELDS = ["chain_id", "epoch", "round", "payload_length", "tokens_trained", "timestamp_ms"]


@pytest.mark.parametrize(("make", "field", "width"), [
    *((submission, f, w) for f, w in BYTE_FIELDS),
    *((receipt, f, w) for f, w in BYTE_FIELDS if f not in ("base_checkpoint_sha256", "residual_root")),
])
def test_a_byte_field_of_another_width_or_type_is_refused_by_name(make, field: str, width: int) -> None:
    with pytest.raises(EnvelopeError, match=rf"^{field} must be {width} bytes, got {width - 1}$"):
        make(**{field: bytes(width - 1)})
    with pytest.raises(EnvelopeError, match=rf"^{field} must be {width} bytes, got str$"):
        make(**{field: "00" * width})
    assert make(**{field: bytearray(width)})  # a bytearray of the width is fine


@pytest.mark.parametrize(("make", "field"), [
    *((submission, f) for f in INT_FIELDS),
    *((receipt, f) for f in INT_FIELDS if f not in ("tokens_trained", "timestamp_ms")),
    (receipt, "received_ms"),
])
@pytest.mark.parametrize("value", [-1, 2**64, 1.0, True, "1"])
def test_an_integer_field_out_of_u64_or_not_an_int_is_refused_by_name(make, field: str, value: object) -> None:
    with pytest.raises(EnvelopeError, match=rf"^{field} must be an integer in \[0, 2\^64\), got {value!r}$"):
        make(**{field: value})


@pytest.mark.parametrize("field", INT_FIELDS)
def test_u64_bounds_are_inclusive(field: str) -> None:
    for value in (0, 2**64 - 1):
        assert len(submission(**{field: value}).canonical_bytes()) == 266


def test_codec_strings_of_one_to_64_printable_bytes() -> None:
    assert encode_codec("x" * 64) == b"x" * 64 and encode_codec("!") == b"!" + bytes(63)
    assert encode_codec("~") == b"~" + bytes(63)
    for bad in ("", "x" * 65, "int8\x7f", "int8 ", "\x20", "int8\x00", "é", "\ud800"):
        with pytest.raises(EnvelopeError, match=rf"^codec must be 1\.\.64 printable ASCII characters without spaces, got {re.escape(repr(bad))}$"):
            encode_codec(bad)


def test_receipt_reasons_fill_uint16_and_no_more() -> None:
    assert receipt(reason=0).canonical_bytes()[123:125] == b"\x00\x00"
    assert receipt(reason=0xFFFF, accepted=False).canonical_bytes()[123:125] == b"\xff\xff"
    for bad in (-1, 0x10000):
        with pytest.raises(EnvelopeError, match=rf"^reason must fit in uint16, got {bad}$"):
            receipt(reason=bad)


def test_verify_is_false_for_signatures_or_keys_of_the_wrong_length() -> None:
    from nacl.signing import SigningKey

    key = SigningKey(b"\x05" * 32)
    body = submission()
    sig, public = body.sign(key), bytes(key.verify_key)
    assert body.verify(sig, public)
    # A valid signature over one more byte, with that byte appended, is no signature over these bytes.
    longer = key.sign(b"\x00" + body.canonical_bytes()).signature + b"\x00"
    assert not body.verify(longer, public)
    assert not body.verify(sig[:-1], public) and not body.verify(sig, public + b"\x00")
    assert not body.verify(sig, public[:-1]) and not dataclasses.replace(body, epoch=2).verify(sig, public)
