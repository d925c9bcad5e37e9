"""Dense codecs: `fp32`, `bf16`, and block-wise absmax `int8` / `int4` (`BlockQuantCodec`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from training.codec_base import (
    Codec,
    MalformedSectionError,
    _ceil_div,
    _finite,
    _pack_codes,
    _scale_blocks,
    _unpack_codes,
)


class Fp32Codec(Codec):
    """Raw little-endian fp32: lossless, the reference point for every byte count."""

    name = "fp32"

    def params(self) -> tuple[int, int, int]:
        return (0, 0, 0)

    def section_size(self, numel: int, name: str = "") -> int:
        return 4 * numel

    def _encode_flat(self, x: Tensor, name: str) -> bytes:
        return x.numpy().astype("<f4", copy=False).tobytes()

    def _decode_flat(self, buf: memoryview, numel: int, name: str) -> Tensor:
        return _finite(torch.from_numpy(np.frombuffer(buf, dtype="<f4").astype(np.float32)), self.name, name)


class Bf16Codec(Codec):
    """bfloat16 (round to nearest even): half the bytes, relative error ≤ 2^-8."""

    name = "bf16"

    def params(self) -> tuple[int, int, int]:
        return (0, 0, 0)

    def section_size(self, numel: int, name: str = "") -> int:
        return 2 * numel

    def _encode_flat(self, x: Tensor, name: str) -> bytes:
        return x.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2", copy=False).tobytes()

    def _decode_flat(self, buf: memoryview, numel: int, name: str) -> Tensor:
        # bf16 is the top half of fp32: widening is exact, done on integers to stay bit-identical anywhere.
        bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
        return _finite(torch.from_numpy(bits.view(np.float32).copy()), self.name, name)


_SLAB = 1 << 22  # elements `BlockQuantCodec` encodes at a time (rounded down to whole blocks)


class BlockQuantCodec(Codec):
    """Signed integers of `bits` bits per element with one fp32 scale (absmax / qmax) per block.

    Section: fp32 scales for ceil(n / block) blocks, then the codes, packed little-endian (4-bit: low
    nibble first). A code stores q + 2^(bits-1) with q in [-qmax, qmax]; code 0 is never written.
    Round-trip error per element ≤ scale / 2 = absmax(block) / (2·qmax) (plus fp32 rounding).
    """

    def __init__(self, bits: int, block: int) -> None:
        if bits not in (4, 8):
            raise ValueError(f"BlockQuantCodec: bits must be 4 or 8, got {bits}")
        if not 1 <= block <= 1 << 20:
            raise ValueError(f"BlockQuantCodec: block must be in [1, 2^20], got {block}")
        self.bits, self.block = bits, block
        self.qmax = (1 << (bits - 1)) - 1
        self.name = "int8" if bits == 8 else "int4"

    def params(self) -> tuple[int, int, int]:
        return (self.bits, self.block, 0)

    def section_size(self, numel: int, name: str = "") -> int:
        return 4 * _ceil_div(numel, self.block) + _ceil_div(numel * self.bits, 8)

    def _encode_flat(self, x: Tensor, name: str) -> bytes:
        return self._encode_slabs(x, None)

    def _encode_flat_kept(self, x: Tensor, name: str) -> tuple[bytes, Tensor]:
        kept = torch.empty(x.numel(), dtype=torch.float32)
        section = self._encode_slabs(x, kept)
        return section, _finite(kept, self.name, name)  # as decoding it checks: q·scale may round past fp32's max

    def _encode_slabs(self, x: Tensor, kept: Tensor | None) -> bytes:
        """The section, a slab of whole blocks at a time (its temporaries a few MB, reused from the heap,
        not model-sized fresh memory); `kept`, when given, filled with what decoding the section gives:
        each block's q·scale computed from the very codes written (`_signed`, `_scale_blocks`), bit for
        bit the decode. Per element: scale = absmax(block) / qmax, q = round(x / scale) clamped to
        ±qmax (a block of zeros has scale 0 and q 0), code = q + 2^(bits−1)."""
        n, block = x.numel(), self.block
        scales = torch.empty(_ceil_div(n, block), dtype=torch.float32)
        codes = np.empty(n, dtype=np.uint8)
        step = max(1, _SLAB // block) * block
        for start in range(0, n, step):
            part = x[start : start + step]
            m = part.numel()
            pad = _ceil_div(m, block) * block - m  # only a tensor's last slab may end in a short block
            blocks = (torch.nn.functional.pad(part, (0, pad)) if pad else part).view(-1, block)
            scale = blocks.abs().amax(dim=1) / self.qmax
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(blocks / safe[:, None]).clamp_(-self.qmax, self.qmax).reshape(-1)[:m].to(torch.int8)
            slab_codes = (q.to(torch.int16) + (self.qmax + 1)).to(torch.uint8)
            first = start // block
            scales[first : first + scale.numel()] = scale
            codes[start : start + m] = slab_codes.numpy()
            if kept is not None:
                _scale_blocks(self._signed(slab_codes.numpy()), scale, block, out=kept[start : start + m])
        return scales.numpy().astype("<f4").tobytes() + _pack_codes(codes, self.bits)

    def _decode_flat(self, buf: memoryview, numel: int, name: str) -> Tensor:
        n_blocks = _ceil_div(numel, self.block)
        scale = np.frombuffer(buf[: 4 * n_blocks], dtype="<f4").astype(np.float32)
        if not (np.isfinite(scale).all() and (scale >= 0).all()):
            raise MalformedSectionError(f"{self.name} payload: tensor {name} has a negative or non-finite block scale")
        codes = _unpack_codes(buf[4 * n_blocks :], numel, self.bits, self.name, name)
        if numel and codes.min() == 0:
            raise MalformedSectionError(
                f"{self.name} payload: tensor {name} has code 0, outside [-{self.qmax}, {self.qmax}]"
            )
        out = _scale_blocks(self._signed(codes), torch.from_numpy(scale), self.block)
        return _finite(out, self.name, name)  # a scale near fp32's max times qmax overflows

    def _signed(self, codes: np.ndarray) -> Tensor:
        """Codes to q = code − 2^(bits−1) as a small integer tensor (exact in fp32 once multiplied)."""
        if self.bits == 8:  # code ⊕ 0x80 read as int8 is code − 128: one pass, no wider temporary
            return torch.from_numpy((codes ^ np.uint8(0x80)).view(np.int8))
        return torch.from_numpy(codes.astype(np.int8) - np.int8(self.qmax + 1))
