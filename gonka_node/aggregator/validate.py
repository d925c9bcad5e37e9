"""Decode a received payload with the epoch's codec and check it is a plausible pseudo-gradient.

Checks: names, shapes and dtypes equal the model's; every value finite; global L2 norm within the
epoch's bound. Also computes the update's count sketch, used to find near-copies between hosts
without keeping any host's full update in memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from gonka_node.aggregator.reasons import Reason, Rejected
from training.codecs import CodecError, NonFiniteError, SpecMismatchError

SKETCH_BUCKETS = 4096
_P = 2_147_483_647  # 2^31 − 1: hash arithmetic stays inside int64 for indices below 2^32
_HASH_A, _HASH_B, _SIGN_A, _SIGN_B = 1_103_515_245, 12_345, 69_069, 1


class Codec(Protocol):
    """What the aggregator needs of `training.codecs`' codecs."""

    def decode(self, data: bytes, spec: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]: ...

    def for_round(self, round_seed: int) -> Codec: ...


@dataclass(frozen=True)
class Checked:
    update: dict[str, Tensor]
    norm: float
    sketch: Tensor  # fp32 [SKETCH_BUCKETS]


def decode_update(codec: Codec, data: bytes, spec: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
    try:
        update = codec.decode(data, spec)
    except SpecMismatchError as exc:  # the header, or a tensor's count, names other tensors than the model's
        raise Rejected(Reason.WRONG_SHAPE, f"payload was encoded for other tensor shapes: {exc}") from exc
    except NonFiniteError as exc:  # some codecs refuse non-finite values while decoding
        raise Rejected(Reason.NON_FINITE, str(exc)) from exc
    except CodecError as exc:
        raise Rejected(Reason.UNDECODABLE, f"payload does not decode: {exc}") from exc
    except (ValueError, RuntimeError, KeyError, IndexError, TypeError) as exc:
        # A codec bug or an input the codec did not anticipate: still the sender's garbage, not ours.
        raise Rejected(Reason.UNDECODABLE, f"payload does not decode: {type(exc).__name__}: {exc}") from exc
    if not isinstance(update, Mapping):
        raise Rejected(Reason.UNDECODABLE, "payload does not decode to named tensors")
    return dict(update)


def check_update(update: Mapping[str, Any], spec: Mapping[str, tuple[int, ...]], max_norm: float) -> Checked:
    missing, extra = sorted(set(spec) - set(update)), sorted(set(update) - set(spec))
    if missing or extra:
        raise Rejected(
            Reason.WRONG_SHAPE,
            f"tensor names differ from the model: missing {missing[:3]}, unexpected {extra[:3]}",
        )
    total = 0.0
    for name in sorted(spec):
        t = update[name]
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            raise Rejected(
                Reason.WRONG_SHAPE,
                f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}",
            )
        if tuple(t.shape) != tuple(spec[name]):
            raise Rejected(
                Reason.WRONG_SHAPE, f"{name} has shape {tuple(t.shape)}, the model has {tuple(spec[name])}"
            )
        # NaN and ±inf make the sum of squares non-finite, so one pass checks both (isfinite only then).
        sq = float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
        if not math.isfinite(sq) and not bool(torch.isfinite(t).all()):
            raise Rejected(Reason.NON_FINITE, f"{name} contains NaN or infinite values")
        total += sq
    norm = math.sqrt(total)
    if not math.isfinite(norm) or norm > max_norm:
        raise Rejected(
            Reason.NORM_TOO_LARGE, f"update L2 norm {norm:.4g} exceeds the epoch's bound {max_norm:.4g}"
        )
    fp32 = {name: update[name].float() for name in sorted(spec)}
    return Checked(update=fp32, norm=norm, sketch=count_sketch(fp32))


@functools.lru_cache(maxsize=4096)  # one entry per tensor of the model
def _sketch_hash(offset: int, numel: int, buckets: int) -> tuple[Tensor, Tensor]:
    """Bucket and sign of coordinates [offset, offset + numel): the same for every submission of a
    round, so computed once per tensor (memory: ~9 bytes per parameter, bounded by the model)."""
    idx = torch.arange(offset, offset + numel, dtype=torch.int64)
    bucket = ((idx * _HASH_A + _HASH_B) % _P) % buckets
    sign = ((((idx * _SIGN_A + _SIGN_B) % _P) & 1) * 2 - 1).to(torch.float32)
    return bucket, sign


def count_sketch(update: Mapping[str, Tensor], buckets: int = SKETCH_BUCKETS) -> Tensor:
    """CountSketch of the concatenated update (names sorted): inner products are preserved in
    expectation, so cosine(sketch_a, sketch_b) ≈ cosine(a, b), for dense and sparse updates alike."""
    out = torch.zeros(buckets, dtype=torch.float64)
    offset = 0
    for name in sorted(update):
        flat = update[name].reshape(-1).float()
        bucket, sign = _sketch_hash(offset, flat.numel(), buckets)
        out.index_add_(0, bucket, (flat * sign).double())
        offset += flat.numel()
    return out.float()


def cosine(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.double().norm()), float(b.double().norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a.double() @ b.double()) / (na * nb)
