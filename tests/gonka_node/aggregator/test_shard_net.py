"""Shards exchanging over the `Shard` gRPC service (aggregator/shard_net.py): two real servers on
127.0.0.1 (TLS, each its own certificate), signed messages, and what a receiver refuses. Every refusal
is checked to change nothing on disk; a message a peer missed while it was down reaches it afterwards,
also from a restarted sender."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from nacl.signing import SigningKey

from gonka_node.aggregator import shard_net
from gonka_node.aggregator.shard import FragmentReport, HostFragment, Verdict, payload_key
from gonka_node.aggregator.shard_inbox import (
    HoldsPayload,
    Inbox,
    Sampled,
    ShardReason,
    ShardSelf,
    Signed,
    body_digest,
)
from gonka_node.aggregator.shard_net import REASON_KEY, RETRY_S, NetExchange, ShardPeer, put_requests
from gonka_node.aggregator.shard_quota import QuotaRule
from gonka_node.aggregator.shard_service import ShardService
from gonka_node.aggregator.store import RoundRow
from gonka_node.core.shard_envelope import ShardKind, ShardMessage
from gonka_node.core.tls import TlsIdentity, create_identity, pinned_channel, server_credentials
from proto.gonka.v1 import shard_pb2 as spb
from proto.gonka.v1 import shard_pb2_grpc as spb_grpc

CHAIN, REGISTRY, EPOCH = 31337, bytes(range(20)), 4
KEYS = [SigningKey(bytes([40 + i]) * 32) for i in range(3)]


@dataclass
class Peers:
    """A PeerDirectory the test fills as servers start (production: `ChainDirectory`)."""

    known: dict[int, ShardPeer] = field(default_factory=dict)
    forgotten: list[int] = field(default_factory=list)

    def peer(self, index: int) -> ShardPeer | None:
        return self.known.get(index)

    def forget(self, index: int) -> None:
        self.forgotten.append(index)


class ShardNode:
    """One shard's exchange and its Shard service on 127.0.0.1:0, on an event loop in a thread."""

    def __init__(self, root: Path, index: int, peers: Peers, rows: list[RoundRow], count: int = 2,
                 max_body: int = 1 << 20, quota: QuotaRule | None = None,
                 holds_payload: HoldsPayload | None = None, sampled: Sampled | None = None) -> None:
        self.root, self.index, self.peers, self.rows = root, index, peers, rows
        self.count, self.max_body, self.quota, self.holds_payload = count, max_body, quota, holds_payload
        self.sampled = sampled
        self.identity: TlsIdentity = create_identity()
        self.exchange = self._exchange()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: grpc.aio.Server | None = None

    def _exchange(self) -> NetExchange:
        me = ShardSelf(CHAIN, REGISTRY, EPOCH, self.index, self.count)
        inbox = Inbox(self.root, me, lambda e: self.rows, self.max_body, self.quota, self.holds_payload, self.sampled)
        return NetExchange(inbox, KEYS[self.index], self.peers, timeout_s=5)

    def start(self) -> ShardNode:
        self.thread.start()

        async def boot() -> int:
            self.server = grpc.aio.server()
            spb_grpc.add_ShardServicer_to_server(ShardService(self.exchange), self.server)
            port = self.server.add_secure_port("127.0.0.1:0", server_credentials(self.identity))
            await self.server.start()
            return port

        port = asyncio.run_coroutine_threadsafe(boot(), self.loop).result(10)
        self.peers.known[self.index] = ShardPeer(f"127.0.0.1:{port}", self.identity.cert_pem)
        return self

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():  # else it is still running: closing it would raise
            self.loop.close()
        self.exchange.close()

    def put_raw(self, s: Signed) -> spb.ShardAck:
        """Send a hand-built message to this shard, as any outsider holding its certificate could."""
        peer = self.peers.known[self.index]
        with pinned_channel(peer.target, peer.tls_cert_pem) as channel:
            return spb_grpc.ShardStub(channel).Put(put_requests(s), timeout=10)

    def files(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.root)): p.read_bytes() for p in sorted(self.root.rglob("*")) if p.is_file()}


def _row(round_: int, state: str = "open") -> RoundRow:
    return RoundRow(EPOCH, round_, state, bytes(32), 0, 0, 0)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ShardNode, ShardNode]]:
    peers, rows = Peers(), [_row(1)]
    nodes = (ShardNode(tmp_path / "s0", 0, peers, rows).start(), ShardNode(tmp_path / "s1", 1, peers, rows).start())
    yield nodes
    for n in nodes:
        if n.thread.is_alive():
            n.stop()


def _report(round_: int = 1, index: int = 1, scan: float = 2.0) -> FragmentReport:
    host = HostFragment(b"\x07" * 20, 1, 2, (scan,), (scan,), b"\x00" * 8)
    return FragmentReport(EPOCH, round_, index, 2, ("w",), False, (host,), (), ())


def _signed(kind: ShardKind, body: bytes, key: SigningKey = KEYS[1], sender: int = 1, round_: int = 1,
            sequence: int = 5, blob_key: str = "") -> Signed:
    h = ShardMessage(CHAIN, REGISTRY, EPOCH, round_, kind, sender, 2, blob_key, body_digest(body), len(body), sequence)
    return Signed(h, h.sign(key), body)


def _refusal(node: ShardNode, s: Signed) -> tuple[ShardReason, str]:
    before = node.files()
    with pytest.raises(grpc.RpcError) as refused:
        node.put_raw(s)
    assert node.files() == before  # a refused message changes nothing
    trailing = dict(refused.value.trailing_metadata() or ())
    return ShardReason[str(trailing[REASON_KEY])], refused.value.details() or ""


def test_a_report_verdict_and_hashes_travel_signed_between_two_shard_servers(pair: tuple[ShardNode, ShardNode]) -> None:
    s0, s1 = pair
    s1.exchange.put_report(_report())
    s1.exchange.put_blob(EPOCH, 1, 1, "base", b"fragment bytes")
    assert s0.exchange.reports(EPOCH, 1) == [_report()]
    assert s0.exchange.blob(EPOCH, 1, 1, "base") == b"fragment bytes"
    assert s1.exchange.reports(EPOCH, 1) == [_report()]  # its own, kept; the verifier alone gets others'
    verdict = Verdict(EPOCH, 1, "mean", (b"\x07" * 20,), {b"\x07" * 20: 1.5}, None, (), b"\x01" * 32, 9)
    s0.exchange.put_verdict(verdict)
    s0.exchange.put_hash(EPOCH, 1, 0, b"\xaa" * 32)
    s1.exchange.put_hash(EPOCH, 1, 1, b"\xbb" * 32)
    assert s1.exchange.verdict(EPOCH, 1) == verdict
    for node in pair:
        assert node.exchange.hashes(EPOCH, 1) == {0: b"\xaa" * 32, 1: b"\xbb" * 32}
    # What shard 0 holds from shard 1 is shard 1's signed message, verifiable by anyone after the fact.
    held = s0.exchange.inbox.held(EPOCH, 1, ShardKind.REPORT)[0]
    assert held.header.verify(held.signature, bytes(KEYS[1].verify_key))
    assert not held.header.verify(held.signature, bytes(KEYS[0].verify_key))
    with pytest.raises(ValueError, match="shard 1 cannot put shard 0's messages"):
        s1.exchange.put_hash(EPOCH, 1, 0, b"\xcc" * 32)


def test_a_report_waits_for_the_blobs_the_verifier_refused_for_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's report tells the verifier that its blobs of the round are in, so a blob refused for a
    retry (here SEED_PENDING: the verifier has not stored the round's complete seed yet) holds the
    report back until the verifier took the blob; else the verifier would decide without it."""
    monkeypatch.setattr(shard_net, "RETRY_S", 0.0)  # a refused peer is due again at once
    seed_known: list[bool] = []
    peers, rows = Peers(), [_row(1)]
    s0 = ShardNode(tmp_path / "s0", 0, peers, rows, sampled=lambda e, r, host: True if seed_known else None).start()
    s1 = ShardNode(tmp_path / "s1", 1, peers, rows).start()
    key = payload_key(b"\x07" * 20)
    try:
        s1.exchange.put_blob(EPOCH, 1, 1, key, b"fragment payload")
        s1.exchange.put_report(_report())
        s1.exchange.flush(EPOCH, 1)
        assert s0.exchange.blob(EPOCH, 1, 1, key) is None and s0.exchange.reports(EPOCH, 1) == []
        seed_known.append(True)
        s1.exchange.flush(EPOCH, 1)  # what the sender's close does every tick
        assert s0.exchange.blob(EPOCH, 1, 1, key) == b"fragment payload"
        assert s0.exchange.reports(EPOCH, 1) == [_report()]
    finally:
        s0.stop()
        s1.stop()


def test_forged_replayed_stale_and_misdirected_messages_are_refused_with_their_reason(
    pair: tuple[ShardNode, ShardNode],
) -> None:
    s0 = pair[0]
    newer, older = _report(scan=3.0), _report(scan=2.0)
    good = _signed(ShardKind.REPORT, newer.to_json().encode(), sequence=9)
    assert s0.put_raw(good).stored
    assert not s0.put_raw(good).stored  # the same message again: held already, nothing written
    forged = _signed(ShardKind.REPORT, older.to_json().encode(), key=SigningKey(b"\x66" * 32), sequence=10)
    assert _refusal(s0, forged) == (ShardReason.BAD_SIGNATURE, "the signature does not verify under shard 1's node key")
    replayed = _signed(ShardKind.REPORT, older.to_json().encode(), sequence=8)
    reason, message = _refusal(s0, replayed)
    assert (reason, message.split(" held")[0]) == (ShardReason.REPLAYED, "sequence 8 is not above the 9")
    # Shard 1's signature over round 1, presented as round 2: the round is in the signed bytes.
    moved = Signed(dataclasses.replace(good.header, round=2), good.signature, good.body)
    assert _refusal(s0, moved)[0] == ShardReason.BAD_SIGNATURE
    assert _refusal(s0, _signed(ShardKind.HASH, b"\x01" * 32, blob_key="", round_=3))[0] == ShardReason.FUTURE_ROUND
    tampered = Signed(good.header, good.signature, good.body.replace(b"3.0", b"4.0"))
    assert _refusal(s0, tampered)[0] == ShardReason.DIGEST_MISMATCH
    verdict = Verdict(EPOCH, 1, "mean", (), {}, None, (), bytes(32), 0)
    reason, message = _refusal(s0, _signed(ShardKind.VERDICT, verdict.to_json().encode()))
    assert (reason, message) == (ShardReason.NOT_PERMITTED, "shard 1 sent a verdict; only shard 0 decides")
    as_shard_0 = _signed(ShardKind.REPORT, _report(index=0).to_json().encode())  # shard 1 reporting for shard 0
    assert _refusal(s0, as_shard_0)[0] == ShardReason.NOT_PERMITTED
    big = _signed(ShardKind.BLOB, b"x" * ((1 << 20) + 1), blob_key="base")
    assert _refusal(s0, big)[0] == ShardReason.OVERSIZE
    s0.rows[0] = _row(1, "finalized")
    reason, message = _refusal(s0, _signed(ShardKind.HASH, b"\x01" * 32, sequence=11))
    assert (reason, message) == (ShardReason.STALE_ROUND, "round 4/1 is closed at shard 0")
    assert s0.exchange.reports(EPOCH, 1) == [newer]


def test_a_sender_the_receiver_cannot_reach_is_unknown(pair: tuple[ShardNode, ShardNode]) -> None:
    s0 = pair[0]
    unreachable = s0.peers.known.pop(1)  # shard 1 never announced: nobody can say which key signs its messages
    looked_up: list[int] = []
    directory_peer = s0.peers.peer
    s0.peers.peer = lambda i: looked_up.append(i) or directory_peer(i)  # type: ignore[method-assign]
    assert _refusal(s0, _signed(ShardKind.HASH, b"\x01" * 32))[0] == ShardReason.UNKNOWN_SHARD
    # Unsigned Puts naming it again within a second are refused without another lookup (no chain read,
    # no dial on the receive path: a flood of them costs the shard nothing); a second later it looks again.
    for _ in range(5):
        assert _refusal(s0, _signed(ShardKind.HASH, b"\x01" * 32))[0] == ShardReason.UNKNOWN_SHARD
    assert looked_up == [1]
    s0.peers.known[1] = unreachable
    time.sleep(RETRY_S)
    s0.put_raw(_signed(ShardKind.HASH, b"\x01" * 32))  # its key learned now: taken
    assert looked_up == [1, 1]


def test_a_message_a_peer_missed_while_down_reaches_it_after_a_restart_of_either(tmp_path: Path) -> None:
    peers, rows = Peers(), [_row(1)]
    s1 = ShardNode(tmp_path / "s1", 1, peers, rows).start()
    s0 = ShardNode(tmp_path / "s0", 0, peers, rows)  # the verifier is down
    try:
        s1.exchange.put_report(_report())  # held in shard 1's outbox, sent nowhere yet
        held = s1.exchange.inbox.held(EPOCH, 1, ShardKind.REPORT)[0]
        assert not s1.exchange.inbox.acked(held, 0)
        s1.stop()
        s1 = ShardNode(tmp_path / "s1", 1, peers, rows).start()  # shard 1 restarts: the outbox is on disk
        s0.start()
        s1.exchange.flush(EPOCH, 1)
        assert s0.exchange.reports(EPOCH, 1) == [_report()]
        assert s1.exchange.inbox.acked(held, 0)
    finally:
        s1.stop()
        if s0.thread.is_alive():
            s0.stop()


def test_the_reasons_and_kinds_are_the_protos_numbers() -> None:
    refusals = {v.name: v.number for v in spb.ShardRefusal.DESCRIPTOR.values if v.number}
    kinds = {v.name: v.number for v in spb.ShardKind.DESCRIPTOR.values if v.number}
    assert refusals == {f"SHARD_{r.name}": r.value for r in ShardReason}
    assert kinds == {f"SHARD_{k.name}": k.value for k in ShardKind}
