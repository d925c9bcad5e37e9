"""A sharded round over the network: two real shard servers (gRPC on 127.0.0.1, each its own TLS
identity announced on chain) whose engines meet through `NetExchange` (signed messages over the Shard
service on their own ports, peers found on chain). Shard 1 is killed after accepting its fragments and
restarted on another port; the round still finalizes once on chain with the Merkle-of-fragments root,
every host's fragment kept."""

from __future__ import annotations

import dataclasses

import torch
from agg_harness import (
    AGGREGATOR,
    SECOND,
    SHARD_ORDER,
    Harness,
    ServerThread,
    close_shards_at_deadline,
    shard_context,
)
from nacl.signing import SigningKey

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard import DirExchange, sampled, shard_role
from gonka_node.aggregator.shard_inbox import Inbox, ShardSelf
from gonka_node.aggregator.shard_net import ChainDirectory, NetExchange
from gonka_node.aggregator.shard_quota import ShardBudget
from gonka_node.aggregator.store import Store
from gonka_node.cli.aggregator import shard_exchange
from gonka_node.core.config import AggregatorConfig
from gonka_node.core.shard_envelope import ShardKind
from gonka_node.core.tls import TlsIdentity, create_identity
from gonka_node.host.shards import split_payload, submit_fragments

ORDER = SHARD_ORDER


def shard_server(h: Harness, i: int, identity: TlsIdentity) -> ServerThread:
    ctx = shard_context(h, i)
    key = SigningKey(bytes([ORDER[i]]) * 32)

    def build() -> RoundEngine:
        store, view = Store(h.tmp / f"shard{i}").open(), ChainView(h.world.client(ORDER[i]))
        who = ShardSelf(ctx.chain_id, ctx.registry, ctx.epoch, i, 2)
        quota = ShardBudget.of(ctx, max_hosts=8)  # the epoch's: every honest message fits it
        exchange = NetExchange(Inbox(h.tmp / f"shard{i}" / "shard-messages", who, store.rounds, quota=quota), key,
                               ChainDirectory(view, h.epoch), timeout_s=5)
        return RoundEngine(ctx, h.settings, h.aggregation, store, view, TrainingCheckpoints(), key, exchange=exchange)

    server = ServerThread(build, identity).start()
    h.servers.append(server)
    h.world.client(ORDER[i]).announce_aggregator(h.epoch, server.target, identity.cert_pem)  # as the CLI does
    return server


def test_shards_over_grpc_finalize_once_with_the_root_after_one_is_killed_and_restarted(harness: Harness) -> None:
    h = harness
    h.schedule(n_hosts=3, aggregators=ORDER, quorum=2)
    identities = [create_identity(), create_identity()]
    servers = [shard_server(h, i, identities[i]) for i in range(2)]
    clients = [s.client(timeout_s=30) for s in servers]
    for n, host in enumerate(h.hosts[:2]):
        update = {k: torch.randn(s, generator=torch.Generator().manual_seed(n)) * 0.01 for k, s in h.spec.items()}
        ok, why = submit_fragments(clients, 1, split_payload(h.codec, h.payload(update), h.spec, 2), host.address,
                                   host.key, 64)
        assert ok, why
    verifier = servers[0].engine.exchange
    assert isinstance(verifier, NetExchange)
    # Shard 0 has dialed shard 1 (its key, from the endpoint on chain): after the restart it must find
    # shard 1 again on chain, at its new port.
    assert verifier.node_key(1) == bytes(SigningKey(bytes([SECOND]) * 32).verify_key)
    old_target = servers[1].target
    servers[1].stop()  # killed with two fragments accepted; the round is not closed anywhere
    servers[1] = shard_server(h, 1, identities[1])  # restarted from its data_dir, on another port
    assert servers[1].engine.store.submitted_hosts(h.epoch, 1) == {x.address for x in h.hosts[:2]}
    close_shards_at_deadline(h, servers, 90)
    chain = h.world.client(0)
    for i, s in enumerate(servers):
        assert chain.round_vote(h.epoch, 1, h.world.accounts[ORDER[i]].address) != bytes(32)  # each shard voted
        rows = {c.host: c for c in s.engine.store.contributions(h.epoch, 1)}
        assert sorted(a for a, c in rows.items() if c.aggregated) == sorted(x.address for x in h.hosts[:2])
    # Shard 1 finalized on the verifier's verdict, held as shard 0 signed it; no shared directory exists.
    inbox = servers[1].engine.exchange
    assert isinstance(inbox, NetExchange)
    (verdict,) = inbox.inbox.held(h.epoch, 1, ShardKind.VERDICT)
    assert verdict.header.sender == 0 and verdict.header.verify(verdict.signature, bytes(SigningKey(bytes([AGGREGATOR]) * 32).verify_key))
    assert servers[1].target != old_target
    (report,) = [r for r in verifier.inbox.held(h.epoch, 1, ShardKind.REPORT) if r.header.sender == 1]
    assert report.header.verify(report.signature, bytes(SigningKey(bytes([SECOND]) * 32).verify_key))
    assert not (h.tmp / "shard-exchange").exists()
    for c in clients:
        c.close()


def test_the_aggregator_command_meets_the_other_shards_as_shard_transport_says(harness: Harness) -> None:
    h = harness
    h.schedule(n_hosts=1, aggregators=ORDER, quorum=2)
    me, agg = (bytes.fromhex(h.world.accounts[a].address[2:]) for a in (SECOND, AGGREGATOR))
    role = shard_role(h.spec, [agg, me], me, h.aggregation.rule)
    ctx = dataclasses.replace(h.context(), shard=role)
    store, view, key = Store(h.tmp / "agg").open(), ChainView(h.world.client(SECOND)), SigningKey(b"\x08" * 32)
    over_grpc = shard_exchange(AggregatorConfig(data_dir=h.tmp / "agg"), ctx, store, view, key)
    assert isinstance(over_grpc, NetExchange) and over_grpc.inbox.root == h.tmp / "agg" / "shard-messages"
    assert over_grpc.me == ShardSelf(ctx.chain_id, ctx.registry, h.epoch, 1, 2)
    assert over_grpc.inbox.quota == ShardBudget.of(ctx, max_hosts=8)  # the epoch's max_hosts, read on chain
    # Payload blobs by the replay's pick under the seed the shard's own store holds: none stored yet.
    assert over_grpc.inbox.sampled is not None and over_grpc.inbox.sampled(h.epoch, 1, me) is None
    store.open_round(h.epoch, 1, bytes(32), 10**13)
    store.set_round_seed(h.epoch, 1, b"\x01" * 32, 1)
    assert over_grpc.inbox.sampled(h.epoch, 1, me) is (me in sampled(ctx, b"\x01" * 32, 1, [me]))
    in_dir = shard_exchange(AggregatorConfig(data_dir=h.tmp / "agg", shard_transport="dir"), ctx, store, view, key)
    assert isinstance(in_dir, DirExchange) and in_dir.root == h.tmp / "shard-exchange"
    store.close()
