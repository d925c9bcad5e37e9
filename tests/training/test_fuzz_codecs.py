"""Property-based tests of every codec's decoder: any byte string decodes to the spec or raises CodecError.

"Valid" means: exactly the spec's names and shapes, fp32, every value finite, and the same bits when
decoded twice. Inputs come in three families, because uniformly random bytes almost never get past the
32-byte header: arbitrary bytes; a correct header followed by a random body of exactly the right size
(so every section decoder sees garbage); and a real payload with bytes flipped, cut off or appended.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.codecs import HEADER_SIZE, CodecError, get_codec

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODECS = ["fp32", "bf16", "int8:block=16", "int4:block=8", "topk:chunk=16,k=3,bits=2",
          "topk:chunk=8,k=8,bits=8", "mask:stride=3,bits=2,chunk=4,seed=5", "mask:stride=1,bits=8,chunk=7"]
# Shapes with a scalar, an empty tensor and sizes that leave partial blocks/chunks.
SPECS = [
    {"w": (5, 7), "b": (7,)},
    {"a": (), "e": (0, 3), "z": (33,)},
    {"emb": (3, 17)},
]


def _decode_or_codec_error(codec_name: str, spec: dict[str, tuple[int, ...]], data: bytes) -> None:
    codec = get_codec(codec_name)
    try:
        out = codec.decode(data, spec)
    except CodecError as exc:
        assert str(exc)  # names what is wrong
        return
    assert set(out) == set(spec)
    for name, t in out.items():
        assert t.dtype == torch.float32 and tuple(t.shape) == spec[name]
        assert bool(torch.isfinite(t).all()), f"{codec_name} decoded a non-finite value in {name}"
    again = codec.decode(data, spec)  # decoding is a pure function of the bytes
    for name in out:
        assert torch.equal(out[name].view(torch.int32), again[name].view(torch.int32))


def _payload(codec_name: str, spec: dict[str, tuple[int, ...]], seed: int, scale: float) -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=g) * scale for n, s in spec.items()}
    return get_codec(codec_name).encode(tensors)


@FUZZ
@given(codec=st.sampled_from(CODECS), spec=st.sampled_from(SPECS), data=st.binary(max_size=400))
def test_arbitrary_bytes_decode_or_raise_codec_error(codec: str, spec: dict, data: bytes) -> None:
    _decode_or_codec_error(codec, spec, data)


@FUZZ
@given(codec=st.sampled_from(CODECS), spec=st.sampled_from(SPECS), seed=st.integers(0, 2**32 - 1))
def test_a_valid_header_with_a_random_body_decodes_or_raises_codec_error(
    codec: str, spec: dict, seed: int
) -> None:
    real = _payload(codec, spec, 0, 1.0)
    body = np.random.default_rng(seed).integers(0, 256, len(real) - HEADER_SIZE, dtype=np.uint8).tobytes()
    _decode_or_codec_error(codec, spec, real[:HEADER_SIZE] + body)


@FUZZ
@given(
    codec=st.sampled_from(CODECS),
    spec=st.sampled_from(SPECS),
    seed=st.integers(0, 1000),
    scale=st.sampled_from([1e-30, 1.0, 1e30, 1e37]),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), max_size=4),
    cut=st.integers(min_value=0, max_value=8),
    extra=st.binary(max_size=8),
)
def test_mutated_payloads_decode_or_raise_codec_error(
    codec: str, spec: dict, seed: int, scale: float, flips: list[tuple[int, int]], cut: int, extra: bytes
) -> None:
    data = bytearray(_payload(codec, spec, seed, scale))
    for where, mask in flips:
        data[where % len(data)] ^= mask
    _decode_or_codec_error(codec, spec, bytes(data[: len(data) - cut]) + extra)


@FUZZ
@given(codec=st.sampled_from(CODECS), spec=st.sampled_from(SPECS), seed=st.integers(0, 1000))
def test_payloads_for_another_spec_are_refused(codec: str, spec: dict, seed: int) -> None:
    other = next(s for s in SPECS if s is not spec)
    with pytest.raises(CodecError):
        get_codec(codec).decode(_payload(codec, spec, seed, 1.0), other)


@pytest.mark.parametrize("codec", ["int8:block=4", "int4:block=4", "mask:stride=1,bits=8,chunk=4"])
def test_a_scale_near_fp32_max_that_overflows_is_a_codec_error(codec: str) -> None:
    """Regression: a finite block scale (or step) times the largest code overflows to infinity; the
    decoder must refuse that payload rather than hand back an infinite tensor."""
    spec = {"w": (4,)}
    data = bytearray(_payload(codec, spec, 1, 1.0))
    scale_at = HEADER_SIZE + 8  # the first fp32 after the tensor's numel
    data[scale_at : scale_at + 4] = np.array([3.0e38], dtype="<f4").tobytes()
    data[scale_at + 4 :] = b"\xff" * (len(data) - scale_at - 4)  # the largest code of every width
    with pytest.raises(CodecError, match="NaN or infinity"):
        get_codec(codec).decode(bytes(data), spec)
