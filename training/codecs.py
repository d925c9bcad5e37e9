"""Compression codecs for pseudo-gradients: one interface, exact byte counts, strict decoding.

Every payload is `header · (numel · section)` per tensor, tensors in sorted name order:

    header (32 bytes, little-endian): magic b"GNKC" | version u8 | codec id u8 | reserved u16 = 0 |
        three codec parameters u32 | tensor count u32 | first 8 bytes of sha256(canonical spec)
    per tensor: numel u64, then the codec's section, whose size depends only on numel.

So a payload's size is a function of the codec and the tensor spec alone (`encoded_size`), the decoder
knows the exact size before reading anything, and every field it reads is checked against the spec it
expects (the global model's names and shapes): garbage raises `CodecError` naming what is wrong, and
nothing is allocated from a size the payload claims. Decoding uses single IEEE operations only, so
every machine decodes a payload to the same bits (the aggregate must be recomputable).

Codecs: `fp32`, `bf16`, `int8` and `int4` (block-wise absmax), `topk` (per chunk, the k largest
magnitudes with low-bit values), `mask` (a mask shared by a round's hosts). `ErrorFeedback` keeps what a
lossy codec dropped on the host and adds it to the next round's pseudo-gradient.

The format, its errors and the `Codec` interface are in `codec_base.py`, the codecs in `codecs_dense.py`
and `codecs_sparse.py`; this module is their one public face (import from here): the registry
(`CODECS`, `get_codec`), `round_seed` and `ErrorFeedback`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from training.codec_base import (
    CODEC_IDS,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Codec,
    CodecError,
    CodecIdError,
    HeaderError,
    MalformedSectionError,
    NonFiniteError,
    PayloadSizeError,
    Spec,
    SpecMismatchError,
    spec_digest,
    spec_of,
)
from training.codecs_dense import Bf16Codec, BlockQuantCodec, Fp32Codec
from training.codecs_sparse import SharedMaskCodec, TopKCodec
from training.diloco import add_measuring, sum_of_squares

__all__ = [  # the codecs' one public face: what was defined here before the format and the codecs moved out
    "CODECS",
    "CODEC_IDS",
    "CODEC_NAMES",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "Bf16Codec",
    "BlockQuantCodec",
    "Codec",
    "CodecError",
    "CodecIdError",
    "ErrorFeedback",
    "Fp32Codec",
    "HeaderError",
    "MalformedSectionError",
    "NonFiniteError",
    "PayloadSizeError",
    "SharedMaskCodec",
    "Spec",
    "SpecMismatchError",
    "TopKCodec",
    "get_codec",
    "round_seed",
    "spec_digest",
    "spec_of",
]


class ErrorFeedback:
    """What a lossy codec dropped stays on the host and joins the next round's pseudo-gradient.

    compress(Δ): e ← decay·e + Δ; payload = encode(e); e ← e − decode(payload). With decay = 1 this is
    classic error feedback (the sum of everything decoded converges on the sum of every Δ); decay < 1
    is SparseLoCo's variant, where the residual also acts as a momentum. The residual is decoded from
    the very payload sent, so it matches what the aggregator sees bit for bit.

    `previous` is the residual before the latest compress (e_{r−1}; a name absent there was zero) and
    `residual` the one after (e_r): the two a host opens when its round is challenged
    (training/residual_commit.py). Compressing replaces residual tensors and never mutates them, so
    `previous` holds the old tensors themselves: one residual of memory, no copy.
    """

    def __init__(self, codec: Codec, decay: float = 1.0) -> None:
        if not (math.isfinite(decay) and 0.0 <= decay <= 1.0):
            raise ValueError(f"ErrorFeedback: decay must be in [0, 1], got {decay}")
        self.codec, self.decay = codec, decay
        self.residual: dict[str, Tensor] = {}
        self.previous: dict[str, Tensor] = {}

    def compress(
        self, delta: Mapping[str, Tensor], codec: Codec | None = None,
        kept: dict[str, tuple[Tensor, Tensor]] | None = None, consume: bool = False,
        squares: dict[str, float] | None = None, part: bool = False,
    ) -> bytes:
        """Encode Δ plus the residual; `codec` overrides this round's codec (see `Codec.for_round`).
        `part`: Δ holds some of the model's tensors (a streamed round's fragment): the others' residuals
        stay as they are, and the payload is the fragment's (its header names its tensors alone). `previous`
        is then no round's e_{r−1} (the fragment's is from its last sync, the others' older): streamed
        epochs are never challenged, and nothing opens it.
        `kept`, for a sparse codec: filled with the payload's `decode_sparse`, as the encoder kept it.
        `consume`: Δ's tensors are the caller's to give up (it reads them no more): each residual is made
        in its Δ tensor instead of in new memory (the same bits: Δ + e is e + Δ); after a ValueError (a NaN
        or infinity: the residuals are as they were) what Δ's tensors hold is unspecified. `squares`: filled
        with each tensor's Σ Δ² (`sum_of_squares`, for Δ's norm), taken while Δ is read anyway."""
        codec = codec or self.codec
        if self.residual and not part and set(self.residual) != set(delta):
            raise ValueError("ErrorFeedback.compress: tensor names differ from the previous round's")
        before, previous = dict(self.residual), dict(self.previous)  # compress_tensor replaces, never mutates
        try:
            parts = [self.compress_tensor(name, delta[name], codec, kept, consume, squares) for name in sorted(delta)]
        except ValueError:
            self.residual, self.previous = before, previous  # a Δ with NaN or infinity changes nothing
            raise
        return codec.header(spec_of(delta)) + b"".join(parts)

    def compress_tensor(
        self, name: str, delta: Tensor, codec: Codec | None = None, kept_out: dict[str, tuple[Tensor, Tensor]] | None = None,
        consume: bool = False, squares: dict[str, float] | None = None,
    ) -> bytes:
        """One tensor's payload part (`Codec.encode_tensor`) of Δ plus its residual; updates that residual.
        Elementwise per tensor, so a rig whose processes each own some tensors (and their residuals)
        sends the bytes one process would (`training.sharded`). `consume`, `squares`: as in `compress`."""
        codec = codec or self.codec
        d = delta.detach().to(device="cpu", dtype=torch.float32)
        # The residual is made in `d` when it is ours (given up by the caller, or a converted copy) and
        # all of its storage (a view into a larger tensor would be saved whole with the worker state).
        owned = (consume or d.data_ptr() != delta.data_ptr()) and d.is_contiguous() and \
            d.untyped_storage().nbytes() == d.numel() * d.element_size()
        prev = self.residual.get(name)
        if owned and prev is not None and d.numel() and d.data_ptr() == prev.data_ptr():
            raise ValueError(f"ErrorFeedback.compress: {name}'s Δ is its own residual")
        if owned and prev is not None and squares is not None and prev.is_contiguous() and prev.shape == d.shape:
            measured = add_measuring(d, prev, self.decay)  # Δ's squares summed while Δ is read for the add
            target = d
        else:
            measured = sum_of_squares(d) if squares is not None else math.nan
            if prev is None:
                target = d if owned else d.clone()
            else:
                scaled = prev if self.decay == 1.0 else prev * torch.tensor(self.decay, dtype=torch.float32)
                target = d.add_(scaled) if owned else scaled + d
        if squares is not None:
            squares[name] = measured
        target = target.contiguous()  # its flat view is the encoded order
        part, kept = codec.encode_kept(name, target)
        if isinstance(kept, tuple):  # a sparse codec: the target less the kept values, where they are
            positions, values = kept
            flat = target.view(-1)  # `target` is this call's own tensor: the residual is made in it
            flat[positions] = flat[positions] - values
            self.residual[name] = target
            if kept_out is not None:
                kept_out[name] = kept
        else:
            self.residual[name] = target.sub_(kept)  # this call's own tensor: the residual is made in it
        if prev is None:
            self.previous.pop(name, None)
        else:
            self.previous[name] = prev
        return part

    def state_dict(self) -> dict[str, Any]:
        """Both residuals' tensors themselves, not copies: `compress` replaces a residual tensor and never
        updates one in place, so what this returns stays the state as of the call while compressing goes
        on (a host's rollback point and its saved state, each residual ~5 GB at 1.2B, copy nothing)."""
        return {
            "codec": self.codec.name,
            "decay": self.decay,
            "residual": dict(self.residual),
            "previous": dict(self.previous),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("codec") != self.codec.name or state.get("decay") != self.decay:
            raise ValueError(
                f"ErrorFeedback.load_state_dict: saved codec/decay {state.get('codec')}/{state.get('decay')} differ from {self.codec.name}/{self.decay}"
            )
        # shared, not cloned, for the reason `state_dict` gives: nothing updates them in place
        self.residual = dict(state["residual"])
        self.previous = dict(state.get("previous", {}))  # absent in older saves


def round_seed(epoch_seed: int, round_index: int) -> int:
    """The public per-round seed of codecs with shared state (`Codec.for_round`): hosts and aggregator
    derive it alike from the epoch seed and the round number, so nothing about it travels."""
    return epoch_seed * 1_000_003 + round_index


# name -> (the id written in every payload header, the factory taking the name's options): the one table.
_FACTORIES: dict[str, Callable[..., Codec]] = {
    "fp32": Fp32Codec,
    "bf16": Bf16Codec,
    "int8": lambda block=128: BlockQuantCodec(8, block),
    "int4": lambda block=64: BlockQuantCodec(4, block),
    "topk": TopKCodec,
    "mask": SharedMaskCodec,
}
if _FACTORIES.keys() != CODEC_IDS.keys():  # the header's ids and the factories name the same codecs
    raise RuntimeError(f"codec ids {sorted(CODEC_IDS)} and factories {sorted(_FACTORIES)} differ")
CODECS: dict[str, tuple[int, Callable[..., Codec]]] = {n: (CODEC_IDS[n], f) for n, f in _FACTORIES.items()}
CODEC_NAMES = tuple(CODECS)


def get_codec(name: str) -> Codec:
    """A codec by name, with optional integer options: "int8", "int8:block=64", "topk:chunk=4096,k=32,bits=2"."""
    base, _, opts = name.partition(":")
    if base not in CODECS:
        raise ValueError(f"unknown codec {base!r}; choose one of {', '.join(CODEC_NAMES)}")
    kwargs: dict[str, int] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value.strip().isdigit():
            raise ValueError(f"codec option {item!r} in {name!r} must be key=integer")
        kwargs[key.strip()] = int(value)
    try:
        return CODECS[base][1](**kwargs)
    except TypeError as exc:
        raise ValueError(f"codec {base!r} does not take options {sorted(kwargs)}") from exc
