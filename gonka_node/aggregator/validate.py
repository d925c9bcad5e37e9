"""Decode a received payload with the epoch's codec and check it is a plausible pseudo-gradient.

Checks: names, shapes and dtypes equal the model's; every value finite; global L2 norm within the
epoch's bound. Also computes the update's count sketch, used to find near-copies between hosts
without keeping any host's full update in memory.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import torch
from torch import Tensor

from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.core.fragments import global_offsets
from training.codecs import CodecError, NonFiniteError, SpecMismatchError

SKETCH_BUCKETS = 4096
_P = 2_147_483_647  # 2^31 − 1: hash arithmetic stays inside int64 for indices below 2^32
_HASH_A, _HASH_B, _SIGN_A, _SIGN_B = 1_103_515_245, 12_345, 69_069, 1


class Codec(Protocol):
    """What the aggregator needs of `training.codecs`' codecs."""

    opens_residual: bool  # a replay opens the host's residual instead of comparing the decode (top-k)

    def decode(self, data: bytes, spec: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]: ...

    def decode_parts(
        self, data: bytes | memoryview, spec: Mapping[str, tuple[int, ...]]
    ) -> Iterator[tuple[str, Tensor]]: ...

    def for_round(self, round_seed: int) -> Codec: ...

    def encoded_size(self, spec: Mapping[str, tuple[int, ...]]) -> int: ...


@dataclass(frozen=True)
class Checked:
    update: dict[str, Tensor]
    norm: float
    sketch: Tensor  # fp32 [SKETCH_BUCKETS]


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """Turn what a codec raises while decoding into the `Rejected` the sender is told."""
    try:
        yield
    except SpecMismatchError as exc:  # the header, or a tensor's count, names other tensors than the model's
        raise Rejected(Reason.WRONG_SHAPE, f"payload was encoded for other tensor shapes: {exc}") from exc
    except NonFiniteError as exc:  # some codecs refuse non-finite values while decoding
        raise Rejected(Reason.NON_FINITE, str(exc)) from exc
    except CodecError as exc:
        raise Rejected(Reason.UNDECODABLE, f"payload does not decode: {exc}") from exc
    except (ValueError, RuntimeError, KeyError, IndexError, TypeError) as exc:
        # A codec bug or an input the codec did not anticipate: still the sender's garbage, not ours.
        raise Rejected(Reason.UNDECODABLE, f"payload does not decode: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def mapped(f: BinaryIO) -> Iterator[memoryview]:
    """An open file's bytes, memory-mapped read-only (the page cache, no copy in our memory). An empty
    file cannot be mapped: it reads as no bytes. Decoders copy what they keep, so no view outlives
    this block; if one did, the mapping is left to the garbage collector rather than failing."""
    if os.fstat(f.fileno()).st_size == 0:
        yield memoryview(b"")
        return
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(m)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # a traceback's frame may still hold a slice
            view.release()
            m.close()


def decode_update(codec: Codec, data: bytes, spec: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
    with decoding():
        update = codec.decode(data, spec)
    if not isinstance(update, Mapping):
        raise Rejected(Reason.UNDECODABLE, "payload does not decode to named tensors")
    return dict(update)


def check_update(update: Mapping[str, Any], spec: Mapping[str, tuple[int, ...]], max_norm: float) -> Checked:
    _check_names(update, spec)
    total = sum(square_norm(name, update[name], spec[name]) for name in sorted(spec))
    norm = _bounded_norm(total, max_norm)
    fp32 = {name: update[name].float() for name in sorted(spec)}
    return Checked(update=fp32, norm=norm, sketch=count_sketch(fp32))


def scan_update(
    codec: Codec,
    data: bytes | memoryview,
    spec: Mapping[str, tuple[int, ...]],
    max_norm: float,
    offsets: Mapping[str, int] | None = None,
) -> tuple[float, Tensor]:
    """`check_update(decode_update(...))`'s norm and sketch, holding one decoded tensor at a time.

    Same verdicts in the same precedence: a decoding error anywhere beats any check (the old path
    decoded everything first), then the names, then the first failing tensor in sorted order, then
    the norm. After a tensor failed, later ones are only decoded (to find a decoding error).
    `offsets`: a shard's fragment, sketched at its tensors' coordinates in the whole update."""
    sketcher, total, seen = Sketcher(), 0.0, []
    failed: Rejected | None = None
    with decoding():
        for name, tensor in codec.decode_parts(data, spec):
            seen.append(name)
            if failed is not None or name not in spec:
                continue
            try:
                total += square_norm(name, tensor, spec[name])
            except Rejected as exc:
                failed = exc
                continue
            if offsets is None:
                sketcher.add(tensor)
            else:
                sketcher.add_at(offsets[name], tensor)
    _check_names(dict.fromkeys(seen), spec)
    if failed is not None:
        raise failed
    return _bounded_norm(total, max_norm), sketcher.result()


def _check_names(update: Mapping[str, object], spec: Mapping[str, tuple[int, ...]]) -> None:
    missing, extra = sorted(set(spec) - set(update)), sorted(set(update) - set(spec))
    if missing or extra:
        raise Rejected(
            Reason.WRONG_SHAPE,
            f"tensor names differ from the model: missing {missing[:3]}, unexpected {extra[:3]}",
        )


def square_norm(name: str, t: object, shape: tuple[int, ...]) -> float:
    """One tensor's squared L2 norm (fp64), after its dtype, shape and finiteness checks."""
    if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
        raise Rejected(
            Reason.WRONG_SHAPE,
            f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}",
        )
    if tuple(t.shape) != tuple(shape):
        raise Rejected(Reason.WRONG_SHAPE, f"{name} has shape {tuple(t.shape)}, the model has {tuple(shape)}")
    # NaN and ±inf make the sum of squares non-finite, so one pass checks both (isfinite only then).
    sq = float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    if not math.isfinite(sq) and not bool(torch.isfinite(t).all()):
        raise Rejected(Reason.NON_FINITE, f"{name} contains NaN or infinite values")
    return sq


def _bounded_norm(total: float, max_norm: float) -> float:
    norm = math.sqrt(total)
    if not math.isfinite(norm) or norm > max_norm:
        raise Rejected(
            Reason.NORM_TOO_LARGE, f"update L2 norm {norm:.4g} exceeds the epoch's bound {max_norm:.4g}"
        )
    return norm


SKETCH_CHUNK = 1 << 16  # elements per sketch step: its temporaries stay in cache (2-3x faster than whole tensors)
SKETCH_CACHE_ELEMENTS = 1 << 27  # hash tables kept for at most this many coordinates (8 bytes each: 1 GiB)


_TABLE_LOCKS: dict[tuple[int, int, int], threading.Lock] = {}  # one per table: who computes it, the others wait
_TABLE_LOCKS_LOCK = threading.Lock()


def _sketch_table(offset: int, numel: int, buckets: int) -> tuple[Tensor, Tensor]:
    """`_sketch_hash`, computed once however many check threads ask for it at the same time; a thread
    waits only for the table it needs (one lock per table, a few hundred per model)."""
    with _TABLE_LOCKS_LOCK:
        lock = _TABLE_LOCKS.setdefault((offset, numel, buckets), threading.Lock())
    with lock:
        return _sketch_hash(offset, numel, buckets)


def warm_sketch_tables(
    spec: Mapping[str, tuple[int, ...]], offsets: Mapping[str, int] | None = None, buckets: int = SKETCH_BUCKETS
) -> int:
    """Compute the hash tables of every tensor the cache keeps, ahead of the first payload: otherwise
    the round's first checks compute them (~22 ms per million coordinates) while uploads stream in.
    `offsets`: a shard's fragment (its tensors' coordinates in the whole update). Returns how many
    coordinates' tables are now cached."""
    at = global_offsets(spec) if offsets is None else offsets
    cached = 0
    for name in sorted(spec):
        numel = math.prod(spec[name])
        if at[name] + numel <= SKETCH_CACHE_ELEMENTS:
            _sketch_table(at[name], numel, buckets)
            cached += numel
    return cached


@functools.lru_cache(maxsize=4096)  # one entry per tensor of the model
def _sketch_hash(offset: int, numel: int, buckets: int) -> tuple[Tensor, Tensor]:
    """Bucket (int32) and sign (fp32 ±1) of coordinates [offset, offset + numel): the same for every
    submission of a round, so computed once per tensor (8 bytes per parameter, bounded by the model
    and by SKETCH_CACHE_ELEMENTS; past that, `_hash_range` recomputes them chunk by chunk, ~10x slower)."""
    return _hash_range(offset, numel, buckets)


def _hash_range(offset: int, numel: int, buckets: int) -> tuple[Tensor, Tensor]:
    idx = torch.arange(offset, offset + numel, dtype=torch.int64)
    bucket = ((idx * _HASH_A + _HASH_B) % _P) % buckets
    sign = ((((idx * _SIGN_A + _SIGN_B) % _P) & 1) * 2 - 1).to(torch.float32)
    return bucket.to(torch.int32), sign


class Sketcher:
    """CountSketch of a concatenated update fed one tensor at a time in sorted name order (`add`),
    so a streaming reader never holds the whole update. Bit for bit the whole-vector sketch: each
    coordinate adds sign·x (exact in fp32) in fp64 to its bucket in coordinate order, however chunked."""

    def __init__(self, buckets: int = SKETCH_BUCKETS) -> None:
        self.buckets = buckets
        self.offset = 0
        self._out = torch.zeros(buckets, dtype=torch.float64)
        self._f32 = torch.empty(SKETCH_CHUNK, dtype=torch.float32)
        self._f64 = torch.empty(SKETCH_CHUNK, dtype=torch.float64)

    def add(self, tensor: Tensor) -> None:
        """The next tensor of the update (sorted name order): its coordinates follow the previous one's."""
        self.add_at(self.offset, tensor)

    def add_at(self, offset: int, tensor: Tensor) -> None:
        """A tensor whose first coordinate is `offset` in the whole update (a shard's fragment keeps its
        tensors' global offsets, so fragment sketches sum to the whole update's sketch)."""
        flat = tensor.reshape(-1).float()
        numel = flat.numel()
        cached = offset + numel <= SKETCH_CACHE_ELEMENTS
        table = _sketch_table(offset, numel, self.buckets) if cached else None
        for start in range(0, numel, SKETCH_CHUNK):
            stop = min(numel, start + SKETCH_CHUNK)
            if table is not None:
                bucket, sign = table[0][start:stop], table[1][start:stop]
            else:
                bucket, sign = _hash_range(offset + start, stop - start, self.buckets)
            self._step(flat[start:stop], bucket, sign)
        self.offset = offset + numel

    def _step(self, x: Tensor, bucket: Tensor, sign: Tensor) -> None:
        f32, f64 = self._f32[: x.numel()], self._f64[: x.numel()]
        torch.mul(x, sign, out=f32)
        f64.copy_(f32)
        self._out.index_add_(0, bucket, f64)

    def result(self) -> Tensor:
        return self._out.float()


def count_sketch(
    update: Mapping[str, Tensor], buckets: int = SKETCH_BUCKETS, offsets: Mapping[str, int] | None = None
) -> Tensor:
    """CountSketch of the concatenated update (names sorted): inner products are preserved in
    expectation, so cosine(sketch_a, sketch_b) ≈ cosine(a, b), for dense and sparse updates alike.
    `offsets`: the update is part of the model's (a fragment), each tensor sketched at its coordinates
    in the whole (as `scan_update` sketches it)."""
    sketcher = Sketcher(buckets)
    for name in sorted(update):
        if offsets is None:
            sketcher.add(update[name])
        else:
            sketcher.add_at(offsets[name], update[name])
    return sketcher.result()


def cosine(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.double().norm()), float(b.double().norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a.double() @ b.double()) / (na * nb)
