"""Sparse codecs: `topk` (per chunk, the k largest magnitudes with low-bit values) and `mask` (a mask
shared by every host of a round, derived from the round's public seed)."""

from __future__ import annotations

import contextvars
import hashlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import ClassVar, NamedTuple

import numpy as np
import torch
from torch import Tensor

from training.codec_base import (
    _NUMEL,
    Codec,
    MalformedSectionError,
    Spec,
    _cat,
    _ceil_div,
    _finite,
    _pack_codes,
    _unpack_codes,
)

_SELECT_BLOCK = 1 << 22  # elements of rows per block of `TopKCodec._select`: a 16 MB scratch per thread
_scratches = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> Tensor:
    """This thread's scratch buffer of at least `numel` elements of `dtype` (kept: reused, not refaulted)."""
    have: Tensor | None = getattr(_scratches, "buffer", None)
    if have is None or have.dtype != dtype or have.numel() < numel:
        have = _scratches.buffer = torch.empty(numel, dtype=dtype)
    return have


class TopKCodec(Codec):
    """Per chunk of `chunk` elements, the `k` largest magnitudes, their positions and low-bit values.

    Values: a sign bit and (bits − 1) magnitude bits on a uniform grid from the chunk's smallest to its
    largest selected magnitude (two fp32 per chunk), so 2-bit values are ±lo or ±hi. With bits = 1 a
    value is its sign times the mean selected magnitude of its chunk (one fp32 per chunk: the
    least-squares magnitude for those signs): one bit less per entry, so a few more entries fit in the
    same bytes (positions dominate: 12 bits each for chunk 4096). Positions
    are chunk-relative, ceil(log2 chunk) bits each, strictly increasing within a chunk. The last chunk
    of a tensor may be shorter; it keeps min(k, its length) entries.
    Section: (lo, hi) fp32 per chunk (bits = 1: the mean magnitude) | packed positions | packed codes.
    """

    name = "topk"
    opens_residual = True
    sparse = True

    def __init__(self, chunk: int = 4096, k: int = 64, bits: int = 2) -> None:
        if not 2 <= chunk <= 1 << 24:
            raise ValueError(f"TopKCodec: chunk must be in [2, 2^24], got {chunk}")
        if not 1 <= k <= chunk:
            raise ValueError(f"TopKCodec: k must be in [1, chunk={chunk}], got {k}")
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"TopKCodec: value bits must be 1, 2, 4 or 8, got {bits}")
        self.chunk, self.k, self.bits = chunk, k, bits
        self.index_bits = max(1, (chunk - 1).bit_length())
        self.levels = (1 << (bits - 1)) - 1  # magnitude steps between lo and hi (0 for sign-only)
        self.scales = 1 if bits == 1 else 2  # fp32 numbers per chunk

    def params(self) -> tuple[int, int, int]:
        return (self.chunk, self.k, self.bits)

    def _kept(self, numel: int) -> tuple[int, int]:
        """(number of chunks, total entries kept) for a tensor of `numel` elements."""
        full, rest = divmod(numel, self.chunk)
        return full + (rest > 0), full * self.k + min(self.k, rest)

    def section_size(self, numel: int, name: str = "") -> int:
        chunks, kept = self._kept(numel)
        return (
            4 * self.scales * chunks + _ceil_div(kept * self.index_bits, 8) + _ceil_div(kept * self.bits, 8)
        )

    def _encode_flat(self, x: Tensor, name: str) -> bytes:
        return self._encode_flat_kept(x, name)[0]

    def _encode_flat_kept(self, x: Tensor, name: str) -> tuple[bytes, tuple[Tensor, Tensor]]:
        """The section, and its kept entries' flat positions and decoded values: `_values` of the very
        scales and codes written, so bit for bit what `_decode_flat_sparse` reads back (no decode pass)."""
        full = (x.numel() // self.chunk) * self.chunk
        rows = [x[:full].view(-1, self.chunk), x[full:].view(1, -1)]
        scales, positions, codes, owners = [], [], [], []
        for first, r in ((0, rows[0]), (full // self.chunk, rows[1])):
            if not r.numel():
                continue
            idx, v = self._select(r, min(self.k, r.shape[1]))
            positions.append(idx.reshape(-1))
            owners.append(torch.arange(first, first + r.shape[0]).repeat_interleave(idx.shape[1]))
            if self.bits == 1:
                mean = v.abs().mean(dim=1)
                scales.append(torch.stack([mean, mean], dim=1))
                codes.append((v < 0).to(torch.int64).reshape(-1))
                continue
            lo, hi = v.abs().amin(dim=1), v.abs().amax(dim=1)
            scales.append(torch.stack([lo, hi], dim=1))
            codes.append(self._quantize(v, lo, hi))
        pairs = torch.cat(scales) if scales else torch.zeros(0, 2)
        idx, code, owner = _cat(positions, torch.int64), _cat(codes, torch.int64), _cat(owners, torch.int64)
        section = (
            pairs[:, : self.scales].contiguous().numpy().astype("<f4").tobytes()
            + _pack_codes(idx.numpy().astype(np.uint32), self.index_bits)
            + _pack_codes(code.numpy().astype(np.uint8), self.bits)
        )
        kept = _Kept(pairs[:, 0].contiguous(), pairs[:, 1].contiguous(), owner, idx, code)
        return section, (owner * self.chunk + idx, _finite(self._values(kept), self.name, name))

    @staticmethod
    def _select(rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Each row's k largest magnitudes: (their positions, ascending; their values). Rows are taken a
        block at a time, their magnitudes written into one scratch buffer of this thread's: a magnitude
        tensor as large as the model's (1 GB for a 1B model's embedding) was fresh memory each time,
        and its page faults cost as much as the magnitudes themselves. Each row's selection is its own,
        so the blocks change nothing in the result."""
        per = max(1, _SELECT_BLOCK // max(1, rows.shape[1]))
        if rows.shape[0] <= per or rows.device.type != "cpu":
            idx = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
            return idx, rows.gather(1, idx)
        scratch = _scratch(per * rows.shape[1], rows.dtype)
        parts = []
        for first in range(0, rows.shape[0], per):
            block = rows[first : first + per]
            magnitudes = torch.abs(block, out=scratch[: block.numel()].view(block.shape))
            parts.append(magnitudes.topk(k, dim=1, sorted=False).indices.sort(dim=1).values)
        idx = torch.cat(parts)
        return idx, rows.gather(1, idx)

    def _quantize(self, v: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        span = (hi - lo)[:, None]
        step = torch.where(span > 0, span / self.levels, torch.ones_like(span))
        mag = torch.round((v.abs() - lo[:, None]) / step).clamp_(0, self.levels)
        sign = (v < 0).to(torch.int64) << (self.bits - 1)
        return (sign | mag.to(torch.int64)).reshape(-1)

    def _decode_flat(self, buf: memoryview, numel: int, name: str) -> Tensor:
        positions, values = self._decode_flat_sparse(buf, numel, name)
        out = torch.zeros(numel, dtype=torch.float32)
        out[positions] = values
        return out

    def _decode_flat_sparse(self, buf: memoryview, numel: int, name: str) -> tuple[Tensor, Tensor]:
        kept = self._entries(buf, numel, name)
        # lo + 127·step can round past fp32's max when hi is near it
        return kept.owner * self.chunk + kept.idx, _finite(self._values(kept), self.name, name)

    def _values(self, kept: _Kept) -> Tensor:
        """The decoded fp32 value of each kept entry."""
        c = kept.codes
        if self.bits == 1:
            mag = kept.lo[kept.owner]
        else:
            step = (kept.hi - kept.lo) / float(self.levels)
            mag = kept.lo[kept.owner] + (c & self.levels).to(torch.float32) * step[kept.owner]
        return torch.where((c >> (self.bits - 1)) == 1, -mag, mag)

    def residual_misfit(
        self, part: bytes | memoryview, shape: tuple[int, ...], name: str, spans: Sequence[tuple[int, int]],
        residual: Tensor,
    ) -> str | None:
        """Why `residual` cannot be what an honest `ErrorFeedback` kept after sending this tensor's `part`
        (one line), or None. `spans`: ranges of the flattened tensor, each a whole number of this codec's
        chunks; `residual`: their values, concatenated (what a challenged host opened).

        T = decode + residual is the target the host compressed, up to the fp32 rounding of the
        subtraction that made the residual (≤ 2⁻²⁴ of a sent value's distance to its target; exact where
        nothing was sent). An honest part is the compression of T, chunk by chunk: the kept positions
        hold the k largest |T| (ties aside); lo and hi are the smallest and largest kept |T| (bits = 1:
        their mean); every kept value has its target's sign and, with bits ≥ 2, lies within half a step
        (hi − lo)/levels of it. So a host cannot send one thing and park the difference in its residual:
        not another selection, not other magnitudes or signs, not scales it did not attain. Margins:
        2⁻²⁰ of the chunk's largest magnitude (the quantiser's and decode's fp32 rounding are < 6·2⁻²⁴ of
        it), and k·2⁻²³ of the mean for bits = 1 (its fp32 sum)."""
        view = memoryview(part).cast("B")
        self.decode_tensor(name, view, shape)  # every check of the part: size, numel, scales, positions
        numel = math.prod(shape)
        kept = self._entries(view[_NUMEL.size :], numel, name)
        if not bool(torch.isfinite(residual).all()):
            return f"tensor {name}: a non-finite residual value (an honest residual is finite)"
        values, at = self._values(kept).double(), 0
        for start, end in spans:
            if start % self.chunk or (end % self.chunk and end != numel) or not 0 <= start < end <= numel:
                raise ValueError(f"residual_misfit: span {start}..{end} of {name} is not whole chunks of {self.chunk}")
            why = self._span_misfit(kept, values, start, end, residual[at : at + end - start].double())
            if why is not None:
                return f"tensor {name}, elements {start}..{end}: {why}"
            at += end - start
        return None

    def _span_misfit(self, kept: _Kept, values: Tensor, start: int, end: int, e: Tensor) -> str | None:
        m, c0 = self.chunk, start // self.chunk
        n = _ceil_div(end - start, m)
        first, last = c0 * self.k, min((c0 + n) * self.k, len(kept.owner))  # a tensor's chunks hold k each but its last
        pos = (kept.owner[first:last] - c0) * m + kept.idx[first:last]
        decoded = torch.zeros(n * m, dtype=torch.float64)
        decoded[pos] = values[first:last]
        sent = torch.zeros(n * m, dtype=torch.bool)
        sent[pos] = True
        real = torch.arange(n * m) < end - start  # a tensor's last chunk may be short
        target = decoded.clone()
        target[: end - start] += e
        mag = target.abs()
        inf = torch.tensor(math.inf, dtype=torch.float64)
        smallest = torch.where(sent, mag, inf).view(n, m).amin(dim=1)
        largest = torch.where(sent, mag, -inf).view(n, m).amax(dim=1)
        unsent = torch.where(real & ~sent, mag, -inf).view(n, m).amax(dim=1)
        lo, hi = kept.lo[c0 : c0 + n].double(), kept.hi[c0 : c0 + n].double()
        tol = torch.maximum(hi, largest) * 2.0**-20
        if (bad := unsent > smallest + tol).any():
            return f"an unsent target is larger than the smallest sent one in {int(bad.sum())} chunk(s): not its top-k"
        flipped = sent & (decoded * target < 0) & (mag > tol.repeat_interleave(m))
        if flipped.any():
            return f"{int(flipped.sum())} sent value(s) with the opposite sign of their target"
        if self.bits == 1:
            count = sent.view(n, m).sum(dim=1)
            mean = torch.where(sent, mag, 0.0).view(n, m).sum(dim=1) / count
            if (bad := (mean - lo).abs() > lo * self.k * 2.0**-23 + tol).any():
                return f"the magnitude of {int(bad.sum())} chunk(s) is not the mean of its sent targets'"
            return None
        if (bad := ((smallest - lo).abs() > tol) | ((largest - hi).abs() > tol)).any():
            return f"the scales (lo, hi) of {int(bad.sum())} chunk(s) are not its smallest and largest sent targets"
        half_step = ((hi - lo) / self.levels / 2 + tol).repeat_interleave(m)
        if (far := sent & ((target - decoded).abs() > half_step)).any():
            return f"{int(far.sum())} sent value(s) farther than half a step from their target"
        return None

    def _entries(self, buf: memoryview, numel: int, name: str) -> _Kept:
        """A section's entries, checked: chunk scales, and per kept entry its chunk, position and code."""
        chunks, kept = self._kept(numel)
        pos = 4 * self.scales * chunks
        scales = np.frombuffer(buf[:pos], dtype="<f4").astype(np.float32).reshape(chunks, self.scales)
        if not (
            np.isfinite(scales).all() and (scales[:, 0] >= 0).all() and (scales[:, -1] >= scales[:, 0]).all()
        ):
            raise MalformedSectionError(
                f"topk payload: tensor {name} has a non-finite or inconsistent chunk scale (need 0 ≤ lo ≤ hi)"
            )
        idx_len = _ceil_div(kept * self.index_bits, 8)
        idx = _unpack_codes(buf[pos : pos + idx_len], kept, self.index_bits, self.name, name).astype(np.int64)
        codes = _unpack_codes(buf[pos + idx_len :], kept, self.bits, self.name, name).astype(np.int64)
        # Which chunk each kept entry belongs to, and that chunk's length (the last may be short).
        per_chunk = np.full(chunks, self.k, dtype=np.int64)
        if chunks:
            per_chunk[-1] = min(self.k, numel - (chunks - 1) * self.chunk)
        owner = np.repeat(np.arange(chunks, dtype=np.int64), per_chunk)
        chunk_len = np.minimum(self.chunk, numel - owner * self.chunk)
        if (idx >= chunk_len).any():
            raise MalformedSectionError(f"topk payload: tensor {name} has a position out of range of its chunk")
        starts = np.cumsum(per_chunk) - per_chunk
        rising = np.diff(idx) > 0
        rising[starts[1:] - 1] = True  # a new chunk may restart at any position
        if not rising.all():
            raise MalformedSectionError(
                f"topk payload: tensor {name} has positions not strictly increasing within a chunk"
            )
        lo, hi = torch.from_numpy(scales[:, 0].copy()), torch.from_numpy(scales[:, -1].copy())
        return _Kept(lo, hi, torch.from_numpy(owner), torch.from_numpy(idx), torch.from_numpy(codes))


class _Kept(NamedTuple):
    """A top-k section read back: per chunk (lo, hi) (bits = 1: the mean magnitude twice), per kept
    entry its chunk, its position in the chunk and its code."""

    lo: Tensor
    hi: Tensor
    owner: Tensor
    idx: Tensor
    codes: Tensor


class SharedMaskCodec(Codec):
    """Every host sends the same pseudo-random 1/`stride` of each tensor's entries, as `bits`-bit values.

    The mask is a pure function of (round seed, tensor name, position), so hosts and the aggregator all
    know it and no positions are sent: all of a payload's bits carry values, and the aggregate of the
    K hosts is an exact average on the mask (sparse codecs with per-host positions average each entry
    with the zeros of the hosts that did not pick it). Entry i of tensor t is in class
    splitmix64(i ⊕ key(t, cycle)) mod stride and is sent in the round whose seed ≡ class (mod stride), so
    within each cycle of `stride` rounds every entry is sent exactly once; the classes are re-drawn
    each cycle. Values: uniform levels (c − (2^bits − 1)/2)·step, one fp32 step per `chunk` sent values
    (chosen near the MSE-optimal step for Gaussian data: 0.996σ for 2 bits). Combine with error feedback.
    Header parameters: (stride, bits << 24 | chunk, round seed mod 2^32).
    """

    name = "mask"
    # Not `sparse` in that sense: 1/stride of the entries (a quarter by default) touch nearly every cache
    # line of the model, so an outer step finished on them costs about a whole one.
    _STEP_IN_SIGMAS: ClassVar[dict[int, float]] = {2: 0.996, 4: 0.335, 8: 0.0308}

    def __init__(self, stride: int = 4, bits: int = 2, chunk: int = 256, seed: int = 0) -> None:
        if not 1 <= stride <= 1 << 16:
            raise ValueError(f"SharedMaskCodec: stride must be in [1, 65536], got {stride}")
        if bits not in self._STEP_IN_SIGMAS:
            raise ValueError(f"SharedMaskCodec: value bits must be 2, 4 or 8, got {bits}")
        if not 1 <= chunk < 1 << 24:
            raise ValueError(f"SharedMaskCodec: chunk must be in [1, 2^24), got {chunk}")
        self.stride, self.bits, self.chunk, self.seed = stride, bits, chunk, seed % (1 << 32)
        self.offset = ((1 << bits) - 1) / 2

    def for_round(self, round_seed: int) -> SharedMaskCodec:
        return SharedMaskCodec(self.stride, self.bits, self.chunk, round_seed)

    def params(self) -> tuple[int, int, int]:
        return (self.stride, self.bits << 24 | self.chunk, self.seed)

    def decode(self, data: bytes | bytearray | memoryview, spec: Spec) -> dict[str, Tensor]:
        """`Codec.decode`, each tensor's mask built once: the sizes, the checks and the values all use it."""
        token = _DECODE_MASKS.set({})
        try:
            return super().decode(data, spec)
        finally:
            _DECODE_MASKS.reset(token)

    def decode_parts(self, data: bytes | bytearray | memoryview, spec: Spec) -> Iterator[tuple[str, Tensor]]:
        """`Codec.decode_parts`, each tensor's mask built once for the whole stream, as in `decode` (the
        memo is set around each step only: a generator may be resumed from another context)."""
        memo: dict[tuple[int, int, int, str], Tensor] = {}
        token = _DECODE_MASKS.set(memo)
        try:
            parts = super().decode_parts(data, spec)  # the size check builds every mask once
        finally:
            _DECODE_MASKS.reset(token)
        return self._with_masks(parts, memo)

    @staticmethod
    def _with_masks(
        parts: Iterator[tuple[str, Tensor]], memo: dict[tuple[int, int, int, str], Tensor]
    ) -> Iterator[tuple[str, Tensor]]:
        while True:
            token = _DECODE_MASKS.set(memo)
            try:
                part = next(parts, None)
            finally:
                _DECODE_MASKS.reset(token)
            if part is None:
                return
            yield part

    def mask(self, numel: int, name: str) -> Tensor:
        """Flat positions sent this round (increasing); inside `decode`, built once per tensor."""
        memo = _DECODE_MASKS.get()
        if memo is None:
            return self._build_mask(numel, name)
        key = (self.seed, self.stride, numel, name)
        if key not in memo:
            memo[key] = self._build_mask(numel, name)
        return memo[key]

    def _build_mask(self, numel: int, name: str) -> Tensor:
        cycle, phase = divmod(self.seed, self.stride)
        key = int.from_bytes(hashlib.sha256(f"gonka-mask-v1:{name}:{cycle}".encode()).digest()[:8], "little")
        h = _splitmix64(np.arange(numel, dtype=np.uint64) ^ np.uint64(key))
        return torch.from_numpy(np.flatnonzero(h % np.uint64(self.stride) == phase))

    def section_size(self, numel: int, name: str = "") -> int:
        sent = len(self.mask(numel, name))
        return 4 * _ceil_div(sent, self.chunk) + _ceil_div(sent * self.bits, 8)

    def _encode_flat(self, x: Tensor, name: str) -> bytes:
        v = x[self.mask(x.numel(), name)]
        n = v.numel()
        groups = torch.nn.functional.pad(v, (0, _ceil_div(n, self.chunk) * self.chunk - n)).view(
            -1, self.chunk
        )
        counts = torch.full((groups.shape[0],), float(self.chunk))
        if n % self.chunk:
            counts[-1] = n % self.chunk
        sigma = (groups.square().sum(dim=1) / counts).sqrt()
        step = sigma * self._STEP_IN_SIGMAS[self.bits]
        safe = torch.where(step > 0, step, torch.ones_like(step))
        # Levels are the half-integers (c − offset)·step, so the nearest one is floor(x/step + offset + 1/2).
        q = torch.floor(groups / safe[:, None] + (self.offset + 0.5)).clamp_(0, 2 * self.offset)
        codes = q.reshape(-1)[:n].to(torch.int64).numpy().astype(np.uint8)
        return step.numpy().astype("<f4").tobytes() + _pack_codes(codes, self.bits)

    def _decode_flat(self, buf: memoryview, numel: int, name: str) -> Tensor:
        positions = self.mask(numel, name)
        n = len(positions)
        n_groups = _ceil_div(n, self.chunk)
        step = np.frombuffer(buf[: 4 * n_groups], dtype="<f4").astype(np.float32)
        if not (np.isfinite(step).all() and (step >= 0).all()):
            raise MalformedSectionError(f"mask payload: tensor {name} has a negative or non-finite step")
        codes = _unpack_codes(buf[4 * n_groups :], n, self.bits, self.name, name)
        level = torch.from_numpy(codes.astype(np.float32) - np.float32(self.offset))  # exact half-integers
        values = _finite(level * torch.from_numpy(step).repeat_interleave(self.chunk)[:n], self.name, name)
        out = torch.zeros(numel, dtype=torch.float32)
        out[positions] = values
        return out


# The masks one `SharedMaskCodec.decode` has built (per thread and task: decodes run concurrently).
_DECODE_MASKS: contextvars.ContextVar[dict[tuple[int, int, int, str], Tensor] | None] = contextvars.ContextVar(
    "_DECODE_MASKS", default=None
)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrap-around arithmetic: identical on every machine)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
