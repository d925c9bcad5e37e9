"""What an adversary's behaviour works with: its view of the round, and signing and sending as it likes.

`RoundView` is handed to a behaviour once per round (gonka_node/testing/adversary.py runs it in place of the
honest train-and-submit step); `send` signs a header for any payload (every field overridable) and
streams any body; `Outcome` is what the attempt did and how the aggregator answered.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from nacl.signing import SigningKey
from torch import Tensor

from gonka_node.core.client import SubmitRejected
from gonka_node.core.envelope import Submission
from gonka_node.core.wire import header_pb
from gonka_node.host.follow import GlobalModel
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import common_pb2 as common
from training.codecs import Codec, get_codec, round_seed
from training.diloco import pseudo_gradient
from training.worker import DiLoCoWorker

if TYPE_CHECKING:
    from gonka_node.testing.adversary import AdversarialHost

Tensors = dict[str, Tensor]


@dataclass(frozen=True)
class Outcome:
    """One attempt of an adversary: what it tried, and how the aggregator answered."""

    round: int
    attack: str
    accepted: bool
    reason: str  # RejectReason name (or gRPC status name when the server could not even parse it)
    ended_s: float = 0.0  # wall time (time.time()) when the call ended
    # what the attempt did, for the attacks that need more than a reason (sources, tries, timings)
    facts: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


# ---- what a behaviour works with -----------------------------------------------------------------


@dataclass
class RoundView:
    host: AdversarialHost
    worker: DiLoCoWorker
    gm: GlobalModel
    info: pb.RoundInfo

    @property
    def spec(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.gm.params.items()}

    @property
    def codec(self) -> Codec:
        """The round's codec, as honest hosts encode with it (shared-state codecs differ per round)."""
        return get_codec(self.info.codec).for_round(round_seed(self.worker.assignment.epoch_seed, self.info.round))

    def zeros(self) -> Tensors:
        return {n: torch.zeros(t.shape) for n, t in self.gm.params.items()}

    def claimed_tokens(self) -> int:
        """What an honest host of this recipe reports as trained this round."""
        c = self.worker.trainer.config
        return c.steps * c.grad_accum * c.micro_batch * c.seq_len

    def attempted(self) -> None:
        """Count this round's attempt as made now (before the behaviour returns): see `Staller`."""
        self.host.mark_attempted(self.info.round)

    def honest(self) -> tuple[bytes, int]:
        """The honest payload of this round (trains the worker as an honest host would)."""
        result = self.worker.train_round(self.info.round, self.gm.params)
        return result.payload, result.tokens

    def decode(self, payload: bytes) -> Tensors:
        return self.codec.decode(payload, self.spec)

    def encode(self, tensors: Mapping[str, Tensor]) -> bytes:
        return self.codec.encode(tensors)

    def train_on(self, ids: np.ndarray) -> tuple[bytes, int]:
        """Train H inner steps from the global model on windows `ids` (not the assignment)."""
        w = self.worker
        with torch.no_grad():
            for name, p in w.model.named_parameters():
                p.copy_(self.gm.params[name])
        result = w.trainer.run(w.windows.batches(ids, w.micro_batch))
        delta = pseudo_gradient(self.gm.params, dict(w.model.named_parameters()))
        return self.encode(delta), result.tokens

    def send(self, attack: str, payload: bytes, tokens: int = 0, **kw: Any) -> Outcome:
        return send(self, attack, payload, tokens, **kw)


def send(
    view: RoundView,
    attack: str,
    payload: bytes,
    tokens: int = 0,
    *,
    key: SigningKey | None = None,
    host: bytes | None = None,
    codec: str | None = None,
    body: bytes | None = None,
    signature: bytes | None = None,
    facts: Mapping[str, Any] | None = None,
) -> Outcome:
    """Sign a header for `payload` (fields overridable) and stream `body` (default: the payload)."""
    header = signed_header(view, payload, tokens, key=key, host=host, codec=codec, signature=signature)
    return submit_requests(view, attack, stream_of(header, payload if body is None else body), facts)


def signed_header(
    view: RoundView,
    payload: bytes,
    tokens: int = 0,
    *,
    key: SigningKey | None = None,
    host: bytes | None = None,
    codec: str | None = None,
    signature: bytes | None = None,
    residual_root: bytes = bytes(32),  # an adversary commits to what it likes; the aggregator takes any 32 bytes
) -> pb.SubmitHeader:
    h, info = view.host, view.info
    sub = Submission(
        chain_id=info.chain_id, registry=info.registry, epoch=info.epoch, round=info.round,
        host=host or h.host_bytes, base_checkpoint_sha256=info.base_checkpoint_sha256,
        codec=codec or info.codec, payload_sha256=hashlib.sha256(payload).digest(),
        payload_length=len(payload), tokens_trained=tokens, timestamp_ms=time.time_ns() // 1_000_000,
        residual_root=residual_root,
    )
    return header_pb(sub, signature if signature is not None else sub.sign(key or h.keys.node_key.signing_key))


def stream_of(header: pb.SubmitHeader, body: bytes, chunk: int = 1 << 20) -> list[pb.SubmitRequest]:
    return [pb.SubmitRequest(header=header)] + [
        pb.SubmitRequest(chunk=body[i : i + chunk]) for i in range(0, len(body), chunk)
    ]


def submit_requests(
    view: RoundView, attack: str, requests: list[pb.SubmitRequest], facts: Mapping[str, Any] | None = None
) -> Outcome:
    """Send `requests`; a payload the aggregator received is followed until its checks ran (they come
    after the receipt): one that failed them is an attempt refused, with the check's reason."""
    aggregator = view.host.aggregator
    try:
        receipt = aggregator.submit_raw(iter(requests))
    except SubmitRejected as exc:
        return Outcome(view.info.round, attack, False, exc.reason or exc.code.name, time.time(), facts or {})
    status = aggregator.checked(receipt.epoch, receipt.round, receipt.host)
    if status.state == pb.SubmissionStatus.FAILED:
        reason = common.RejectReason.Name(status.reason).removeprefix("REJECT_")
        return Outcome(view.info.round, attack, False, reason, time.time(), facts or {})
    return Outcome(view.info.round, attack, True, "", time.time(), facts or {})


def matched_noise(view: RoundView, delta: Tensors, scale: float = 1.0) -> Tensors:
    gen = torch.Generator().manual_seed(view.info.round * 7919 + int(view.host.host_bytes[0]))
    noise = {n: torch.randn(t.shape, generator=gen) for n, t in sorted(delta.items())}
    zero = torch.zeros((), dtype=torch.float64)  # sum()'s start: 0 + t is t, so the bits are unchanged
    norm_d = torch.sqrt(sum((t.double().square().sum() for t in delta.values()), zero))
    norm_n = torch.sqrt(sum((t.double().square().sum() for t in noise.values()), zero))
    k = float(norm_d / norm_n) * scale
    return {n: noise[n] * k for n in delta}




Behaviour = Callable[[RoundView], list[Outcome]]
