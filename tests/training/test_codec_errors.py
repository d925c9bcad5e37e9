"""Each way a payload can be wrong raises its own `CodecError` subclass where the decoder detects it (the
aggregator tells reject reasons apart by class: tests/gonka_node/aggregator/test_validate.py), and the
mask codec builds each tensor's mask once per decode."""

from __future__ import annotations

import contextvars
import struct

import numpy as np
import pytest
import torch

from training.codecs import (
    HEADER_SIZE,
    CodecError,
    CodecIdError,
    HeaderError,
    MalformedSectionError,
    NonFiniteError,
    PayloadSizeError,
    SharedMaskCodec,
    SpecMismatchError,
    get_codec,
)

SPEC = {"b": (7,), "w": (5, 7)}


def _payload(codec: str) -> bytes:
    gen = torch.Generator().manual_seed(3)
    return get_codec(codec).encode({n: torch.randn(s, generator=gen) for n, s in SPEC.items()})


def _with(data: bytes, at: int, raw: bytes) -> bytes:
    return data[:at] + raw + data[at + len(raw) :]


INT8 = "int8:block=4"
FIRST_PART = HEADER_SIZE + 8  # the first tensor's section, after its numel
CASES: list[tuple[str, bytes, type[CodecError], str]] = [
    ("truncated", _payload(INT8)[:-1], PayloadSizeError, "truncated"),
    ("trailing", _payload(INT8) + b"\0", PayloadSizeError, "trailing bytes"),
    ("no header", b"GNKC", PayloadSizeError, "shorter than the 32-byte codec header"),
    ("magic", _with(_payload(INT8), 0, b"XXXX"), HeaderError, "bad magic"),
    ("other codec", _payload("int4:block=4"), CodecIdError, "encoded with codec 'int4'"),
    ("unknown id", _with(_payload(INT8), 5, b"\x63"), CodecIdError, "unknown id 99"),
    ("other spec", _with(_payload(INT8), HEADER_SIZE - 8, b"\0" * 8), SpecMismatchError, "different tensor spec"),
    ("numel", _with(_payload(INT8), HEADER_SIZE, struct.pack("<Q", 6)), SpecMismatchError, "claims 6 elements"),
    ("scale", _with(_payload(INT8), FIRST_PART, np.array([-1.0], "<f4").tobytes()), MalformedSectionError,
     "negative or non-finite block scale"),
    ("overflow", _with(_payload(INT8), FIRST_PART, np.array([3.0e38], "<f4").tobytes() + b"\x7f" * 4),
     NonFiniteError, "NaN or infinity"),
]


@pytest.mark.parametrize(("payload", "kind", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_defect_raises_its_class(payload: bytes, kind: type[CodecError], text: str) -> None:
    with pytest.raises(CodecError) as info:
        get_codec(INT8).decode(payload, SPEC)
    assert type(info.value) is kind and text in str(info.value)


class _CountingMask(SharedMaskCodec):
    built: list[str]

    def _build_mask(self, numel: int, name: str) -> torch.Tensor:
        self.built.append(name)
        return super()._build_mask(numel, name)


def test_the_mask_codec_builds_each_tensors_mask_once_per_decode() -> None:
    payload = _payload("mask:stride=3,bits=2,chunk=4")
    codec = _CountingMask(stride=3, bits=2, chunk=4)
    codec.built = []
    decoded = codec.decode(payload, SPEC)
    assert sorted(codec.built) == ["b", "w"]
    assert all(torch.equal(decoded[n], t) for n, t in get_codec("mask:stride=3,bits=2,chunk=4").decode(payload, SPEC).items())
    codec.decode(payload, SPEC)  # the next decode builds them again: nothing outlives a decode
    assert sorted(codec.built) == ["b", "b", "w", "w"]


def test_the_mask_codec_builds_each_tensors_mask_once_per_stream_of_parts() -> None:
    """`decode_parts` (what the aggregator's checks and a shard's close read) shares `decode`'s memo,
    even when the stream is read from another context (a thread's) than the one that opened it."""
    payload = _payload("mask:stride=3,bits=2,chunk=4")
    codec = _CountingMask(stride=3, bits=2, chunk=4)
    codec.built = []
    parts = codec.decode_parts(payload, SPEC)
    assert sorted(codec.built) == ["b", "w"]  # the size check
    streamed = dict(contextvars.copy_context().run(list, parts))
    assert sorted(codec.built) == ["b", "w"]
    assert all(torch.equal(streamed[n], t) for n, t in codec.decode(payload, SPEC).items())
