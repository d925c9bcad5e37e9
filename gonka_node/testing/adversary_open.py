"""Attacks of strangers on an open network: earn without training, or hold up the round.

Each is a behaviour (gonka_node/testing/adversary_view.py) that uses only what such a host can see: the
tap on plaintext uploads (gonka_node/testing/adversary_tap.py), what the aggregator serves to everyone, and
the public rules. None trains except `Staller`, which needs a real upload to send half of.

- `Mixer` (`mix`): the average 0.5·(Δa + Δb) of two honest hosts' decoded updates of this round,
  re-encoded with the round's codec and signed as itself.
- `AggregateReuse` (`aggregate_reuse`): the previous round's public aggregated update (what every
  host applies) as its own Δ; a zero update when there is none (round 1, or after a skipped round).
- `Grinder` (`grind`): `AggregateReuse`'s update, submitted last: it waits for every other host's
  upload and nudges one value of its own until `predict_pick` says the replay check passes it over.
- `FrontRunner` (`front_run`): the victim's payload, taken off the tap while the victim's stream is
  still open, sent as its own so that it finishes first (exact copy; if refused as COPY, perturbed).
- `Staller` (`stall`): a valid signed header and half of its honest payload, then nothing: the
  stream stays open until the aggregator ends it or the staller's cap passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from safetensors.torch import load as load_safetensors

from gonka_node.testing.adversary_tap import Sighting, Tap
from gonka_node.testing.adversary_view import (
    Outcome,
    RoundView,
    Tensors,
    matched_noise,
    signed_header,
    stream_of,
)
from proto.gonka.v1 import aggregator_pb2 as pb

SETTLE_S = 1.0  # a staller's pause after its half: the aggregator has taken the header by then


@dataclass(frozen=True)
class KitSettings:
    """What the open-network attacks are told besides the tap and the victim."""

    sources: tuple[bytes, ...] = ()  # hosts a mixer watches (the harness: the honest ones)
    replay_fraction: float = 0.0  # the replay probability p the recipe states (a grinder predicts with it)
    stall_cap_s: float = 600.0  # how long a staller holds its stream before giving up itself
    grind_tries: int = 500
    patience_s: float = 30.0  # how long a grinder waits for non-source hosts' uploads


# ---- mix ----------------------------------------------------------------------------------------


class Mixer:
    def __init__(self, tap: Tap, sources: Sequence[bytes]) -> None:
        if len(sources) < 2:
            raise ValueError("behaviour 'mix' needs at least two source hosts to watch")
        self.tap, self.sources = tap, tuple(sources)

    def __call__(self, view: RoundView) -> list[Outcome]:
        a, b = self.tap.wait_accepted(self.sources, view.info.round, 2)
        mixed = view.encode(average(view.decode(a.payload), view.decode(b.payload)))
        facts = {"sources": [f"0x{a.owner.hex()}", f"0x{b.owner.hex()}"]}
        return [view.send("mix", mixed, int(a.header.tokens_trained), facts=facts)]


def average(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Tensors:
    return {n: 0.5 * (a[n] + b[n]) for n in a}


# ---- reuse of the public aggregate, and grinding the replay pick ---------------------------------


def served_update(view: RoundView) -> Tensors:
    """The previous round's aggregated update as the aggregator serves it to every host; zeros in
    round 1 and after a skipped round (no update is served then)."""
    if view.info.round <= 1:
        return view.zeros()
    try:
        data = view.host.aggregator.round_update(view.info.epoch, view.info.round - 1).data
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return view.zeros()
        raise
    served = load_safetensors(data)
    return {n: served[n].float() for n in view.spec}


def aggregate_reuse(view: RoundView) -> list[Outcome]:
    return [view.send("aggregate_reuse", view.encode(served_update(view)), view.claimed_tokens())]


def predict_pick(
    fraction: float, epoch: int, round_: int, base_sha256: bytes, digests: Mapping[bytes, bytes]
) -> set[bytes] | None:
    """The hosts the replay check will recompute this round, predicted from what a host can see before it
    submits (host → accepted payload digest, its own candidate included), or None where that is
    impossible. The pick (`gonka_node.aggregator.replay.chosen_for_replay`) is decided by the round's
    commit–reveal seed: on chain there is only keccak256 of the aggregator's secret until the round's
    submissions are fixed, and neither the digests nor anything else public changes it. So a grinder
    has nothing to grind: None. (The rule before the seed hashed the round's identity and every
    accepted digest, which the last submitter sees: 1 to 146 tries made it unpicked.)"""
    return None


def nudged(delta: Mapping[str, torch.Tensor], i: int) -> Tensors:
    """`delta` with its i-th value (all tensors flattened in name order) moved by 5% of that tensor's
    largest magnitude: a change of one value that survives 8-bit quantization, so the digest changes."""
    out = dict(delta)
    for name in sorted(delta):
        n = delta[name].numel()
        if i < n:
            flat = delta[name].flatten().clone()
            flat[i] += max(float(flat.abs().max()) * 0.05, 1e-6)
            out[name] = flat.view_as(delta[name])
            return out
        i -= n
    raise IndexError("nudge index past the update's size")


class Grinder:
    def __init__(self, tap: Tap, settings: KitSettings) -> None:
        self.tap, self.settings = tap, settings

    def __call__(self, view: RoundView) -> list[Outcome]:
        delta = served_update(view)
        others = self.others(view)
        payload, facts = self.grind(view, delta, others)
        return [view.send("grind", payload, view.claimed_tokens(), facts=facts)]

    def others(self, view: RoundView) -> dict[bytes, bytes]:
        """The accepted digests of every other host, once all of them have finished uploading. A host
        that has not finished after `patience_s` (a staller; another grinder waiting in turn) is not
        waited for, except the `sources` (the hosts it knows to upload: the honest ones)."""
        me, round_ = view.host.host_bytes, view.info.round
        expected = max(0, int(view.info.expected_hosts) - 1)

        def everyone() -> dict[bytes, Sighting] | None:
            done = {h: s for h, s in self.tap.completed(round_).items() if h != me}
            return done if len(done) >= expected else None

        def sources() -> bool | None:
            done = self.tap.completed(round_)
            return True if all(h in done for h in self.settings.sources if h != me) else None

        with contextlib.suppress(TimeoutError):
            self.tap.wait_for(everyone, f"upload of all {expected} other hosts in round {round_}", self.settings.patience_s)
        self.tap.wait_for(sources, f"upload of every source host in round {round_}", 600.0)
        return {h: d for h, d in self.tap.accepted_digests(round_).items() if h != me}

    def grind(self, view: RoundView, delta: Tensors, others: dict[bytes, bytes]) -> tuple[bytes, dict[str, Any]]:
        """The first variant (the update itself, then nudges) predicted not picked; else the update."""
        info, me = view.info, view.host.host_bytes
        plain = view.encode(delta)
        facts: dict[str, Any] = {"others": len(others), "tries": 0, "predictable": True, "picked": True}
        for k in range(self.settings.grind_tries):
            payload = plain if k == 0 else view.encode(nudged(delta, k - 1))
            digest = hashlib.sha256(payload).digest()
            pick = predict_pick(self.settings.replay_fraction, info.epoch, info.round,
                                bytes(info.base_checkpoint_sha256), others | {me: digest})
            if pick is None:
                facts["predictable"] = False
                return plain, facts
            facts["tries"] = k + 1
            if me not in pick:
                facts["picked"] = False
                return payload, facts
        return plain, facts


# ---- front-running a victim's upload --------------------------------------------------------------


class FrontRunner:
    def __init__(self, tap: Tap, victim: bytes) -> None:
        self.tap, self.victim = tap, victim

    def __call__(self, view: RoundView) -> list[Outcome]:
        seen = self.tap.wait_published(self.victim, view.info.round)
        open_when_taken = seen.done_s is None
        tokens = int(seen.header.tokens_trained)
        outcomes = [view.send("front_run", seen.payload, tokens)]
        if outcomes[0].reason == "COPY":  # the victim's upload finished first: a copy no digest matches
            delta = view.decode(seen.payload)
            noise = matched_noise(view, delta, 1e-3)
            moved = view.encode({n: delta[n] + noise[n] for n in delta})
            outcomes.append(view.send("front_run(perturbed)", moved, tokens))
        victim = self.tap.wait_done(self.victim, view.info.round)
        last = outcomes[-1]
        facts = {"victim_open_when_taken": open_when_taken, "victim_done_s": victim.done_s,
                 "victim_accepted": victim.accepted, "finished_first": last.ended_s < (victim.done_s or 0.0)}
        return [*outcomes[:-1], Outcome(last.round, last.attack, last.accepted, last.reason, last.ended_s, facts)]


# ---- holding a stream open ----------------------------------------------------------------------


class Staller:
    def __init__(self, cap_s: float) -> None:
        self.cap_s = cap_s

    def __call__(self, view: RoundView) -> list[Outcome]:
        payload, tokens = view.honest()
        half = stream_of(signed_header(view, payload, tokens), payload[: len(payload) // 2])
        sent, release, done = threading.Event(), threading.Event(), threading.Event()

        def requests() -> Iterator[pb.SubmitRequest]:
            yield from half
            sent.set()
            release.wait()  # send nothing more: the stream stays open

        # No gRPC deadline: how long the stream stays open is the aggregator's call, up to our cap.
        call = view.host.aggregator.stub.Submit.future(requests())
        call.add_done_callback(lambda _: done.set())
        started = time.monotonic()
        try:
            while not sent.wait(0.05) and not done.is_set() and time.monotonic() - started < self.cap_s:
                pass
            half_s = time.time()
            done.wait(SETTLE_S)
            view.attempted()
            ended_by = "server" if done.wait(max(0.0, self.cap_s - (time.time() - half_s))) else "cap"
            if ended_by == "cap":
                call.cancel()
            ended_s = time.time()
        finally:
            release.set()
        status, reason = call_status(call)
        facts = {"status": status, "reason": reason, "ended_by": ended_by, "half_sent_s": half_s,
                 "ended_s": ended_s, "held_s": ended_s - half_s, "half_bytes": len(payload) // 2}
        return [Outcome(view.info.round, "stall", status == "OK", reason or status, ended_s, facts)]


def call_status(call: Any) -> tuple[str, str]:
    """(gRPC status name, the aggregator's gonka-reason or "") of a finished or cancelled call."""
    if call.cancelled():
        return grpc.StatusCode.CANCELLED.name, ""
    try:
        call.result()
    except grpc.RpcError as exc:
        trailing = dict(exc.trailing_metadata() or ())
        return exc.code().name, str(trailing.get("gonka-reason", ""))
    return grpc.StatusCode.OK.name, ""


__all__ = [
    "FrontRunner", "Grinder", "KitSettings", "Mixer", "Staller", "aggregate_reuse",
    "predict_pick", "served_update",
]
