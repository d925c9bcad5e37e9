"""Shards on different machines: a `ShardExchange` over the `Shard` gRPC service (docs/PROTOCOL.md
"The Shard service").

Every message this shard puts is signed with its node key, held in its own `Inbox` (the outbox,
durable before anything is sent) and pushed to the shards that read it: reports and blobs to the
verifier, verdicts and fragment hashes to every shard. The verifier forwards every shard's signed report
(as its signer signed it) to every other shard before its verdict, so each shard can check the verdict
against the reports it names (`shard_audit`). What others push is checked and held by the
`ShardService` beside the round engine's `Aggregator` service (same port, same TLS identity). Reads are
local: the close that polls them (every tick while `ShardPending`) first sends again whatever a peer
has not acknowledged, so a peer that was down, or this shard after a restart, catches up.

Peers are found on chain, as hosts find aggregators (`core.discovery`): shard k is the epoch's k-th
aggregator; its endpoint and certificate are the ones its account announced. A receiver learns shard
k's node key by asking shard k itself (`Shard.Hello`) over a channel pinned to that certificate, so the
key that must sign shard k's messages is bound to the chain's record of shard k through its TLS
identity (the chain records no ed25519 key for aggregators).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from nacl.signing import SigningKey

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.shard import FragmentReport, Verdict
from gonka_node.aggregator.shard_evidence import SignedPart, verdict_evidence, write_evidence
from gonka_node.aggregator.shard_inbox import (
    VERIFIER,
    Inbox,
    ShardReason,
    ShardRefused,
    Signed,
    acked_at,
    body_digest,
    kind_at,
)
from gonka_node.core.envelope import EnvelopeError
from gonka_node.core.shard_envelope import ShardKind, ShardMessage
from gonka_node.core.tls import pinned_channel
from proto.gonka.v1 import shard_pb2 as spb
from proto.gonka.v1 import shard_pb2_grpc as spb_grpc

log = logging.getLogger(__name__)
CHUNK = 1 << 20
MESSAGE_LIMIT = 4 << 20
REASON_KEY = "gonka-shard-reason"
RETRY_S = 1.0  # a peer that failed is tried again after this long (the close polls every tick)
PUT_BYTES_PER_S = 8 << 20  # a Put's deadline grows with its body at this rate
# Refusals that will not change by sending again: the peer has moved on or the message is wrong. A
# QUOTA refusal may: the sender's earlier Puts still streaming there end and give their bytes back; and
# UNHELD_HOST: the host's own upload to the receiver may land after the sender's close began; and
# SEED_PENDING: the receiver's own close stores the round's seed the next time it reads the chain.
RETRIED = (ShardReason.FUTURE_ROUND, ShardReason.UNKNOWN_SHARD, ShardReason.QUOTA, ShardReason.UNHELD_HOST,
           ShardReason.SEED_PENDING)
FINAL = frozenset(r for r in ShardReason if r not in RETRIED)


@dataclass(frozen=True)
class ShardPeer:
    target: str  # host:port
    tls_cert_pem: bytes


class PeerDirectory(Protocol):
    """Where shard k serves and the certificate to pin (None: not known yet)."""

    def peer(self, index: int) -> ShardPeer | None: ...

    def forget(self, index: int) -> None:
        """Look again next time (the peer moved or restarted elsewhere)."""


class ChainDirectory:
    """Peers as their accounts announced them on chain for the epoch (shard k: the k-th aggregator),
    read through the engine's `ChainView` (its lock serializes every chain call)."""

    def __init__(self, view: ChainView, epoch: int) -> None:
        self.view, self.epoch = view, epoch
        self._known: dict[int, ShardPeer] = {}

    def peer(self, index: int) -> ShardPeer | None:
        if index not in self._known:
            order = [a.lower() for a in self.view.call(self.view.chain.get_epoch, self.epoch).spec.aggregators]
            for a in self.view.aggregator_endpoints(self.epoch):
                if a.address.lower() in order:
                    self._known[order.index(a.address.lower())] = ShardPeer(a.endpoint, a.tls_cert_pem)
        return self._known.get(index)

    def forget(self, index: int) -> None:
        self._known.pop(index, None)


def envelope_pb(s: Signed) -> spb.ShardEnvelope:
    h = s.header
    return spb.ShardEnvelope(
        chain_id=h.chain_id, registry=bytes(h.registry), epoch=h.epoch, round=h.round, kind=spb.ShardKind.Value(f"SHARD_{h.kind.name}"),
        sender=h.sender, count=h.count, key=h.key, body_sha256=bytes(h.body_sha256), body_length=h.body_length,
        sequence=h.sequence, signature=s.signature,
    )


def message_from_pb(e: spb.ShardEnvelope) -> ShardMessage:
    """The signed header a received envelope claims (ShardRefused MALFORMED when it cannot be one)."""
    try:
        return ShardMessage(e.chain_id, e.registry, e.epoch, e.round, ShardKind(e.kind), e.sender, e.count, e.key,
                            e.body_sha256, e.body_length, e.sequence)
    except (EnvelopeError, ValueError) as exc:
        raise ShardRefused(ShardReason.MALFORMED, f"the envelope is not a shard message: {exc}") from None


def put_requests(s: Signed) -> Iterator[spb.ShardPut]:
    yield spb.ShardPut(envelope=envelope_pb(s))
    view = memoryview(s.body)
    for at in range(0, len(s.body), CHUNK):
        yield spb.ShardPut(data=bytes(view[at : at + CHUNK]))


class _Link:
    """A pinned channel to one peer, and its node key once it said it."""

    def __init__(self, peer: ShardPeer) -> None:
        self.peer = peer
        options = [("grpc.max_receive_message_length", MESSAGE_LIMIT), ("grpc.max_send_message_length", MESSAGE_LIMIT)]
        self.channel = pinned_channel(peer.target, peer.tls_cert_pem, options)
        self.stub = spb_grpc.ShardStub(self.channel)
        self.node_key: bytes | None = None


class NetExchange:
    """`ShardExchange` over gRPC: signed puts pushed to the peers that read them, local reads."""

    def __init__(
        self, inbox: Inbox, signer: SigningKey, peers: PeerDirectory, timeout_s: float = 10.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.inbox, self.signer, self.peers, self.timeout_s, self.clock = inbox, signer, peers, timeout_s, clock
        self.me = inbox.me
        self._links: dict[int, _Link] = {}
        self._retry_at: dict[int, float] = {}
        self._learn_at: dict[int, float] = {}  # no key lookup for a peer before this (monotonic s)
        self._lock = threading.Lock()

    @property
    def node_key_bytes(self) -> bytes:
        return bytes(self.signer.verify_key)

    # ---- ShardExchange -----------------------------------------------------------------------------

    def put_report(self, report: FragmentReport) -> None:
        self._put(report.epoch, report.round, ShardKind.REPORT, "", report.to_json().encode("utf-8"))

    def reports(self, epoch: int, round_: int) -> list[FragmentReport]:
        self.flush(epoch, round_)
        return [FragmentReport.from_json(s.body.decode("utf-8")) for s in self.inbox.held(epoch, round_, ShardKind.REPORT)]

    def put_verdict(self, verdict: Verdict) -> None:
        if self.verdict(verdict.epoch, verdict.round) is None:  # the first verdict stands
            self._forward_reports(verdict.epoch, verdict.round)  # the reports it names, first
            self._put(verdict.epoch, verdict.round, ShardKind.VERDICT, "", verdict.to_json().encode("utf-8"))

    def verdict(self, epoch: int, round_: int) -> Verdict | None:
        self.flush(epoch, round_)
        held = self.inbox.held(epoch, round_, ShardKind.VERDICT)
        return Verdict.from_json(held[0].body.decode("utf-8")) if held else None

    def put_hash(self, epoch: int, round_: int, index: int, sha256: bytes) -> None:
        self._own(index)
        self._put(epoch, round_, ShardKind.HASH, "", bytes(sha256))

    def hashes(self, epoch: int, round_: int) -> dict[int, bytes]:
        self.flush(epoch, round_)
        return {s.header.sender: s.body for s in self.inbox.held(epoch, round_, ShardKind.HASH)}

    def put_blob(self, epoch: int, round_: int, index: int, key: str, data: bytes) -> None:
        self._own(index)
        self._put(epoch, round_, ShardKind.BLOB, key, bytes(data))

    def blob(self, epoch: int, round_: int, index: int, key: str) -> bytes | None:
        self.flush(epoch, round_)
        probe = ShardMessage(self.me.chain_id, self.me.registry, epoch, round_, ShardKind.BLOB, index,
                             self.me.count, key, bytes(32), 0, 0)
        held = self.inbox.get(probe)
        return held.body if held is not None else None

    def file_contradiction(self, epoch: int, round_: int, why: str) -> Path | None:
        held = self.inbox.held(epoch, round_, ShardKind.VERDICT) + self.inbox.held(epoch, round_, ShardKind.REPORT)
        keys = {s.header.sender: self.known_key(s.header.sender) for s in held}
        known = {k: v for k, v in keys.items() if v is not None}
        if not held or held[0].header.kind != ShardKind.VERDICT or len(known) < len(keys):
            return None
        parts = [SignedPart(s.header, s.signature, s.body) for s in held]
        return write_evidence(self.inbox.evidence_dir, verdict_evidence(parts[0], parts[1:], known, why))

    def _own(self, index: int) -> None:
        if index != self.me.index:
            raise ValueError(f"shard {self.me.index} cannot put shard {index}'s messages")

    # ---- sending -----------------------------------------------------------------------------------

    def _put(self, epoch: int, round_: int, kind: ShardKind, key: str, body: bytes) -> None:
        me = self.me
        header = ShardMessage(me.chain_id, me.registry, epoch, round_, kind, me.index, me.count, key,
                              body_digest(body), len(body), self.clock())
        signed = Signed(header, header.sign(self.signer), body)
        self.inbox.keep(signed)  # durable first: a crash from here on sends it again after the restart
        if kind == ShardKind.REPORT:  # after this shard's blobs of the round (`flush`)
            self.flush(epoch, round_)
            return
        for peer in self._recipients(kind):
            self._deliver(signed, peer)

    def _recipients(self, kind: ShardKind) -> list[int]:
        everyone = [k for k in range(self.me.count) if k != self.me.index]
        return everyone if kind in (ShardKind.VERDICT, ShardKind.HASH) else [k for k in everyone if k == VERIFIER]

    def flush(self, epoch: int, round_: int) -> None:
        """Send again this shard's messages of the round that a peer has not acknowledged (the verifier,
        once its verdict is held: the reports it forwards too). Blobs go first, and the report only once
        the verifier took every blob of the round (or refused it for good): the report tells it they are
        in, so it would otherwise decide without a blob the verifier refused for a retry (`SEED_PENDING`,
        `UNHELD_HOST`) and fail that attempt of its close."""
        if self.me.index == VERIFIER and self.inbox.files(epoch, round_, ShardKind.VERDICT):
            self._forward_reports(epoch, round_)  # first: a verdict that arrives before them waits a tick
        mine = self.inbox.outbox(epoch, round_)
        blobs = [p for p in mine if kind_at(p) == ShardKind.BLOB]
        for path in blobs:
            self._send_due(path, self._recipients(ShardKind.BLOB))
        blobs_out = self.me.index != VERIFIER and not all(acked_at(p, VERIFIER) for p in blobs)
        for path in mine:
            kind = kind_at(path)
            if kind != ShardKind.BLOB and not (kind == ShardKind.REPORT and blobs_out):
                self._send_due(path, self._recipients(kind))

    def _forward_reports(self, epoch: int, round_: int) -> None:
        """Every held report, as its signer signed it, to every shard but its signer and this one."""
        for path in self.inbox.files(epoch, round_, ShardKind.REPORT):
            signer = int(path.stem.split("-")[1])
            self._send_due(path, [k for k in range(self.me.count) if k not in (self.me.index, signer)])

    def _send_due(self, path: Path, recipients: list[int]) -> None:
        now = time.monotonic()
        due = [p for p in recipients if not acked_at(path, p) and now >= self._retry_at.get(p, 0.0)]
        if due:  # read the message (a blob may be large) only when some peer still lacks it
            signed = Signed.from_bytes(path.read_bytes())
            for peer in due:
                self._deliver(signed, peer)

    def _deliver(self, s: Signed, peer: int) -> None:
        if time.monotonic() < self._retry_at.get(peer, 0.0):
            return
        link = self._link(peer)
        if link is None:
            self._retry_at[peer] = time.monotonic() + RETRY_S
            return
        try:
            link.stub.Put(put_requests(s), timeout=self.timeout_s + len(s.body) / PUT_BYTES_PER_S)
        except grpc.RpcError as exc:
            self._failed(s, peer, exc)
            return
        except ValueError:  # the channel was closed meanwhile (`_drop` from a failed key lookup): later
            self._retry_at[peer] = time.monotonic() + RETRY_S
            return
        self.inbox.ack(s, peer)

    def _failed(self, s: Signed, peer: int, exc: grpc.RpcError) -> None:
        reason = refusal_of(exc)
        h = s.header
        what = f"shard {peer} refused {h.kind.name} of round {h.epoch}/{h.round}"
        if reason in FINAL:
            log.warning("%s: %s (%s); not sent again", what, reason.name if reason else "?", exc.details())
            self.inbox.ack(s, peer)
            return
        log.info("%s: %s (%s); sending again later", what, reason.name if reason else exc.code().name, exc.details())
        self._retry_at[peer] = time.monotonic() + RETRY_S
        if reason is None:  # unreachable or restarted elsewhere: dial afresh next time
            self._drop(peer)

    # ---- peers ---------------------------------------------------------------------------------------

    def _link(self, peer: int) -> _Link | None:
        with self._lock:
            if peer in self._links:
                return self._links[peer]
            found = self.peers.peer(peer)
            if found is None:
                return None
            self._links[peer] = _Link(found)
            return self._links[peer]

    def _drop(self, peer: int) -> None:
        with self._lock:
            link = self._links.pop(peer, None)
        if link is not None:
            link.channel.close()
        self.peers.forget(peer)

    def known_key(self, index: int) -> bytes | None:
        """Shard `index`'s node key for checking a received message, learned at most once at a time per
        peer and not again within `RETRY_S` of a failed lookup: an unsigned Put naming a sender that is
        not announced or not reachable costs one lookup a second per peer at most, the others are refused
        at once (`UNKNOWN_SHARD`, which the honest sender retries)."""
        if index == self.me.index:
            return self.node_key_bytes
        with self._lock:
            link = self._links.get(index)
            if link is not None and link.node_key is not None:
                return link.node_key
            now = time.monotonic()
            if now < self._learn_at.get(index, 0.0):
                return None
            self._learn_at[index] = now + self.timeout_s + RETRY_S  # one lookup in flight per peer
        key = self.node_key(index)
        with self._lock:
            self._learn_at[index] = 0.0 if key is not None else time.monotonic() + RETRY_S
        return key

    def node_key(self, index: int) -> bytes | None:
        """Shard `index`'s node key, as it says over the channel pinned to its announced certificate
        (None: not announced, unreachable, or it claims another index, epoch or shard count)."""
        if index == self.me.index:
            return self.node_key_bytes
        link = self._link(index)
        if link is None:
            return None
        if link.node_key is None:
            try:
                hello = link.stub.Hello(spb.ShardHelloRequest(epoch=self.me.epoch), timeout=self.timeout_s)
            except grpc.RpcError:
                self._drop(index)
                return None
            if (hello.epoch, hello.index, hello.count, len(hello.node_key)) != (self.me.epoch, index, self.me.count, 32):
                log.warning("shard %d at %s says it is shard %d of %d in epoch %d", index, link.peer.target,
                            hello.index, hello.count, hello.epoch)
                return None
            link.node_key = bytes(hello.node_key)
        return link.node_key

    def close(self) -> None:
        for peer in list(self._links):
            self._drop(peer)


def refusal_of(exc: grpc.RpcError) -> ShardReason | None:
    """The ShardReason a refused Put carried in its trailing metadata (None: a transport failure)."""
    trailing = dict(exc.trailing_metadata() or ())
    name = str(trailing.get(REASON_KEY, ""))
    return ShardReason[name] if name in ShardReason.__members__ else None
