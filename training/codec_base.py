"""The payload format every codec shares (`training.codecs` for the overview): the 32-byte header, the
errors a decoder raises, the `Codec` interface, and the bit-packing and checking helpers the codecs use."""

from __future__ import annotations

import hashlib
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch import Tensor

MAGIC = b"GNKC"
VERSION = 1
_HEADER = struct.Struct("<4sBBHIIII8s")
_NUMEL = struct.Struct("<Q")
HEADER_SIZE = _HEADER.size  # 32

Spec = Mapping[str, tuple[int, ...]]
# The id each codec's payload header carries (its factory is in `training.codecs.CODECS`).
CODEC_IDS = {"fp32": 1, "bf16": 2, "int8": 3, "int4": 4, "topk": 5, "mask": 6}
_BY_ID = {codec_id: name for name, codec_id in CODEC_IDS.items()}


class CodecError(ValueError):
    """A payload that cannot be what the sender should have produced; a subclass says which way."""


class PayloadSizeError(CodecError):
    """The payload, or a tensor's part, is not the size the codec and the spec give (truncated, trailing)."""


class HeaderError(CodecError):
    """Not this codec's header: magic, version, reserved field or parameters differ."""


class CodecIdError(HeaderError):
    """The header names another codec, or an id no codec has."""


class SpecMismatchError(CodecError):
    """Encoded for other tensors: the header's tensor count or spec digest, or a tensor's element count."""


class NonFiniteError(CodecError):
    """Decoded values include NaN or infinity."""


class MalformedSectionError(CodecError):
    """A tensor's section holds what no encoder writes: bad scales, codes, positions or padding bits."""


def spec_of(tensors: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """The spec (name → shape) that `decode` needs to read what `encode(tensors)` wrote."""
    return {name: tuple(t.shape) for name, t in tensors.items()}


def spec_digest(spec: Spec) -> bytes:
    """8 bytes identifying the names and shapes, so a payload for another model is rejected up front."""
    h = hashlib.sha256()
    for name in sorted(spec):
        h.update(name.encode() + b"\0" + ",".join(str(d) for d in spec[name]).encode() + b"\n")
    return h.digest()[:8]


class Codec(ABC):
    """Encode named fp32 tensors to bytes and back. Subclasses define one tensor's section."""

    name: str
    # True for a codec whose honest payload is mostly the host's private error-feedback residual (sparse
    # top-k: C(d·e_{r−1} + Δ)), so a replay cannot compare its decode with the round's Δ, and which bounds
    # the residual it leaves (`residual_misfit`): the replay then opens the residual instead
    # (training/residual_commit.py; docs/PROTOCOL.md "Challenge and opening").
    opens_residual: bool = False
    # True for a codec whose decoded tensors are nearly all exact zeros (top-k: 1/32 of the entries): an
    # outer step with such an update is worth taking ahead of it and finishing on its entries alone
    # (`training.diloco.SpeculativeStep`).
    sparse: bool = False

    @property
    def codec_id(self) -> int:
        """The id every payload header carries (`CODEC_IDS`)."""
        return CODEC_IDS[self.name]

    @abstractmethod
    def params(self) -> tuple[int, int, int]:
        """The three header parameters; a payload whose parameters differ is rejected."""

    @abstractmethod
    def section_size(self, numel: int, name: str = "") -> int:
        """Exact bytes of one tensor's section (data-independent; `name` for codecs whose layout uses it)."""

    @abstractmethod
    def _encode_flat(self, x: Tensor, name: str) -> bytes:
        """One flat fp32 CPU tensor to exactly `section_size(x.numel())` bytes."""

    @abstractmethod
    def _decode_flat(self, buf: memoryview, numel: int, name: str) -> Tensor:
        """One section (already of the right length) to a flat fp32 tensor; raise CodecError on garbage."""

    def for_round(self, round_seed: int) -> Codec:
        """The codec to use in the round with this public seed; only codecs with shared state differ."""
        return self

    def encoded_size(self, spec: Spec) -> int:
        return HEADER_SIZE + sum(_NUMEL.size + self.section_size(_numel(spec[n], n), n) for n in spec)

    def encode(self, tensors: Mapping[str, Tensor]) -> bytes:
        out = [self.header(spec_of(tensors))]
        out += [self.encode_tensor(name, tensors[name]) for name in sorted(tensors)]
        return b"".join(out)

    def header(self, spec: Spec) -> bytes:
        """The payload's first `HEADER_SIZE` bytes for tensors of `spec`."""
        return _HEADER.pack(MAGIC, VERSION, self.codec_id, 0, *self.params(), len(spec), spec_digest(spec))

    def encode_tensor(self, name: str, tensor: Tensor) -> bytes:
        """One tensor's part of the payload (numel, then its section). A payload is the header and the
        parts in sorted name order: parts depend on nothing else, so a rig's processes can each encode
        the tensors they own and the concatenation is byte for byte `encode`'s."""
        flat = self._flat(name, tensor)
        return self._part(flat, self._encode_flat(flat, name), name)

    def encode_kept(self, name: str, tensor: Tensor) -> tuple[bytes, Tensor | tuple[Tensor, Tensor]]:
        """(`encode_tensor`'s part, what `decode_tensor` gives back from it): for a sparse codec (`sparse`)
        as `decode_sparse` lists it, (flat positions, fp32 values), taken while encoding rather than read
        back from the bytes; else the decoded tensor. What error feedback keeps as its residual (the
        target less this) and an eager host's forecast needs of its own payload (training/overlap.py)."""
        flat = self._flat(name, tensor)
        section, kept = self._encode_flat_kept(flat, name)
        part = self._part(flat, section, name)
        return part, kept if isinstance(kept, tuple) else kept.reshape(tensor.shape)

    def _encode_flat_kept(self, x: Tensor, name: str) -> tuple[bytes, Tensor | tuple[Tensor, Tensor]]:
        """`_encode_flat` and what `_decode_flat` reads back from its section (a codec that knows it
        while encoding returns it without the decode; a sparse one as (positions, values))."""
        section = self._encode_flat(x, name)
        return section, self._decode_flat(memoryview(section), x.numel(), name)

    def _flat(self, name: str, tensor: Tensor) -> Tensor:
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
        if not all_finite(flat):
            raise ValueError(f"{self.name}.encode: {name} contains NaN or infinity")
        return flat

    def _part(self, flat: Tensor, section: bytes, name: str) -> bytes:
        assert len(section) == self.section_size(flat.numel(), name), "codec wrote a section of the wrong size"
        return _NUMEL.pack(flat.numel()) + section

    def decode_tensor(self, name: str, part: bytes | memoryview, shape: tuple[int, ...]) -> Tensor:
        """Inverse of `encode_tensor` for a part already known to come from this codec's payload."""
        section, numel = self._section(name, part, shape)
        return self._decode_flat(section, numel, name).reshape(shape)

    def _section(self, name: str, part: bytes | memoryview, shape: tuple[int, ...]) -> tuple[memoryview, int]:
        """A tensor's part checked against its shape: (its section, its element count)."""
        view = memoryview(part).cast("B")
        numel = _numel(shape, name)
        if len(view) != _NUMEL.size + self.section_size(numel, name):
            raise PayloadSizeError(f"{self.name} part of {name} is {len(view)} bytes, expected "
                             f"{_NUMEL.size + self.section_size(numel, name)}")
        (claimed,) = _NUMEL.unpack_from(view, 0)
        if claimed != numel:
            raise SpecMismatchError(f"{self.name} payload: tensor {name} claims {claimed} elements, spec has {numel}")
        return view[_NUMEL.size :], numel

    def decode(self, data: bytes | bytearray | memoryview, spec: Spec) -> dict[str, Tensor]:
        return dict(self.decode_parts(data, spec))

    def decode_sparse(self, data: bytes | bytearray | memoryview, spec: Spec) -> dict[str, tuple[Tensor, Tensor]]:
        """`decode` as (flat positions, fp32 values there) per tensor, +0 at every position not listed:
        what an outer step taken ahead of its update (`training.diloco.SpeculativeStep`) finishes with,
        without a dense tensor to fill and scan. The same checks as `decode`."""
        view = self._checked(data, spec)
        out, pos = {}, HEADER_SIZE
        for name in sorted(spec):
            size = _NUMEL.size + self.section_size(_numel(spec[name], name), name)
            section, numel = self._section(name, view[pos : pos + size], tuple(spec[name]))
            out[name] = self._decode_flat_sparse(section, numel, name)
            pos += size
        return out

    def _decode_flat_sparse(self, buf: memoryview, numel: int, name: str) -> tuple[Tensor, Tensor]:
        """`_decode_flat` as (positions, values) of its entries that are not +0; sparse codecs list their
        kept entries directly."""
        flat = self._decode_flat(buf, numel, name)
        idx = flat.view(torch.int32).nonzero().squeeze(1)  # +0 is the only all-zero bit pattern
        return idx, flat[idx]

    def decode_parts(self, data: bytes | bytearray | memoryview, spec: Spec) -> Iterator[tuple[str, Tensor]]:
        """`decode`, one tensor at a time in sorted name order: a reader that checks or reduces each
        tensor holds one decoded tensor, not the whole update. The header and the total length are
        checked before the first tensor is yielded, so a payload of the wrong shape decodes nothing."""
        return self._parts(self._checked(data, spec), spec)

    def _checked(self, data: bytes | bytearray | memoryview, spec: Spec) -> memoryview:
        """The payload's bytes, its header and total length checked against `spec`."""
        view = memoryview(data).cast("B")
        self._check_header(view, spec)
        expected = self.encoded_size(spec)
        if len(view) != expected:
            kind = "truncated" if len(view) < expected else "trailing bytes"
            raise PayloadSizeError(
                f"{self.name} payload is {len(view)} bytes, expected {expected} for this spec ({kind})"
            )
        return view

    def _parts(self, view: memoryview, spec: Spec) -> Iterator[tuple[str, Tensor]]:
        pos = HEADER_SIZE
        for name in sorted(spec):
            size = _NUMEL.size + self.section_size(_numel(spec[name], name), name)
            yield name, self.decode_tensor(name, view[pos : pos + size], tuple(spec[name]))
            pos += size

    def _check_header(self, view: memoryview, spec: Spec) -> None:
        if len(view) < HEADER_SIZE:
            raise PayloadSizeError(
                f"payload is {len(view)} bytes, shorter than the {HEADER_SIZE}-byte codec header"
            )
        magic, version, codec_id, reserved, p1, p2, p3, count, digest = _HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise HeaderError(f"bad magic {magic!r}: not a gonka codec payload (expected {MAGIC!r})")
        if version != VERSION:
            raise HeaderError(f"unsupported codec payload version {version} (this build reads {VERSION})")
        if codec_id != self.codec_id:
            sent = _BY_ID.get(codec_id, f"unknown id {codec_id}")
            raise CodecIdError(f"payload was encoded with codec {sent!r}, this decoder is {self.name!r}")
        if reserved != 0:
            raise HeaderError(f"reserved header field is {reserved}, must be 0")
        if (p1, p2, p3) != self.params():
            raise HeaderError(
                f"{self.name} payload parameters {(p1, p2, p3)} differ from the expected {self.params()}"
            )
        if count != len(spec) or digest != spec_digest(spec):
            raise SpecMismatchError(
                f"{self.name} payload was encoded for a different tensor spec ({count} tensors, digest {digest.hex()})"
            )


def _pack_codes(codes: np.ndarray, width: int) -> bytes:
    """Unsigned codes of `width` bits each, packed little-endian bit order, zero-padded to a byte."""
    if width == 8:
        return codes.astype(np.uint8).tobytes()
    if 8 % width == 0:  # 2 or 4 bits: combine whole groups without a per-bit temporary
        per = 8 // width
        padded = np.zeros(_ceil_div(len(codes), per) * per, dtype=np.uint8)
        padded[: len(codes)] = codes
        groups = padded.reshape(-1, per)
        out = np.zeros(len(groups), dtype=np.uint8)
        for j in range(per):
            out |= groups[:, j] << (j * width)
        return out.tobytes()
    span = math.lcm(width, 8)
    if span <= 64:  # e.g. 12 bits: every 2 codes fill 3 bytes exactly; one 64-bit word per group
        per, size = span // width, span // 8
        n_groups = _ceil_div(len(codes), per)
        padded = np.zeros(n_groups * per, dtype="<u8")
        padded[: len(codes)] = codes
        lanes = padded.reshape(n_groups, per)
        words = np.zeros(n_groups, dtype="<u8")
        for j in range(per):
            words |= lanes[:, j] << np.uint64(j * width)
        return words.view(np.uint8).reshape(n_groups, 8)[:, :size].tobytes()[: _ceil_div(len(codes) * width, 8)]
    shifts = np.arange(width, dtype=np.uint32)
    bits = ((codes.astype(np.uint32)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack_codes(buf: memoryview, count: int, width: int, codec: str, name: str) -> np.ndarray:
    """Inverse of `_pack_codes`; `buf` has exactly ceil(count·width / 8) bytes; padding must be zero."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if width == 8:
        return raw.copy()
    span = math.lcm(width, 8)
    if 8 % width == 0:
        shifts = np.arange(0, 8, width, dtype=np.uint8)
        codes = ((raw[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)
    elif span <= 64:  # `_pack_codes`' n_groups: each read as one 64-bit word
        per, size = span // width, span // 8
        n_groups = _ceil_div(len(raw), size)
        whole = np.zeros(n_groups * size, dtype=np.uint8)
        whole[: len(raw)] = raw
        padded = np.zeros((n_groups, 8), dtype=np.uint8)
        padded[:, :size] = whole.reshape(n_groups, size)
        words = padded.view("<u8").reshape(n_groups)
        shifts = np.arange(per, dtype=np.uint64) * np.uint64(width)
        codes = ((words[:, None] >> shifts) & np.uint64((1 << width) - 1)).reshape(-1).astype(np.uint32)
    else:
        bits = np.unpackbits(raw, bitorder="little")
        if bits[count * width :].any():
            raise MalformedSectionError(f"{codec} payload: tensor {name} has non-zero padding bits")
        weights = (1 << np.arange(width, dtype=np.uint32)).astype(np.uint32)
        return bits[: count * width].reshape(count, width).astype(np.uint32) @ weights
    if codes[count:].any():
        raise MalformedSectionError(f"{codec} payload: tensor {name} has non-zero padding bits")
    return codes[:count]


def _scale_blocks(q: Tensor, scale: Tensor, block: int, out: Tensor | None = None) -> Tensor:
    """q · scale[i // block] in fp32 without materialising a per-element scale: whole blocks as one
    broadcast multiply, the short last block apart. Each element is the one fp32 product q·scale, as
    an element-wise multiply by a repeated scale computes it (bit for bit the same values). `out`: where
    to write it (fp32, q's numel), else a new tensor."""
    numel = q.numel()
    full = numel // block * block
    out = torch.empty(numel, dtype=torch.float32) if out is None else out
    torch.mul(q[:full].view(-1, block), scale[: full // block, None], out=out[:full].view(-1, block))
    if full < numel:
        torch.mul(q[full:], scale[-1], out=out[full:])
    return out


def _cat(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def all_finite(t: Tensor) -> bool:
    """Whether no entry of `t` is NaN or ±infinity, in one reduction without a temporary: NaN carries
    through min and max, and an infinity is the one or the other. ~15× faster than
    `torch.isfinite(t).all()`, which fills a bool tensor the size of `t` (0.3 against 4.5 s for 1.2B
    elements here: scripts/bench_wan.py's seal is on a host's training path)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def _finite(t: Tensor, codec: str, name: str) -> Tensor:
    if not all_finite(t):
        raise NonFiniteError(f"{codec} payload: tensor {name} contains NaN or infinity")
    return t


def _numel(shape: tuple[int, ...], name: str) -> int:
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"spec: {name} has an invalid shape {shape}")
    return math.prod(shape)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
