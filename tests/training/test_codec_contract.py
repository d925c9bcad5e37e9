"""The decoders' contract, not only their survival: a payload altered anywhere is either refused with
`CodecError` or decodes to exactly what its bytes say.

"What its bytes say" is computed here by a reference decoder written from the format that
training/codecs.py documents (header, per-tensor numel, each codec's section), element by element in
numpy fp32 with the same single roundings: no code of the module under test is reused, not even its
spec digest or its shared mask. The reference refuses exactly what the format forbids (bad header, wrong
length or numel, negative or non-finite scales, code 0, non-zero padding bits, positions out of range
or not increasing, non-finite values), with the one-line message the decoder must give for the first
check that fails, and otherwise yields values that must equal the decoder's bit for bit. Lossless codecs must also round-trip: encoding what a payload decodes to gives the payload back.

Payloads are altered at every byte (one bit each, so every field and every bit position is hit), and at
random by hypothesis (several bytes, cut short, extended, a header field rewritten).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training.codecs import CodecError, get_codec

F32 = np.float32
U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Format:
    """One codec configuration as the format describes it (independent of training.codecs)."""

    name: str  # for get_codec
    kind: str  # fp32 | bf16 | quant | topk | mask
    codec_id: int
    params: tuple[int, int, int]
    bits: int = 0
    block: int = 0  # quant: elements per scale; topk: chunk; mask: values per step
    k: int = 0  # topk: entries per chunk; mask: stride
    seed: int = 0  # mask: round seed

    @property
    def base(self) -> str:
        return self.name.partition(":")[0]


FORMATS = [
    Format("fp32", "fp32", 1, (0, 0, 0)),
    Format("bf16", "bf16", 2, (0, 0, 0)),
    Format("int8:block=16", "quant", 3, (8, 16, 0), bits=8, block=16),
    Format("int4:block=8", "quant", 4, (4, 8, 0), bits=4, block=8),
    Format("topk:chunk=16,k=3,bits=2", "topk", 5, (16, 3, 2), bits=2, block=16, k=3),
    Format("topk:chunk=8,k=8,bits=8", "topk", 5, (8, 8, 8), bits=8, block=8, k=8),
    Format("topk:chunk=6,k=2,bits=1", "topk", 5, (6, 2, 1), bits=1, block=6, k=2),
    Format("topk:chunk=5,k=2,bits=4", "topk", 5, (5, 2, 4), bits=4, block=5, k=2),
    # 7-bit positions: the one code width where 8 % width == 1 (neither a whole byte nor its divisor)
    Format("topk:chunk=100,k=4,bits=2", "topk", 5, (100, 4, 2), bits=2, block=100, k=4),
    Format("mask:stride=3,bits=2,chunk=4,seed=5", "mask", 6, (3, 2 << 24 | 4, 5), bits=2, block=4, k=3, seed=5),
    Format("mask:stride=1,bits=8,chunk=7", "mask", 6, (1, 8 << 24 | 7, 0), bits=8, block=7, k=1),
    Format("mask:stride=2,bits=4,chunk=3,seed=7", "mask", 6, (2, 4 << 24 | 3, 7), bits=4, block=3, k=2, seed=7),
]
NAMES_BY_ID = {1: "fp32", 2: "bf16", 3: "int8", 4: "int4", 5: "topk", 6: "mask"}
# A scalar, an empty tensor, sizes that leave partial blocks, chunks and code bytes.
SPECS = [
    {"w": (5, 7), "b": (7,)},
    {"a": (), "e": (0, 3), "z": (33,)},
    {"emb": (3, 17)},
]


class Refused(Exception):
    """The format forbids these bytes."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def digest(spec: dict[str, tuple[int, ...]]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(spec):
        h.update(name.encode() + b"\0" + ",".join(str(d) for d in spec[name]).encode() + b"\n")
    return h.digest()[:8]


def mask_positions(f: Format, numel: int, name: str) -> list[int]:
    cycle, phase = divmod(f.seed, f.k)
    key = int.from_bytes(hashlib.sha256(f"gonka-mask-v1:{name}:{cycle}".encode()).digest()[:8], "little")
    out = []
    for i in range(numel):
        x = ((i ^ key) + 0x9E3779B97F4A7C15) & U64  # SplitMix64's finaliser
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
        if (x ^ (x >> 31)) % f.k == phase:
            out.append(i)
    return out


def topk_layout(f: Format, numel: int) -> tuple[int, int, list[int]]:
    """(chunks, entries kept, entries kept per chunk)."""
    full, rest = divmod(numel, f.block)
    per_chunk = [f.k] * full + ([min(f.k, rest)] if rest else [])
    return len(per_chunk), sum(per_chunk), per_chunk


def index_bits(f: Format) -> int:
    return max(1, (f.block - 1).bit_length())


def section_size(f: Format, numel: int, name: str) -> int:
    if f.kind in ("fp32", "bf16"):
        return (4 if f.kind == "fp32" else 2) * numel
    if f.kind == "quant":
        return 4 * ceil_div(numel, f.block) + ceil_div(numel * f.bits, 8)
    if f.kind == "topk":
        chunks, kept, _ = topk_layout(f, numel)
        scales = 1 if f.bits == 1 else 2
        return 4 * scales * chunks + ceil_div(kept * index_bits(f), 8) + ceil_div(kept * f.bits, 8)
    sent = len(mask_positions(f, numel, name))
    return 4 * ceil_div(sent, f.block) + ceil_div(sent * f.bits, 8)


def codes(buf: bytes, count: int, width: int, where: str) -> list[int]:
    """`count` unsigned codes of `width` bits, least significant bit first; the padding must be zero."""
    if len(buf) != ceil_div(count * width, 8):
        raise AssertionError("reference: code bytes of the wrong length")
    bits = [(buf[i // 8] >> (i % 8)) & 1 for i in range(8 * len(buf))]
    if any(bits[count * width :]):
        raise Refused(f"{where} has non-zero padding bits")
    return [sum(bits[i * width + j] << j for j in range(width)) for i in range(count)]


def floats(buf: bytes) -> list[np.float32]:
    return [F32(v) for v in struct.unpack(f"<{len(buf) // 4}f", buf)]


def finite(values: list[np.float32], where: str) -> list[np.float32]:
    if not all(math.isfinite(float(v)) for v in values):
        raise Refused(f"{where} contains NaN or infinity")
    return values


def section(f: Format, buf: bytes, numel: int, name: str) -> list[np.float32]:
    where = f"{f.base} payload: tensor {name}"  # how every refusal of a section begins
    if f.kind == "fp32":
        return finite(floats(buf), where)
    if f.kind == "bf16":
        return finite(floats(b"".join(b"\0\0" + buf[i : i + 2] for i in range(0, len(buf), 2))), where)
    if f.kind == "quant":
        return quant_section(f, buf, numel, where)
    if f.kind == "topk":
        return topk_section(f, buf, numel, where)
    return mask_section(f, buf, numel, name, where)


def quant_section(f: Format, buf: bytes, numel: int, where: str) -> list[np.float32]:
    n_blocks = ceil_div(numel, f.block)
    scales = floats(buf[: 4 * n_blocks])
    if not all(math.isfinite(float(s)) and s >= 0 for s in scales):
        raise Refused(f"{where} has a negative or non-finite block scale")
    qmax = (1 << (f.bits - 1)) - 1
    cs = codes(buf[4 * n_blocks :], numel, f.bits, where)
    if 0 in cs:
        raise Refused(f"{where} has code 0, outside [-{qmax}, {qmax}]")
    return finite([F32(c - qmax - 1) * scales[i // f.block] for i, c in enumerate(cs)], where)


def topk_section(f: Format, buf: bytes, numel: int, where: str) -> list[np.float32]:
    chunks, kept, per_chunk = topk_layout(f, numel)
    n_scales = 1 if f.bits == 1 else 2
    scales = floats(buf[: 4 * n_scales * chunks])
    lo, hi = scales[0::n_scales], scales[n_scales - 1 :: n_scales]
    if not all(math.isfinite(float(s)) for s in scales) or any(a < 0 or b < a for a, b in zip(lo, hi, strict=True)):
        raise Refused(f"{where} has a non-finite or inconsistent chunk scale (need 0 ≤ lo ≤ hi)")
    at = 4 * n_scales * chunks
    idx_len = ceil_div(kept * index_bits(f), 8)
    positions = codes(buf[at : at + idx_len], kept, index_bits(f), where)
    values = codes(buf[at + idx_len :], kept, f.bits, where)
    starts = [sum(per_chunk[:c]) for c in range(chunks)]
    mine = [positions[s : s + n] for s, n in zip(starts, per_chunk, strict=True)]
    if any(p >= min(f.block, numel - c * f.block) for c, ps in enumerate(mine) for p in ps):
        raise Refused(f"{where} has a position out of range of its chunk")
    if any(b <= a for ps in mine for a, b in pairwise(ps)):
        raise Refused(f"{where} has positions not strictly increasing within a chunk")
    out = [F32(0.0)] * numel
    levels = (1 << (f.bits - 1)) - 1
    for c, ps in enumerate(mine):
        step = F32(hi[c] - lo[c]) / F32(levels) if levels else F32(0.0)
        for p, code in zip(ps, values[starts[c] : starts[c] + len(ps)], strict=True):
            mag = lo[c] if f.bits == 1 else F32(lo[c] + F32(F32(code & levels) * step))
            out[c * f.block + p] = -mag if code >> (f.bits - 1) == 1 else mag
    return finite(out, where)


def mask_section(f: Format, buf: bytes, numel: int, name: str, where: str) -> list[np.float32]:
    positions = mask_positions(f, numel, name)
    n_steps = ceil_div(len(positions), f.block)
    steps = floats(buf[: 4 * n_steps])
    if not all(math.isfinite(float(s)) and s >= 0 for s in steps):
        raise Refused(f"{where} has a negative or non-finite step")
    offset = F32(((1 << f.bits) - 1) / 2)
    cs = codes(buf[4 * n_steps :], len(positions), f.bits, where)
    values = [F32(F32(c) - offset) * steps[j // f.block] for j, c in enumerate(cs)]
    finite(values, where)
    out = [F32(0.0)] * numel
    for p, v in zip(positions, values, strict=True):
        out[p] = v
    return out


def reference(f: Format, data: bytes, spec: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """What `data` says under format `f` for `spec`; raises Refused, with the message the decoder must
    give, where the format forbids it (checks in the documented order: header, length, then tensors)."""
    if len(data) < 32:
        raise Refused(f"payload is {len(data)} bytes, shorter than the 32-byte codec header")
    magic, version, codec_id, reserved, p1, p2, p3, count, dig = struct.unpack_from("<4sBBHIIII8s", data)
    if magic != b"GNKC":
        raise Refused(f"bad magic {magic!r}: not a gonka codec payload (expected b'GNKC')")
    if version != 1:
        raise Refused(f"unsupported codec payload version {version} (this build reads 1)")
    if codec_id != f.codec_id:
        sent = NAMES_BY_ID.get(codec_id, f"unknown id {codec_id}")
        raise Refused(f"payload was encoded with codec {sent!r}, this decoder is {f.base!r}")
    if reserved != 0:
        raise Refused(f"reserved header field is {reserved}, must be 0")
    if (p1, p2, p3) != f.params:
        raise Refused(f"{f.base} payload parameters {(p1, p2, p3)} differ from the expected {f.params}")
    if count != len(spec) or dig != digest(spec):
        raise Refused(f"{f.base} payload was encoded for a different tensor spec ({count} tensors, digest {dig.hex()})")
    numels = {n: math.prod(s) for n, s in spec.items()}
    expected = 32 + sum(8 + section_size(f, numels[n], n) for n in spec)
    if len(data) != expected:
        kind = "truncated" if len(data) < expected else "trailing bytes"
        raise Refused(f"{f.base} payload is {len(data)} bytes, expected {expected} for this spec ({kind})")
    out, at = {}, 32
    for name in sorted(spec):
        claimed = struct.unpack_from("<Q", data, at)[0]
        if claimed != numels[name]:
            raise Refused(f"{f.base} payload: tensor {name} claims {claimed} elements, spec has {numels[name]}")
        size = section_size(f, numels[name], name)
        values = section(f, data[at + 8 : at + 8 + size], numels[name], name)
        out[name] = np.array(values, dtype=np.float32).reshape(spec[name])
        at += 8 + size
    return out


def payload(f: Format, spec: dict[str, tuple[int, ...]], seed: int, scale: float = 1.0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return get_codec(f.name).encode({n: torch.randn(s, generator=g) * scale for n, s in spec.items()})


def check(f: Format, spec: dict[str, tuple[int, ...]], data: bytes) -> bool:
    """Assert the contract on `data`; True when it decoded."""
    try:
        with np.errstate(over="ignore"):  # an overflow to infinity is refused below
            want = reference(f, data, spec)
    except Refused as why:
        with pytest.raises(CodecError) as refused:
            get_codec(f.name).decode(data, spec)
        assert str(refused.value) == str(why)  # the same refusal, named the same way
        return False
    got = get_codec(f.name).decode(data, spec)
    assert list(got) == sorted(spec)
    for name, t in got.items():
        assert t.dtype == torch.float32 and tuple(t.shape) == spec[name]
        assert np.array_equal(t.numpy().view(np.int32), want[name].view(np.int32)), f"{f.name}: {name} differs"
    if f.kind in ("fp32", "bf16"):  # a bijection on valid payloads: what it decodes to encodes back to it
        assert get_codec(f.name).encode(got) == data
    return True


@pytest.mark.parametrize("f", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("spec", SPECS, ids=["pair", "edges", "one"])
def test_every_byte_altered_is_refused_or_decoded_as_its_bytes_say(f: Format, spec: dict) -> None:
    data = payload(f, spec, 0)
    assert check(f, spec, data)  # the unaltered payload: the reference agrees with the encoder
    decoded = 0
    for at in range(len(data)):
        altered = bytearray(data)
        altered[at] ^= 1 << (at * 3 % 8)  # one bit of each byte, every bit position across the bytes
        decoded += check(f, spec, bytes(altered))
    assert decoded > 0  # body bits change values rather than all being refused


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = {"magic": (0, "4s"), "version": (4, "B"), "codec": (5, "B"), "reserved": (6, "H"), "p1": (8, "I"),
          "p2": (12, "I"), "p3": (16, "I"), "count": (20, "I")}


@FUZZ
@given(
    f=st.sampled_from(FORMATS),
    spec=st.sampled_from(SPECS),
    seed=st.integers(0, 1000),
    scale=st.sampled_from([0.0, 1e-30, 1.0, 1e30, 3e38]),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), max_size=6),
    cut=st.integers(0, 3),
    extra=st.binary(max_size=3),
)
def test_random_alterations_keep_the_contract(
    f: Format, spec: dict, seed: int, scale: float, flips: list[tuple[int, int]], cut: int, extra: bytes
) -> None:
    try:
        data = bytearray(payload(f, spec, seed, scale))
    except ValueError:  # 3e38 · randn overflows fp32: nothing to encode
        return
    for where, mask in flips:
        data[where % len(data)] ^= mask
    check(f, spec, bytes(data[: len(data) - cut]) + extra)


@FUZZ
@given(f=st.sampled_from(FORMATS), spec=st.sampled_from(SPECS), field=st.sampled_from(sorted(FIELDS)),
       value=st.integers(0, 2**32 - 1))
def test_a_rewritten_header_field_keeps_the_contract(f: Format, spec: dict, field: str, value: int) -> None:
    data = bytearray(payload(f, spec, 1))
    at, kind = FIELDS[field]
    width = struct.calcsize(kind)
    packed = value.to_bytes(4, "little")[:width] if kind != "4s" else value.to_bytes(4, "big")
    data[at : at + width] = packed
    check(f, spec, bytes(data))


@FUZZ
@given(f=st.sampled_from(FORMATS), spec=st.sampled_from(SPECS), seed=st.integers(0, 2**32 - 1))
def test_a_valid_header_over_a_random_body_keeps_the_contract(f: Format, spec: dict, seed: int) -> None:
    real = payload(f, spec, 0)
    body = np.random.default_rng(seed).integers(0, 256, len(real) - 32, dtype=np.uint8).tobytes()
    check(f, spec, real[:32] + body)


@pytest.mark.parametrize("bits", [8, 4])
def test_topk_magnitudes_that_round_past_fp32s_max_are_refused(bits: int) -> None:
    """Regression (found by the contract test): with hi at fp32's max, lo + levels·step rounds to
    infinity for 8-bit values; the decoder handed back an infinite tensor instead of refusing."""
    f = next(f for f in FORMATS if f.kind == "topk" and f.bits == bits)
    spec = {"w": (f.block,)}
    data = bytearray(payload(f, spec, 3))
    data[40:48] = np.array([0.0, 3.4028235e38], dtype="<f4").tobytes()  # chunk 0: lo = 0, hi = max
    refused = bits == 8  # 4 bits: 7·(max/7) rounds back to max, a finite value
    assert check(f, spec, bytes(data)) is not refused
    if refused:
        with pytest.raises(CodecError, match="contains NaN or infinity"):
            get_codec(f.name).decode(bytes(data), spec)
