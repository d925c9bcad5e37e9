"""The adversary kit: host behaviours that attack a round, for tests and `scripts/bench_byzantine.py`.

An `AdversarialHost` is a `HostNode` whose "train and submit" step is replaced by a `Behaviour`; the
rest of the loop (sign in, follow the chain's model, wait for finalization) is the honest one, so an
adversary stays in step with the epoch. Honest code carries no attack flag: everything hostile is here.

Behaviours (`BEHAVIOURS`, by name):

- update attacks (train honestly, then send something else, correctly signed and encoded):
  `sign_flip` (−Δ), `scale100` (100·Δ), `noise` (Gaussian of Δ's norm), `lazy_zero` (Δ = 0),
  `lazy_base` (the base model itself as Δ), `other_data` (trained on an unassigned slot's windows),
  `heldout_data` (trained on the public held-out split), `stale` (re-signs its previous round's
  payload for the current round).
- garbage (signed, so provable): `nan`, `inf` (non-finite values in the encoded payload),
  `wrong_shape` (encoded for other tensor shapes).
- copies, from a network tap on another host's traffic (`TappedClient`): `copy` (re-signs the
  victim's payload), `copy_perturbed` (adds noise of 1e-3 of its norm), `replay` (resends the
  victim's previous signed request byte for byte).
- envelope/stream attacks: `forged_signature`, `foreign_signature` (signs as another host),
  `unregistered` (a key never signed in), `wrong_codec`, `truncated`, `oversized`, `malformed`
  (bytes that are not a protobuf message).

`protocol` sends every envelope/stream/garbage attack in one round; `mix` changes attack every round.
"""

from __future__ import annotations

import copy
import hashlib
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from eth_account import Account
from nacl.signing import SigningKey
from torch import Tensor

from gonka_node.aggregator.client import AggregatorClient, SubmitRejected, header_pb
from gonka_node.envelope import Submission
from gonka_node.host.follow import GlobalModel
from gonka_node.host.node import HostNode
from gonka_node.host.store import Progress
from proto.gonka.v1 import aggregator_pb2 as pb
from training.codecs import HEADER_SIZE, get_codec
from training.diloco import pseudo_gradient
from training.worker import DiLoCoWorker

Tensors = dict[str, Tensor]
SUBMIT_METHOD = "/gonka.v1.Aggregator/Submit"


@dataclass(frozen=True)
class Outcome:
    """One attempt of an adversary: what it tried, and how the aggregator answered."""

    round: int
    attack: str
    accepted: bool
    reason: str  # RejectReason name (or gRPC status name when the server could not even parse it)


# ---- the network tap (a copier's or replayer's source) -------------------------------------------


class Tap:
    """What a copier got hold of: each host's Submit request stream, per round. The wire is TLS, so
    this models a host sharing its payload, a leak at either end, or a pre-TLS deployment's wire."""

    def __init__(self) -> None:
        self.seen: dict[tuple[bytes, int], list[pb.SubmitRequest]] = {}

    def record(self, requests: list[pb.SubmitRequest]) -> None:
        if requests and requests[0].WhichOneof("part") == "header":
            h = requests[0].header
            self.seen[(bytes(h.host), h.round)] = requests

    def wait(self, host: bytes, round_: int, timeout_s: float = 600.0) -> list[pb.SubmitRequest]:
        deadline = time.monotonic() + timeout_s
        while (host, round_) not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tap saw no submission of 0x{host.hex()} in round {round_}")
            time.sleep(0.05)
        return self.seen[(host, round_)]

    @staticmethod
    def payload(requests: list[pb.SubmitRequest]) -> bytes:
        return b"".join(r.chunk for r in requests[1:])


class TappedClient(AggregatorClient):
    """An honest host's client whose traffic the tap copies (the host itself is unchanged)."""

    def __init__(self, target: str, tls_cert_pem: bytes, tap: Tap, timeout_s: float = 120.0) -> None:
        super().__init__(target, tls_cert_pem, timeout_s)
        self.tap = tap

    def submit_raw(self, requests: Iterator[pb.SubmitRequest]) -> pb.Receipt:
        seen = list(requests)
        try:
            return super().submit_raw(iter(seen))
        finally:
            # Seen once the whole stream has gone out: a copier that raced the victim's own upload
            # could win the "received first" order (docs/SECURITY.md, not stopped yet).
            self.tap.record(seen)


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

    def honest(self) -> tuple[bytes, int]:
        """The honest payload of this round (trains the worker as an honest host would)."""
        result = self.worker.train_round(self.info.round, self.gm.params)
        return result.payload, result.tokens

    def decode(self, payload: bytes) -> Tensors:
        return get_codec(self.info.codec).decode(payload, self.spec)

    def encode(self, tensors: Mapping[str, Tensor]) -> bytes:
        return get_codec(self.info.codec).encode(tensors)

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
) -> Outcome:
    """Sign a header for `payload` (fields overridable) and stream `body` (default: the payload)."""
    h, info = view.host, view.info
    sub = Submission(
        chain_id=info.chain_id, registry=info.registry, epoch=info.epoch, round=info.round,
        host=host or h.host_bytes, base_checkpoint_sha256=info.base_checkpoint_sha256,
        codec=codec or info.codec, payload_sha256=hashlib.sha256(payload).digest(),
        payload_length=len(payload), tokens_trained=tokens, timestamp_ms=time.time_ns() // 1_000_000,
    )
    sig = signature if signature is not None else sub.sign(key or h.keys.node_key.signing_key)
    return submit_requests(view, attack, _stream(header_pb(sub, sig), payload if body is None else body))


def _stream(header: pb.SubmitHeader, body: bytes, chunk: int = 1 << 20) -> list[pb.SubmitRequest]:
    return [pb.SubmitRequest(header=header)] + [
        pb.SubmitRequest(chunk=body[i : i + chunk]) for i in range(0, len(body), chunk)
    ]


def submit_requests(view: RoundView, attack: str, requests: list[pb.SubmitRequest]) -> Outcome:
    try:
        view.host.aggregator.submit_raw(iter(requests))
    except SubmitRejected as exc:
        return Outcome(view.info.round, attack, False, exc.reason or exc.code.name)
    return Outcome(view.info.round, attack, True, "")


# ---- behaviours ----------------------------------------------------------------------------------


Behaviour = Callable[[RoundView], list[Outcome]]


def update_attack(name: str, transform: Callable[[RoundView, Tensors], Tensors]) -> Behaviour:
    def act(view: RoundView) -> list[Outcome]:
        payload, tokens = view.honest()
        return [view.send(name, view.encode(transform(view, view.decode(payload))), tokens)]

    return act


def _noise(view: RoundView, delta: Tensors, scale: float = 1.0) -> Tensors:
    gen = torch.Generator().manual_seed(view.info.round * 7919 + int(view.host.host_bytes[0]))
    noise = {n: torch.randn(t.shape, generator=gen) for n, t in sorted(delta.items())}
    norm_d = torch.sqrt(sum(t.double().square().sum() for t in delta.values()))
    norm_n = torch.sqrt(sum(t.double().square().sum() for t in noise.values()))
    k = float(norm_d / norm_n) * scale
    return {n: noise[n] * k for n in delta}


def nonfinite(view: RoundView, value: float) -> bytes:
    """An encoded payload whose first stored float is `value` (int8/int4: a block scale; fp32: a value)."""
    payload, _ = view.honest()
    at = HEADER_SIZE + 8  # the first tensor's element count, then its section
    patch = struct.pack("<f", value) if not view.info.codec.startswith("bf16") else struct.pack("<f", value)[2:]
    return payload[:at] + patch + payload[at + len(patch) :]


def wrong_shape(view: RoundView) -> bytes:
    delta = {n: torch.zeros(t.shape) for n, t in view.gm.params.items()}
    name = sorted(delta)[0]
    delta[name] = torch.zeros(delta[name].numel() + 1)
    return view.encode(delta)


def other_slot_ids(view: RoundView) -> np.ndarray:
    """Its own slot's windows of a far-future round: real training data nobody trains on now."""
    w, a = view.worker, view.worker.assignment
    return w.windows.assignment(epoch_seed=a.epoch_seed, round_index=view.info.round + 1000,
                                slot=a.slot, max_slots=a.max_slots,
                                windows_per_host=w.trainer.config.windows_per_round)


def heldout_ids(view: RoundView) -> np.ndarray:
    w = view.worker
    ids = np.asarray(w.windows.heldout_ids)
    return np.resize(ids, w.trainer.config.windows_per_round)


def train_elsewhere(name: str, ids: Callable[[RoundView], np.ndarray]) -> Behaviour:
    def act(view: RoundView) -> list[Outcome]:
        payload, tokens = view.train_on(ids(view))
        return [view.send(name, payload, tokens)]

    return act


class Stale:
    """Round 1: honest (to have something to replay); later: its previous payload, re-signed."""

    def __init__(self) -> None:
        self.last: bytes | None = None

    def __call__(self, view: RoundView) -> list[Outcome]:
        if self.last is None:
            self.last, tokens = view.honest()
            return [view.send("stale(honest first round)", self.last, tokens)]
        return [view.send("stale", self.last, 1)]


class Copier:
    """Re-signs the victim's payload of this round (seen on the tap), exactly or slightly perturbed."""

    def __init__(self, tap: Tap, victim: bytes, perturb: float = 0.0) -> None:
        self.tap, self.victim, self.perturb = tap, victim, perturb

    def __call__(self, view: RoundView) -> list[Outcome]:
        requests = self.tap.wait(self.victim, view.info.round)
        payload = Tap.payload(requests)
        if self.perturb <= 0:
            return [view.send("copy", payload, requests[0].header.tokens_trained)]
        delta = view.decode(payload)
        noise = _noise(view, delta, self.perturb)
        moved = view.encode({n: delta[n] + noise[n] for n in delta})
        return [view.send("copy_perturbed", moved, requests[0].header.tokens_trained)]


class Replayer:
    """Resends the victim's signed request of the previous round byte for byte (round 1: of this round,
    after the victim: a second copy of a submission already received)."""

    def __init__(self, tap: Tap, victim: bytes) -> None:
        self.tap, self.victim = tap, victim

    def __call__(self, view: RoundView) -> list[Outcome]:
        old = max(1, view.info.round - 1)
        return [submit_requests(view, "replay", self.tap.wait(self.victim, old))]


def _malformed(view: RoundView) -> Outcome:
    call = view.host.aggregator.channel.stream_unary(
        SUBMIT_METHOD, request_serializer=lambda b: b, response_deserializer=pb.Receipt.FromString
    )
    try:
        call(iter([b"\xff\xff\xff\xff\x0f garbage"]), timeout=view.host.aggregator.timeout_s)
    except grpc.RpcError as exc:
        trailing = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
        return Outcome(view.info.round, "malformed", False,
                       str(trailing.get("gonka-reason", "")) or exc.code().name)  # type: ignore[attr-defined]
    return Outcome(view.info.round, "malformed", True, "")


def protocol_attacks(view: RoundView) -> list[Outcome]:
    """Every envelope, stream and garbage attack, each its own submission, in one round."""
    good = view.encode({n: torch.zeros(t.shape) for n, t in view.gm.params.items()})
    stranger = SigningKey(hashlib.sha256(b"unregistered" + view.host.host_bytes).digest())
    outsider = bytes.fromhex(Account.create().address[2:])
    victim = bytes(20) if view.host.victim is None else view.host.victim
    return [
        view.send("forged_signature", good, signature=bytes(64)),
        view.send("foreign_signature", good, host=victim),
        view.send("unregistered", good, key=stranger, host=outsider),
        view.send("wrong_codec", get_codec("fp32").encode(view.decode(good)), codec="fp32"),
        view.send("truncated", good, body=good[: len(good) // 2]),
        view.send("oversized", good, body=good + b"\x00" * 64),
        _malformed(view),
        view.send("nan", nonfinite(view, float("nan"))),
        view.send("inf", nonfinite(view, float("inf"))),
        view.send("wrong_shape", wrong_shape(view)),
    ]


def single(name: str, payload: Callable[[RoundView], bytes]) -> Behaviour:
    return lambda view: [view.send(name, payload(view))]


def make_behaviour(name: str, tap: Tap | None = None, victim: bytes | None = None) -> Behaviour:
    """A behaviour by name (`copy`, `copy_perturbed` and `replay` need the tap and the victim)."""
    simple: dict[str, Behaviour] = {
        "sign_flip": update_attack("sign_flip", lambda v, d: {n: -t for n, t in d.items()}),
        "scale100": update_attack("scale100", lambda v, d: {n: 100.0 * t for n, t in d.items()}),
        "noise": update_attack("noise", lambda v, d: _noise(v, d)),
        "lazy_zero": single("lazy_zero", lambda v: v.encode({n: torch.zeros(t.shape) for n, t in v.gm.params.items()})),
        "lazy_base": single("lazy_base", lambda v: v.encode(v.gm.params)),
        "other_data": train_elsewhere("other_data", other_slot_ids),
        "heldout_data": train_elsewhere("heldout_data", heldout_ids),
        "nan": single("nan", lambda v: nonfinite(v, float("nan"))),
        "inf": single("inf", lambda v: nonfinite(v, float("inf"))),
        "wrong_shape": single("wrong_shape", wrong_shape),
        "protocol": protocol_attacks,
    }
    if name in simple:
        return simple[name]
    if name == "stale":
        return Stale()
    if name in ("copy", "copy_perturbed", "replay"):
        if tap is None or victim is None:
            raise ValueError(f"behaviour {name!r} needs a tap on a victim host's traffic")
        if name == "replay":
            return Replayer(tap, victim)
        return Copier(tap, victim, 1e-3 if name == "copy_perturbed" else 0.0)
    if name == "mix":
        return Mix([make_behaviour(n, tap, victim) for n in MIX])
    raise ValueError(f"unknown behaviour {name!r}; choose one of {', '.join(BEHAVIOURS)}")


MIX = ("sign_flip", "copy_perturbed", "scale100", "noise", "lazy_zero", "nan")
BEHAVIOURS = (
    "sign_flip", "scale100", "noise", "lazy_zero", "lazy_base", "other_data", "heldout_data", "stale",
    "nan", "inf", "wrong_shape", "copy", "copy_perturbed", "replay", "protocol", "mix",
)
NEEDS_TAP = ("copy", "copy_perturbed", "replay", "mix")


class Mix:
    """A different attack every round (round r uses behaviour (r − 1) mod len)."""

    def __init__(self, behaviours: Sequence[Behaviour]) -> None:
        self.behaviours = list(behaviours)

    def __call__(self, view: RoundView) -> list[Outcome]:
        return self.behaviours[(view.info.round - 1) % len(self.behaviours)](view)


# ---- the host --------------------------------------------------------------------------------------


class AdversarialHost(HostNode):
    """A host node whose submission step runs `behaviour`; `outcomes` lists every attempt."""

    def __init__(self, *args: Any, behaviour: Behaviour, victim: bytes | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.behaviour, self.victim = behaviour, victim
        self.outcomes: list[Outcome] = []

    def _train_and_submit(
        self, worker: DiLoCoWorker, gm: GlobalModel, info: pb.RoundInfo, progress: Progress
    ) -> None:
        before = copy.deepcopy(worker.state_dict())
        started = time.monotonic()
        outcomes = self.behaviour(RoundView(self, worker, gm, info))
        self.outcomes.extend(outcomes)
        accepted = [o for o in outcomes if o.accepted]
        self.events.submitted(info.round, bool(accepted), ";".join(o.reason for o in outcomes),
                              time.monotonic() - started)
        if accepted:
            progress.submitted[str(info.round)] = accepted[0].attack
        else:
            worker.load_state_dict(before)


def reasons_by_attack(outcomes: Sequence[Outcome]) -> dict[str, str]:
    """attack → the aggregator's answer ("" when accepted) of its latest attempt."""
    return {o.attack: ("" if o.accepted else o.reason) for o in outcomes}


__all__ = [
    "BEHAVIOURS", "NEEDS_TAP", "AdversarialHost", "Outcome", "Tap", "TappedClient", "make_behaviour",
    "reasons_by_attack",
]
