"""What a round broadcasts to hosts: its aggregated update, dense or compressed (recipe `broadcast`).

`"dense"`: the aggregate itself, as fp32 safetensors (4 bytes a parameter).

`"codec"`: the aggregate plus the aggregator's own error-feedback residual, encoded with the epoch's
codec (for the round, `EpochContext.codec_for`), the same payload format hosts upload. The global
model is *defined* as the outer step applied with the decoded broadcast, so a host that decodes the
bytes it downloaded and steps its copy reaches the checkpoint hash on chain bit for bit, and the
residual (what the codec left out, kept by the aggregator, durable per round) joins the next round's
broadcast: nothing of the aggregate is lost, only delayed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

from training.codecs import ErrorFeedback, get_codec

BROADCAST_MODES = ("dense", "codec")


def residual_path(update_path: Path) -> Path:
    """Where a round's leftover residual is kept, beside its update file."""
    return update_path.with_suffix(".residual")


def compress_broadcast(
    update: Mapping[str, Tensor], codec_name: str, seed: int, previous_residual: Path | None, part: bool = False,
) -> tuple[bytes, dict[str, Tensor], dict[str, Tensor]]:
    """(the broadcast payload, its decoded tensors, the residual left for the next round). `codec_name`
    and `seed` (`training.codecs.round_seed` of the round) give the round's codec; `previous_residual`:
    the last finalized round's residual file (None, or absent: nothing left over yet). `part`: `update`
    is a streamed round's fragment; the other tensors' residuals are carried over as they are."""
    codec = get_codec(codec_name)
    feedback = ErrorFeedback(codec)
    if previous_residual is not None and previous_residual.exists():
        feedback.load_state_dict({"codec": codec.name, "decay": 1.0, "residual": load_file(str(previous_residual))})
    round_codec = codec.for_round(seed)
    payload = feedback.compress(update, round_codec, part=part)
    decoded = round_codec.decode(payload, {name: tuple(t.shape) for name, t in update.items()})
    return payload, {n: t.float() for n, t in decoded.items()}, feedback.residual


@dataclass(frozen=True)
class Broadcast:
    """A round's update as the outer step applies it and as it is written for hosts."""

    update: Mapping[str, Tensor]  # the aggregate ("dense") or the decoded broadcast ("codec")
    payload: bytes | None = None  # "codec": the bytes hosts download (the update file)
    residual: dict[str, Tensor] | None = None  # "codec": what the codec left out, for the next round


def prepare_broadcast(
    mode: str, aggregate: Mapping[str, Tensor], codec_name: str, seed: int, previous_residual: Path | None,
    part: bool = False,
) -> Broadcast:
    """The round's broadcast in the recipe's `mode` (a shard passes its fragment's aggregate and
    residual: codecs encode tensor by tensor, so a fragment's broadcast is its part of the whole's).
    `part`: a streamed round's fragment, whose residual file carries every fragment's (`compress_broadcast`)."""
    if mode != "codec":
        return Broadcast(aggregate)
    payload, decoded, residual = compress_broadcast(aggregate, codec_name, seed, previous_residual, part)
    return Broadcast(decoded, payload, residual)
