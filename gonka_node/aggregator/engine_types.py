"""What the round engine (`rounds.RoundEngine`) is built from and hands out: the epoch's fixed context,
the checkpoint and evidence interfaces it writes through, and the receipts it signs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from gonka_node.aggregator.reasons import Reason
from gonka_node.aggregator.replay import ReplayData
from gonka_node.aggregator.scoring import ScoringData
from gonka_node.aggregator.validate import Codec
from gonka_node.core.envelope import ReceiptBody, Submission
from gonka_node.core.fragments import global_offsets
from training.codecs import round_seed
from training.streaming import StreamSchedule

if TYPE_CHECKING:
    from gonka_node.aggregator.shard import ShardRole
    from training.model import Llama


class CheckpointIO(Protocol):
    """`training.checkpoint`'s save/load, narrowed to what the aggregator needs."""

    def save(self, path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes: ...

    def load(self, path: Path, expected_sha256: bytes | None = None) -> dict[str, Tensor]: ...


@dataclass(frozen=True)
class EpochContext:
    """Everything fixed for one epoch: identity on chain, codec, model shape, outer step, rewards."""

    chain_id: int
    registry: bytes
    epoch: int
    codec_name: str
    codec: Codec
    spec: Mapping[str, tuple[int, ...]]
    n_rounds: int
    round_length_s: float
    outer_lr: float
    outer_momentum: float
    reward_per_round: int
    initial_checkpoint: Path
    initial_sha256: bytes
    epoch_seed: int = 0  # the recipe's; codecs with shared per-round state derive it (round_seed)
    model_factory: Callable[[], Llama] | None = None  # None: no scoring (every valid update counts)
    scoring: ScoringData | None = None
    # json.dumps(ModelConfig.to_dict()), stored in every checkpoint's metadata (training.hf_export's
    # MODEL_CONFIG_KEY) so clients export/sample a pulled checkpoint without the recipe; None: omitted.
    model_config: str | None = None
    # The recipe's rounds are replayable (round_state = "fresh"): what the replay check needs; None: no check.
    replay: ReplayData | None = None
    replay_probability: float = 0.0  # the epoch's p (chain): each host's round is replayed with it
    recipe_json: bytes | None = None  # the recipe's canonical JSON (sha256 = the epoch's model_spec_hash)
    overlap: str = "off"  # the recipe's overlap rule: which global model a round trains from (training/overlap.py)
    forecast_step: int = 0  # "eager": the step a round moves onto its forecast (training/overlap.py); 0: from the start
    merge_step: int = 0  # "eager": the step a round moves onto the model after r − 1; 0: never
    broadcast: str = "dense"  # the recipe's: the aggregated update served dense or encoded (aggregator/broadcast.py)
    shard: ShardRole | None = None  # one of several aggregators: `spec` is then its fragment's (aggregator/shard.py)
    # The recipe's error-feedback decay and top-k challenge sample (aggregator/challenges.py): what a
    # picked top-k host opens, and how its claimed update is rebuilt from the opening.
    ef_decay: float = 1.0
    residual_sample: float = 0.01
    residual_sample_min: int = 1_048_576
    # A streamed epoch (recipe stream_fragments > 1, training/streaming.py): round r's payloads, aggregate,
    # outer step and broadcast are the tensors of its fragment alone (`spec_for`); None: the whole model.
    stream: StreamSchedule | None = None

    def codec_for(self, round_: int) -> Codec:
        """The epoch's codec as used in `round_` (differs per round only for shared-state codecs)."""
        return self.codec.for_round(round_seed(self.epoch_seed, round_))

    def spec_for(self, round_: int) -> Mapping[str, tuple[int, ...]]:
        """The tensors round `round_`'s payloads and update hold: `spec`, or a streamed round's fragment."""
        if self.stream is None:
            return self.spec
        return self.stream.fragment_of(round_).spec(self.spec)

    def offsets_for(self, round_: int) -> Mapping[str, int] | None:
        """Where round `round_`'s tensors sit in the whole update, for sketches comparable across rounds
        and shards (a shard's fragment, or a streamed round's); None: they are the whole update."""
        if self.shard is not None:
            return self.shard.offsets
        if self.stream is None:
            return None
        everywhere = global_offsets(self.spec)
        return {name: everywhere[name] for name in self.stream.fragment_of(round_).names}


class EvidenceSink(Protocol):
    """Keeps what a host provably signed when it was refused for a reason honest software never
    produces (a copy of another host's payload; a payload that fails decoding or the update checks).
    `gonka_node.slashing.EvidenceLog` is the implementation; None keeps no evidence."""

    def signed_rejection(
        self, sub: Submission, signature: bytes, reason: Reason, detail: str, payload: Path | None
    ) -> None: ...


class SeedPending(RuntimeError):
    """Another aggregator of the epoch has not revealed its round-seed secret yet."""


class OpeningsPending(RuntimeError):
    """A top-k round's challenged hosts have not all opened their residual, and the deadline is ahead."""


@dataclass(frozen=True)
class InFlight:
    """An authenticated upload still streaming: what its signed header committed to, and when."""

    payload_sha256: bytes
    started_ms: int
    signature: bytes


@dataclass(frozen=True)
class SignedReceipt:
    body: ReceiptBody
    signature: bytes
    aggregator_key: bytes


def clock_text(ms: int) -> str:
    """A millisecond Unix time as a log line shows it: 2025-06-01 14:03:12.345 UTC."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"
