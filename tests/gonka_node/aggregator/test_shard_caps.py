"""What a peer shard may make a receiver hold (aggregator/shard_receive.py, shard_quota.py): bodies go to
disk as they stream, one chunk in memory; a body past its signed length or digest leaves no file; each
sender has a quota of messages and bytes per round, reserved before its body is read. Real Shard servers
on 127.0.0.1 (TLS), real files; the quota's sizes checked against what an honest shard really sends."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from test_close_units import Round
from test_shard_net import CHAIN, EPOCH, KEYS, REGISTRY, Peers, ShardNode, _row

from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.close import PUBLIC_ROUNDS
from gonka_node.aggregator.replay import chosen_for_replay
from gonka_node.aggregator.shard import FragmentReport, HostFragment, SignedFragment, Verdict, sampled_by_seed
from gonka_node.aggregator.shard_inbox import ShardReason, Signed
from gonka_node.aggregator.shard_net import FINAL, REASON_KEY, envelope_pb
from gonka_node.aggregator.shard_quota import Quota, ShardBudget
from gonka_node.aggregator.shard_receive import Incoming
from gonka_node.aggregator.shard_service import ShardService
from gonka_node.aggregator.store import ContributionRow, Store
from gonka_node.aggregator.validate import Sketcher
from gonka_node.core.envelope import SIGNATURE_BYTES
from gonka_node.core.fragments import plan_fragments
from gonka_node.core.shard_envelope import SHARD_MESSAGE_BYTES, ShardKind, ShardMessage
from gonka_node.core.tls import pinned_channel
from gonka_node.host.shards import split_payload
from proto.gonka.v1 import shard_pb2 as spb
from proto.gonka.v1 import shard_pb2_grpc as spb_grpc
from training.codecs import get_codec
from training.hf_export import MODEL_CONFIG_KEY

PAYLOAD_A, PAYLOAD_B = f"payload-{'a' * 40}", f"payload-{'b' * 40}"
PREFIX = SHARD_MESSAGE_BYTES + SIGNATURE_BYTES  # a held message's file: the signed header, the signature, the body
SMALL = Quota(keys=3, bytes=1000, report=4096, verdict=4096, payload=600, base=600)


def _header(body: bytes, sender: int, key: str = "base", sequence: int = 5, kind: ShardKind = ShardKind.BLOB) -> Signed:
    """Shard `sender`'s signed message of round 1 (of three shards) carrying `body`."""
    h = ShardMessage(CHAIN, REGISTRY, EPOCH, 1, kind, sender, 3, key, hashlib.sha256(body).digest(), len(body), sequence)
    return Signed(h, h.sign(KEYS[sender]), body)


def _requests(s: Signed, chunks: Iterator[bytes]) -> Iterator[spb.ShardPut]:
    yield spb.ShardPut(envelope=envelope_pb(s))
    for chunk in chunks:
        yield spb.ShardPut(data=chunk)


def _pieces(body: bytes, size: int) -> Iterator[bytes]:
    for at in range(0, len(body), size):
        yield body[at : at + size]


def _put(node: ShardNode, s: Signed, chunks: Iterator[bytes] | None = None) -> bool:
    peer = node.peers.known[node.index]
    with pinned_channel(peer.target, peer.tls_cert_pem) as channel:
        ack = spb_grpc.ShardStub(channel).Put(_requests(s, chunks or _pieces(s.body, 1 << 16)), timeout=30)
    return bool(ack.stored)


def _refused(node: ShardNode, s: Signed, chunks: Iterator[bytes] | None = None) -> ShardReason:
    before = node.files()
    with pytest.raises(grpc.RpcError) as refused:
        _put(node, s, chunks)
    assert node.files() == before  # nothing held, no temporary file left
    return ShardReason[str(dict(refused.value.trailing_metadata() or ())[REASON_KEY])]


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[list[ShardNode]]:
    """Shard 0 (the receiver, quota `SMALL`) and shards 1 and 2 (senders) of three."""
    peers, rows = Peers(), [_row(1)]
    nodes = [ShardNode(tmp_path / f"s{i}", i, peers, rows, count=3, quota=lambda sender, round_: SMALL).start()
             for i in range(3)]
    yield nodes
    for n in nodes:
        if n.thread.is_alive():
            n.stop()


def test_a_body_running_past_its_signed_length_is_refused_mid_stream(trio: list[ShardNode]) -> None:
    endless = _header(b"x" * 500, sender=1)

    def forever() -> Iterator[bytes]:
        while True:  # without a refusal mid-stream this Put would only end at its deadline
            yield b"x" * 256

    assert _refused(trio[0], endless, forever()) == ShardReason.OVERSIZE


def test_a_body_is_spooled_to_disk_as_it_arrives_and_a_wrong_digest_leaves_no_file(trio: list[ShardNode]) -> None:
    s0, body = trio[0], bytes(range(250)) * 2
    forged = _header(body, sender=1)
    sent, release = threading.Event(), threading.Event()

    def tampered() -> Iterator[bytes]:
        yield body[:300]
        sent.set()
        release.wait(10)
        yield b"\x00" * 200  # the signed length, not the signed bytes

    before = s0.files()
    peer = s0.peers.known[0]
    with pinned_channel(peer.target, peer.tls_cert_pem) as channel:
        call = spb_grpc.ShardStub(channel).Put.future(_requests(forged, tampered()), timeout=30)
        assert sent.wait(10)
        spool = _wait_for(lambda: [p for p in s0.root.rglob(".blob-1-base.msg.*.tmp") if p.stat().st_size > PREFIX])
        assert spool[0].stat().st_size == PREFIX + 300  # header, signature, the chunk received so far
        release.set()
        with pytest.raises(grpc.RpcError) as refused:
            call.result()
    assert dict(refused.value.trailing_metadata() or ())[REASON_KEY] == "DIGEST_MISMATCH"
    assert s0.files() == before


def _wait_for(found: Callable[[], list[Path]], timeout_s: float = 10.0) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = found()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError("not found in time")


def test_a_sender_over_its_key_or_byte_quota_is_refused_and_another_is_not(trio: list[ShardNode]) -> None:
    s0 = trio[0]
    assert _put(s0, _header(b"p" * 600, 1, PAYLOAD_A)) and _put(s0, _header(b"b" * 300, 1))
    assert _put(s0, _header(b"h" * 32, 1, "", kind=ShardKind.HASH))  # 932 bytes in 3 messages
    assert _refused(s0, _header(b"q" * 10, 1, PAYLOAD_B)) == ShardReason.QUOTA  # a fourth key
    assert _refused(s0, _header(b"b" * 601, 1, sequence=6)) == ShardReason.OVERSIZE  # above the largest base
    assert _put(s0, _header(b"c" * 68, 1, sequence=6))  # a newer base replaces the old one: 700 bytes held
    assert _refused(s0, _header(b"d" * 369, 1, sequence=7)) == ShardReason.QUOTA  # 1001 bytes
    assert _put(s0, _header(b"d" * 368, 1, sequence=7))  # exactly 1000
    # Shard 2's quota is its own.
    assert _put(s0, _header(b"p" * 600, 2, PAYLOAD_A)) and _put(s0, _header(b"b" * 400, 2))
    held = {p.name: p.stat().st_size - PREFIX for p in (s0.root / str(EPOCH) / "1").glob("*.msg")}
    assert held == {f"blob-1-{PAYLOAD_A}.msg": 600, "blob-1-base.msg": 368, "hash-1.msg": 32,
                    f"blob-2-{PAYLOAD_A}.msg": 600, "blob-2-base.msg": 400}
    s0.stop()  # restarted, the receiver counts what it holds on disk
    again = ShardNode(s0.root, 0, s0.peers, s0.rows, count=3, quota=lambda sender, round_: SMALL).start()
    try:
        assert _refused(again, _header(b"q" * 10, 1, PAYLOAD_B)) == ShardReason.QUOTA
        assert _refused(again, _header(b"e" * 369, 1, sequence=8)) == ShardReason.QUOTA
    finally:
        again.stop()


def test_concurrent_puts_of_one_sender_cannot_race_past_its_quota(trio: list[ShardNode]) -> None:
    s0, release = trio[0], threading.Event()

    def held_back() -> Iterator[bytes]:
        yield b"p" * 100
        release.wait(10)
        yield b"p" * 500

    peer = s0.peers.known[0]
    with pinned_channel(peer.target, peer.tls_cert_pem) as channel:
        first = spb_grpc.ShardStub(channel).Put.future(_requests(_header(b"p" * 600, 1, PAYLOAD_A), held_back()),
                                                       timeout=30)
        # reserved and streaming, its first chunk on disk (else that write could land while the refusal
        # below compares the receiver's files before and after it)
        _wait_for(lambda: [p for p in s0.root.rglob(f".blob-1-{PAYLOAD_A}.msg.*.tmp") if p.stat().st_size >= PREFIX + 100])
        assert _refused(s0, _header(b"q" * 401, 1, PAYLOAD_B)) == ShardReason.QUOTA  # 600 reserved + 401
        release.set()
        assert first.result().stored
    assert _put(s0, _header(b"q" * 400, 1, PAYLOAD_B))


def test_a_large_body_costs_the_receiver_one_chunk_of_memory(tmp_path: Path) -> None:
    size, peers = 64 << 20, Peers()
    node, sender = (ShardNode(tmp_path / f"s{i}", i, peers, [_row(1)], count=3, max_body=size).start() for i in (0, 1))
    try:
        big = _header(os.urandom(size), sender=1)
        tracemalloc.start()
        try:
            assert _put(node, big, _pieces(big.body, 1 << 16))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < size // 8, f"the receiver's peak was {peak} bytes for a {size}-byte body"
        held = node.root / str(EPOCH) / "1" / "blob-1-base.msg"
        assert held.stat().st_size == PREFIX + size
    finally:
        node.stop()
        sender.stop()


def test_the_quota_holds_what_an_honest_shard_sends(tmp_path: Path) -> None:
    spec = {"emb": (256, 256), "a.w": (128, 256), "b.w": (256, 128), "norm": (256,)}  # fragment 1: a.w, b.w
    codec, max_hosts, round_ = get_codec("int8"), 3, 4
    config = '{"dim": 16, "n_layers": 2, "vocab": 64}'
    budget = ShardBudget(max_hosts, lambda r: codec, tuple(f.spec(spec) for f in plan_fragments(spec, 2)), len(config))
    fragment = plan_fragments(spec, 2)[1]
    q = budget(1, round_)
    update = {n: torch.randn(s) for n, s in spec.items()}
    assert len(split_payload(codec, codec.encode(update), spec, 2)[1]) == q.payload
    path = tmp_path / "fragment.safetensors"
    meta = {"epoch": "9", "round": "3", "base_sha256": "ab" * 32, "rule": "clip_median", "fragment": "1/2",
            MODEL_CONFIG_KEY: config}
    TrainingCheckpoints().save(path, {n: update[n] for n in fragment.names}, meta)
    assert path.stat().st_size <= q.base
    sketch = Sketcher().result().numpy().tobytes()
    floats = tuple(-1.2345678901234567e-300 for _ in fragment.names)
    signed = SignedFragment(b"\xff" * 32, 2**63 - 1, 2**63 - 1, 2**63 - 1, b"\xff" * 32, b"\xff" * 64)
    hosts = tuple(HostFragment(bytes([h]) * 20, 2**62, 2**62, floats, floats, sketch, signed) for h in range(max_hosts))
    earlier = tuple((r, bytes([h]) * 20, sketch) for r in range(1, round_) for h in range(max_hosts))
    public = tuple((f"round {r}'s aggregate", sketch) for r in range(1 + PUBLIC_ROUNDS))
    report = FragmentReport(9, round_, 1, 2, fragment.names, False, hosts, earlier, public)
    assert len(report.to_json().encode()) <= q.report
    rows = tuple(ContributionRow(bytes([h]) * 20, 0.5, 10**18, True, ["scored by replay: gain 0.0123 (bar 0.0)"] * 8)
                 for h in range(max_hosts))
    verdict = Verdict(9, round_, "clip_median", tuple(r.host for r in rows), {r.host: 1.5e300 for r in rows}, 2.5, rows,
                      bytes(32), 10**18)
    assert len(verdict.to_json().encode()) <= q.verdict
    assert q.keys == max_hosts + 4  # a payload per host, the base, a report, a hash, a verdict
    assert q.bytes == max_hosts * q.payload + q.base + q.report + q.verdict + 32


def test_a_sender_refused_for_quota_sends_again_later() -> None:
    """Its earlier Puts still streaming may end and give their bytes back; an oversized body will not.
    Nor is a blob of a host the receiver holds no payload of final: that host's upload may still land;
    nor one sent before the round's seed is complete there. A blob of a host the pick passed over is."""
    assert ShardReason.QUOTA not in FINAL and ShardReason.OVERSIZE in FINAL
    assert ShardReason.UNHELD_HOST not in FINAL and ShardReason.SEED_PENDING not in FINAL
    assert ShardReason.NOT_SAMPLED in FINAL


def test_a_payload_blob_is_held_only_for_a_host_whose_payload_the_receiver_holds(tmp_path: Path) -> None:
    held_hosts: set[bytes] = {bytes.fromhex("a" * 40)}
    peers, rows = Peers(), [_row(1)]
    nodes = [ShardNode(tmp_path / f"s{i}", i, peers, rows, count=3, quota=lambda sender, round_: SMALL,
                       holds_payload=lambda e, r, host: e == EPOCH and r == 1 and host in held_hosts).start()
             for i in range(3)]
    s0 = nodes[0]
    try:
        assert _put(s0, _header(b"p" * 600, 1, PAYLOAD_A))
        # Under the key quota (3), yet a blob of a host that never uploaded here is not held; once its
        # upload lands it is.
        assert _refused(s0, _header(b"q" * 10, 1, PAYLOAD_B)) == ShardReason.UNHELD_HOST
        held_hosts.add(bytes.fromhex("b" * 40))
        assert _put(s0, _header(b"q" * 10, 1, PAYLOAD_B))
        assert _put(s0, _header(b"b" * 300, 1))  # the base fragment is no host's
    finally:
        for n in nodes:
            n.stop()


def test_a_payload_blob_is_held_only_for_a_host_the_rounds_replay_picks_once_its_seed_is_complete_here(
    tmp_path: Path,
) -> None:
    """An honest shard sends the blobs of the hosts the round's replay picks (`put_sampled`), and only
    once the round's seed is complete (every aggregator revealed). The receiver, by the seed its own
    store holds (`sampled_by_seed`, as the aggregator command wires it): SEED_PENDING before it has the
    seed (retried), NOT_SAMPLED for a host the pick passes over (final) — so a peer no longer has it
    hold 1/p times an honest round's blobs."""
    a, b = (bytes.fromhex(c * 40) for c in "ab")
    store = Store(tmp_path / "agg").open()
    store.open_round(EPOCH, 1, bytes(32), 10**13)
    ctx = Round(tmp_path).ctx(replay=object(), replay_probability=0.5)  # replayed: `sampled` draws
    # A seed under which p = 0.5 picks host a and not host b.
    seed = next(s for s in (hashlib.sha256(bytes([i])).digest() for i in range(256))
                if chosen_for_replay(0.5, s, 1, [a, b]) == {a})
    peers, rows = Peers(), [_row(1)]
    nodes = [ShardNode(tmp_path / f"s{i}", i, peers, rows, count=3, quota=lambda sender, round_: SMALL,
                       holds_payload=lambda e, r, host: True, sampled=sampled_by_seed(ctx, store)).start()
             for i in range(3)]
    s0 = nodes[0]
    try:
        assert _refused(s0, _header(b"p" * 500, 1, PAYLOAD_A)) == ShardReason.SEED_PENDING
        store.set_round_seed(EPOCH, 1, seed, 1)
        assert _put(s0, _header(b"p" * 500, 1, PAYLOAD_A))
        assert _refused(s0, _header(b"q" * 10, 1, PAYLOAD_B)) == ShardReason.NOT_SAMPLED
        assert _put(s0, _header(b"b" * 300, 1))  # the base fragment is no host's
    finally:
        for n in nodes:
            n.stop()
        store.close()


def test_a_body_a_crash_left_half_received_is_removed_when_the_shard_starts_again(tmp_path: Path) -> None:
    round_dir = tmp_path / "s0" / str(EPOCH) / "1"
    round_dir.mkdir(parents=True)
    stale, held = round_dir / ".blob-1-base.msg.k2j4.tmp", round_dir / "hash-1.msg"
    stale.write_bytes(b"x" * 500)  # never renamed into its slot: never held, only disk
    held.write_bytes(b"h" * 10)
    node = ShardNode(tmp_path / "s0", 0, Peers(), [_row(1)], count=3, quota=lambda sender, round_: SMALL).start()
    try:
        assert not stale.exists() and held.read_bytes() == b"h" * 10
    finally:
        node.stop()


def test_a_put_reset_while_it_is_being_admitted_gives_back_its_reservation_and_file(trio: list[ShardNode]) -> None:
    """A peer that resets its stream while the receiver's thread admits the header (learning its key,
    reserving, opening the file) leaves nothing behind: not a reservation that counts against its quota,
    not a temporary file (repeated, such resets would otherwise pile up without limit)."""
    s0 = trio[0]
    service, admitted = ShardService(s0.exchange), threading.Event()
    admit = service._admit

    def slow_admit(header: ShardMessage, signature: bytes) -> Incoming:
        incoming = admit(header, signature)
        admitted.wait(5)  # the stream is reset while this thread still admits
        return incoming

    service._admit = slow_admit  # type: ignore[method-assign]

    async def reset_puts() -> None:
        for sequence in range(10, 15):
            s = _header(b"", 1, sequence=sequence)

            async def requests(s: Signed = s) -> AsyncIterator[spb.ShardPut]:
                yield spb.ShardPut(envelope=envelope_pb(s))
                await asyncio.sleep(30)

            put = asyncio.ensure_future(service._put(requests()))
            await asyncio.sleep(0.05)
            put.cancel()
            admitted.set()
            with pytest.raises(asyncio.CancelledError):
                await put
            admitted.clear()
        await asyncio.sleep(0.2)  # the admitting threads finish, their callbacks run

    asyncio.run(reset_puts())
    assert all(not reserved for reserved in s0.exchange.inbox._pending.values())
    assert list(s0.root.rglob("*.tmp")) == []


def test_a_closed_rounds_counts_are_dropped_once_the_next_round_takes_messages(trio: list[ShardNode]) -> None:
    s0 = trio[0]
    assert _put(s0, _header(b"b" * 300, 1))
    assert (EPOCH, 1, 1) in s0.exchange.inbox._held
    s0.rows[:] = [_row(1, "finalized"), _row(2)]  # round 1 closed, round 2 open
    h = ShardMessage(CHAIN, REGISTRY, EPOCH, 2, ShardKind.BLOB, 1, 3, "base", hashlib.sha256(b"c").digest(), 1, 5)
    assert _put(s0, Signed(h, h.sign(KEYS[1]), b"c"))
    assert set(s0.exchange.inbox._held) == {(EPOCH, 2, 1)}
