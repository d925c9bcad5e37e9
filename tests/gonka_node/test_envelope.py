"""The canonical submission/receipt bytes: exact layout, signatures, and every field bound."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from nacl.signing import SigningKey

from gonka_node.core.envelope import (
    RECEIPT_BYTES,
    SUBMISSION_BYTES,
    EnvelopeError,
    ReceiptBody,
    Submission,
)


def make_submission(**overrides: object) -> Submission:
    fields: dict[str, object] = dict(
        chain_id=31337,
        registry=bytes(range(20)),
        epoch=7,
        round=3,
        host=bytes(range(100, 120)),
        base_checkpoint_sha256=hashlib.sha256(b"base").digest(),
        codec="topk:chunk=4096,k=32,bits=2",
        payload_sha256=hashlib.sha256(b"payload").digest(),
        payload_length=123_456,
        tokens_trained=65_536,
        timestamp_ms=1_700_000_000_123,
        residual_root=hashlib.sha256(b"residual").digest(),
    )
    fields.update(overrides)
    return Submission(**fields)  # type: ignore[arg-type]


def test_submission_layout_matches_the_documented_offsets() -> None:
    s = make_submission()
    raw = s.canonical_bytes()
    assert len(raw) == SUBMISSION_BYTES == 266
    assert raw[0:16] == b"gonka/submission"
    assert raw[16:18] == b"\x00\x02"
    assert raw[18:26] == (31337).to_bytes(8, "big")
    assert raw[26:46] == bytes(range(20))
    assert raw[46:54] == (7).to_bytes(8, "big")
    assert raw[54:62] == (3).to_bytes(8, "big")
    assert raw[62:82] == bytes(range(100, 120))
    assert raw[82:114] == hashlib.sha256(b"base").digest()
    codec = b"topk:chunk=4096,k=32,bits=2"
    assert raw[114:178] == codec + b"\x00" * (64 - len(codec))
    assert raw[178:210] == hashlib.sha256(b"payload").digest()
    assert raw[210:218] == (123_456).to_bytes(8, "big")
    assert raw[218:226] == (65_536).to_bytes(8, "big")
    assert raw[226:234] == (1_700_000_000_123).to_bytes(8, "big")
    assert raw[234:266] == hashlib.sha256(b"residual").digest()


def test_submission_golden_digest() -> None:
    # Pins the layout: any change to field order, widths or tag changes this digest (and breaks
    # every deployed host), so it must be a deliberate version bump.
    digest = hashlib.sha256(make_submission().canonical_bytes()).hexdigest()
    assert digest == GOLDEN_SUBMISSION_SHA256


# Layout 2, computed by concatenating the documented fields by hand (tag, u16 2, the twelve fields, the
# root), not from this code; the same construction with version 1 and no root gives layout 1's digest,
# cc87088d…f1df52, which this test pinned before.
GOLDEN_SUBMISSION_SHA256 = "19fbbb81bc64925a77c5e54ea582a3a70e918ed9492e5fe788c3ba2f44595e96"


def layout_1_bytes(s: Submission) -> bytes:
    """Layout 1 as it was: version 1, no residual root (what a host signed before residual commitments)."""
    return b"gonka/submission" + (1).to_bytes(2, "big") + s.canonical_bytes()[18:234]


def test_a_signature_over_layout_1_does_not_verify() -> None:
    key = SigningKey(b"\x01" * 32)
    s = make_submission()
    old = key.sign(layout_1_bytes(s)).signature
    assert hashlib.sha256(layout_1_bytes(s)).hexdigest().startswith("cc87088d")  # the bytes are layout 1's
    assert not s.verify(old, bytes(key.verify_key))
    assert s.verify(s.sign(key), bytes(key.verify_key))


def test_signature_verifies_and_binds_every_field() -> None:
    key = SigningKey(b"\x01" * 32)
    pub = bytes(key.verify_key)
    s = make_submission()
    sig = s.sign(key)
    assert len(sig) == 64
    assert s.verify(sig, pub)
    changed = {
        "chain_id": 1,
        "registry": b"\xff" * 20,
        "epoch": 8,
        "round": 4,
        "host": b"\xee" * 20,
        "base_checkpoint_sha256": b"\x00" * 32,
        "codec": "fp32",
        "payload_sha256": b"\x11" * 32,
        "payload_length": 123_457,
        "tokens_trained": 1,
        "timestamp_ms": 1,
        "residual_root": b"\x00" * 32,
    }
    for name, value in changed.items():
        assert not dataclasses.replace(s, **{name: value}).verify(sig, pub), name


def test_verify_rejects_wrong_key_and_malformed_inputs() -> None:
    s = make_submission()
    sig = s.sign(SigningKey(b"\x01" * 32))
    assert not s.verify(sig, bytes(SigningKey(b"\x02" * 32).verify_key))
    assert not s.verify(sig[:63], bytes(SigningKey(b"\x01" * 32).verify_key))
    assert not s.verify(sig, b"\x00" * 31)
    # Not a curve point: must read as "does not verify", not crash the server.
    assert not s.verify(sig, b"\xff" * 32)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("registry", b"\x00" * 19, "registry must be 20 bytes"),
        ("host", b"\x00" * 32, "host must be 20 bytes"),
        ("payload_sha256", b"", "payload_sha256 must be 32 bytes"),
        ("residual_root", b"", "residual_root must be 32 bytes"),
        ("residual_root", b"\x00" * 33, "residual_root must be 32 bytes"),
        ("epoch", -1, "epoch must be an integer"),
        ("round", 2**64, "round must be an integer"),
        ("codec", "", "codec must be"),
        ("codec", "x" * 65, "codec must be"),
        ("codec", "top k", "codec must be"),
        ("codec", "tøpk", "codec must be"),
    ],
)
def test_out_of_layout_fields_are_refused(field: str, value: object, match: str) -> None:
    with pytest.raises(EnvelopeError, match=match):
        make_submission(**{field: value})


def test_receipt_layout_and_signature() -> None:
    body = ReceiptBody(
        chain_id=31337,
        registry=bytes(range(20)),
        epoch=7,
        round=3,
        host=bytes(range(100, 120)),
        payload_sha256=b"\x22" * 32,
        payload_length=99,
        accepted=False,
        reason=11,
        received_ms=5,
    )
    raw = body.canonical_bytes()
    assert len(raw) == RECEIPT_BYTES == 133
    assert raw[:16] == b"gonka/receipt\x00\x00\x00"
    assert raw[122] == 0 and raw[123:125] == (11).to_bytes(2, "big")
    assert dataclasses.replace(body, accepted=True, reason=0).canonical_bytes()[122:125] == b"\x01\x00\x00"
    key = SigningKey(b"\x03" * 32)
    sig = body.sign(key)
    assert body.verify(sig, bytes(key.verify_key))
    assert not dataclasses.replace(body, accepted=True).verify(sig, bytes(key.verify_key))
    # The two record kinds cannot be confused: different tags and lengths.
    assert raw[:16] != make_submission().canonical_bytes()[:16]
