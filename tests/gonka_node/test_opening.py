"""gonka_node/core/opening.py: a challenged host's sample, its signed opening header and the body."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import pytest
import torch
from nacl.signing import SigningKey

from gonka_node.core.envelope import EnvelopeError
from gonka_node.core.opening import (
    OPENING_BYTES,
    OpeningError,
    OpeningRecord,
    challenge,
    challenge_seed,
    decode_body,
    encode_body,
    record_of,
    signed_opening,
)
from proto.gonka.v1 import aggregator_pb2 as pb
from training.residual_commit import ChunkLayout, open_chunks, residual_root, verify_opening

LAYOUT = ChunkLayout.of({"a": (10, 30), "b": (100,), "c": (5,)}, 64)  # 8 chunks of at most 64 elements
SEED = bytes(range(32))
HOST = b"\x11" * 20


def _residual(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(10, 30, generator=g), "b": torch.randn(100, generator=g), "c": torch.randn(5, generator=g)}


def _record(**kw: object) -> OpeningRecord:
    fields: dict[str, Any] = dict(
        chain_id=31337, registry=b"\x22" * 20, epoch=1, round=3, host=HOST, previous_root=b"\x01" * 32,
        residual_root=b"\x02" * 32, body_sha256=b"\x03" * 32, body_length=1000, timestamp_ms=1_700_000_000_000,
    )
    fields.update(kw)
    return OpeningRecord(**fields)


def test_the_record_is_fixed_width_and_every_field_is_signed() -> None:
    key = SigningKey(b"\x07" * 32)
    record = _record()
    assert len(record.canonical_bytes()) == OPENING_BYTES == 194
    assert record.canonical_bytes().startswith(b"gonka/opening\x00\x00\x00\x00\x01")
    signature = record.sign(key)
    public = bytes(key.verify_key)
    assert record.verify(signature, public)
    for name, other in (("round", 4), ("host", b"\x12" * 20), ("previous_root", b"\x09" * 32),
                        ("residual_root", b"\x09" * 32), ("body_sha256", b"\x09" * 32), ("body_length", 1001),
                        ("timestamp_ms", 1), ("epoch", 2), ("chain_id", 1), ("registry", b"\x23" * 20)):
        assert not replace(record, **{name: other}).verify(signature, public), name


@pytest.mark.parametrize("field, value", [("previous_root", b"\x01" * 31), ("host", b"\x11" * 21),
                                          ("body_sha256", b""), ("body_length", -1), ("round", 2**64)])
def test_a_field_of_the_wrong_width_is_refused(field: str, value: object) -> None:
    with pytest.raises(EnvelopeError, match=field):
        _record(**{field: value})


def test_the_challenge_is_the_seeds_per_host_and_round_and_counts_its_minimum_in_elements() -> None:
    picked = challenge(SEED, 3, HOST, LAYOUT, 0.01, 1)
    assert len(picked) == 1 and picked == tuple(sorted(picked))
    # The same sample_chunks draw over this host's and round's seed: recomputable by anyone.
    digest = hashlib.sha256(b"gonka-residual-challenge-v1" + SEED + (3).to_bytes(8, "big") + HOST).digest()
    assert challenge_seed(SEED, 3, HOST) == digest
    # 129 elements need 3 chunks of 64; a fraction above the minimum wins.
    assert len(challenge(SEED, 3, HOST, LAYOUT, 0.01, 129)) == 3
    assert len(challenge(SEED, 3, HOST, LAYOUT, 0.5, 1)) == 4
    draws = {challenge(SEED, r, h, LAYOUT, 0.25, 1) for r in range(4) for h in (HOST, b"\x12" * 20)}
    assert len(draws) > 1  # not one fixed sample for every host and round


def test_a_body_round_trips_and_verifies_against_both_roots() -> None:
    before, after = _residual(1), _residual(2)
    sample = challenge(SEED, 3, HOST, LAYOUT, 0.3, 1)
    body = encode_body(open_chunks(before, LAYOUT, sample), open_chunks(after, LAYOUT, sample))
    previous, current = decode_body(body, sample)
    assert verify_opening(residual_root(before, LAYOUT), previous, LAYOUT, sample)
    assert verify_opening(residual_root(after, LAYOUT), current, LAYOUT, sample)
    assert not verify_opening(residual_root(after, LAYOUT), previous, LAYOUT, sample)


def test_a_body_that_is_not_the_challenges_answer_is_refused() -> None:
    before, after = _residual(1), _residual(2)
    with pytest.raises(OpeningError, match="same chunks"):
        encode_body(open_chunks(before, LAYOUT, (1, 2)), open_chunks(after, LAYOUT, (1, 3)))
    body = encode_body(open_chunks(before, LAYOUT, (1, 2)), open_chunks(after, LAYOUT, (1, 2)))
    with pytest.raises(OpeningError, match="not the challenge's 3"):
        decode_body(body, (1, 2, 5))
    reordered = pb.ResidualOpening()
    reordered.ParseFromString(body)
    reordered.chunks[0].index, reordered.chunks[1].index = 2, 1
    with pytest.raises(OpeningError, match="ascending"):
        decode_body(reordered.SerializeToString(), (1, 2))
    with pytest.raises(OpeningError, match="not a ResidualOpening"):
        decode_body(b"\xff\xff\xff", (1, 2))


def test_a_signed_header_rebuilds_the_record_its_signature_covers() -> None:
    key = SigningKey(b"\x08" * 32)
    info = pb.RoundInfo(chain_id=31337, registry=b"\x22" * 20, epoch=2, round=5)
    body = b"opening body"
    header = signed_opening(info, 4, HOST, b"\x01" * 32, b"\x02" * 32, body, key)
    record = record_of(header)
    assert (record.round, record.epoch, record.body_length) == (4, 2, len(body))
    assert record.body_sha256 == hashlib.sha256(body).digest()
    assert record.verify(header.signature, bytes(key.verify_key))
    header.residual_root = b"\x03" * 32
    assert not record_of(header).verify(header.signature, bytes(key.verify_key))
    header.previous_root = b"\x03" * 31
    with pytest.raises(EnvelopeError, match="previous_root"):
        record_of(header)
