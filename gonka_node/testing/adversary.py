"""The adversary kit: host behaviours that attack a round, for tests and `scripts/bench_byzantine.py`.

An `AdversarialHost` is a `HostNode` whose "train and submit" step is replaced by a `Behaviour`; the
rest of the loop (sign in, follow the chain's model, wait for finalization) is the honest one, so an
adversary stays in step with the epoch. Honest code carries no attack flag: everything hostile is here
(and in `gonka_node.testing.adversary_tap`, the network tap; `gonka_node.testing.adversary_open`, the attacks of
strangers who skip or fake the work).

Behaviours (`BEHAVIOURS`, by name):

- update attacks (train honestly, then send something else, correctly signed and encoded):
  `sign_flip` (−Δ), `scale100` / `scale3` / `scale_half` (100·Δ, 3·Δ, 0.5·Δ), `noise` (Gaussian of
  Δ's norm), `lazy_zero` (Δ = 0), `lazy_base` (the base model itself as Δ), `other_data` (trained on an
  unassigned slot's windows), `heldout_data` (trained on the public held-out split), `stale` (re-signs
  its previous round's payload for the current round).
- garbage (signed, so provable): `nan`, `inf` (non-finite values in the encoded payload),
  `wrong_shape` (encoded for other tensor shapes).
- copies, from a network tap on other hosts' traffic (`TappedClient`): `copy` (re-signs the
  victim's payload), `copy_perturbed` (adds noise of 1e-3 of its norm), `replay` (resends the
  victim's previous signed request byte for byte).
- no training at all (gonka_node/testing/adversary_open.py): `mix` (the average of two honest hosts'
  updates), `aggregate_reuse` (the previous round's public aggregate), `grind` (that, varied until
  the public replay pick passes it over), `front_run` (the victim's payload, finished before the
  victim's own upload), `stall` (half an honest upload, then a stream held open).
- envelope/stream attacks: `forged_signature`, `foreign_signature` (signs as another host),
  `unregistered` (a key never signed in), `wrong_codec`, `truncated`, `oversized`, `malformed`
  (bytes that are not a protobuf message).

`protocol` sends every envelope/stream/garbage attack in one round; `rotate` changes attack every round.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
import torch
from eth_account import Account
from nacl.signing import SigningKey

from gonka_node.host.follow import GlobalModel
from gonka_node.host.node import HostNode
from gonka_node.host.store import Progress
from gonka_node.testing.adversary_open import (
    FrontRunner,
    Grinder,
    KitSettings,
    Mixer,
    Staller,
    aggregate_reuse,
    predict_pick,
)
from gonka_node.testing.adversary_tap import Tap, TappedClient
from gonka_node.testing.adversary_view import (
    Behaviour,
    Outcome,
    RoundView,
    Tensors,
    matched_noise,
    submit_requests,
)
from proto.gonka.v1 import aggregator_pb2 as pb
from training.codecs import HEADER_SIZE, get_codec
from training.worker import DiLoCoWorker

SUBMIT_METHOD = "/gonka.v1.Aggregator/Submit"


# ---- behaviours ----------------------------------------------------------------------------------


def update_attack(name: str, transform: Callable[[RoundView, Tensors], Tensors]) -> Behaviour:
    def act(view: RoundView) -> list[Outcome]:
        payload, tokens = view.honest()
        return [view.send(name, view.encode(transform(view, view.decode(payload))), tokens)]

    return act


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
        noise = matched_noise(view, delta, self.perturb)
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
        trailing = dict(exc.trailing_metadata() or ())
        return Outcome(view.info.round, "malformed", False,
                       str(trailing.get("gonka-reason", "")) or exc.code().name)
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


def make_behaviour(
    name: str, tap: Tap | None = None, victim: bytes | None = None, settings: KitSettings | None = None
) -> Behaviour:
    """A behaviour by name (those in `NEEDS_TAP` need the tap; copies and `front_run` a victim too)."""
    kit = settings or KitSettings()
    simple: dict[str, Behaviour] = {
        "sign_flip": update_attack("sign_flip", lambda v, d: {n: -t for n, t in d.items()}),
        "scale100": update_attack("scale100", lambda v, d: {n: 100.0 * t for n, t in d.items()}),
        "scale3": update_attack("scale3", lambda v, d: {n: 3.0 * t for n, t in d.items()}),
        "scale_half": update_attack("scale_half", lambda v, d: {n: 0.5 * t for n, t in d.items()}),
        "noise": update_attack("noise", lambda v, d: matched_noise(v, d)),
        "lazy_zero": single("lazy_zero", lambda v: v.encode(v.zeros())),
        "lazy_base": single("lazy_base", lambda v: v.encode(v.gm.params)),
        "other_data": train_elsewhere("other_data", other_slot_ids),
        "heldout_data": train_elsewhere("heldout_data", heldout_ids),
        "nan": single("nan", lambda v: nonfinite(v, float("nan"))),
        "inf": single("inf", lambda v: nonfinite(v, float("inf"))),
        "wrong_shape": single("wrong_shape", wrong_shape),
        "protocol": protocol_attacks,
        "aggregate_reuse": aggregate_reuse,
    }
    if name in simple:
        return simple[name]
    if name == "stale":
        return Stale()
    if name == "stall":
        return Staller(kit.stall_cap_s)
    if name not in NEEDS_TAP:
        raise ValueError(f"unknown behaviour {name!r}; choose one of {', '.join(BEHAVIOURS)}")
    if tap is None or (victim is None and name in NEEDS_VICTIM):
        raise ValueError(f"behaviour {name!r} needs a tap on other hosts' traffic" +
                         (" and a victim" if name in NEEDS_VICTIM else ""))
    return tapped_behaviour(name, tap, victim or bytes(20), kit)


def tapped_behaviour(name: str, tap: Tap, victim: bytes, kit: KitSettings) -> Behaviour:
    if name == "replay":
        return Replayer(tap, victim)
    if name in ("copy", "copy_perturbed"):
        return Copier(tap, victim, 1e-3 if name == "copy_perturbed" else 0.0)
    if name == "mix":
        return Mixer(tap, kit.sources)
    if name == "grind":
        return Grinder(tap, kit)
    if name == "front_run":
        return FrontRunner(tap, victim)
    return Rotate([make_behaviour(n, tap, victim, kit) for n in ROTATION])


ROTATION = ("sign_flip", "copy_perturbed", "scale100", "noise", "lazy_zero", "nan")
BEHAVIOURS = (
    "sign_flip", "scale100", "scale3", "scale_half", "noise", "lazy_zero", "lazy_base", "other_data",
    "heldout_data", "stale", "nan", "inf", "wrong_shape", "copy", "copy_perturbed", "replay", "protocol",
    "rotate", "mix", "aggregate_reuse", "grind", "front_run", "stall",
)
NEEDS_TAP = ("copy", "copy_perturbed", "replay", "rotate", "mix", "grind", "front_run")
NEEDS_VICTIM = ("copy", "copy_perturbed", "replay", "rotate", "front_run")


class Rotate:
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

    def mark_attempted(self, round_: int) -> None:
        """Tell the events this round's attempt is made while the behaviour still runs (a held stream)."""
        self.events.submitted(round_, False, "attempt made; its stream is still open", 0.0)

    def _train_and_submit(
        self, worker: DiLoCoWorker | None, gm: GlobalModel, info: pb.RoundInfo, progress: Progress
    ) -> None:
        assert worker is not None, "an adversarial host trains in one process (no rig)"
        before = worker.snapshot()
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
    "BEHAVIOURS", "NEEDS_TAP", "AdversarialHost", "KitSettings", "Outcome", "Tap", "TappedClient",
    "make_behaviour", "predict_pick", "reasons_by_attack",
]
