"""A host's upload to a sharded epoch: the payload cut by fragment (byte for byte each fragment's own
encoding), uploaded to two real shard servers (gRPC on 127.0.0.1, TLS) at once; a host one shard
refuses is refused for the round, and the round finalizes once on chain with the Merkle-of-fragments
root over what the shards wrote."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
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
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.reasons import Reason
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard import DirExchange
from gonka_node.aggregator.store import Store
from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import chain_checkpoint
from gonka_node.cli.checkpoint_fragments import pull_fragments
from gonka_node.cli.checkpoint_pull import pull_checkpoint
from gonka_node.core.client import AggregatorClient, SubmitRejected
from gonka_node.core.discovery import MissingPinError
from gonka_node.core.fragments import model_root, plan_fragments
from gonka_node.core.recipe import Recipe
from gonka_node.core.storage import S3Store, open_store
from gonka_node.core.tls import create_identity, pinned_channel
from gonka_node.explorer.downloads import NoSource, open_checkpoint
from gonka_node.host.shards import (
    ShardedAggregator,
    SplitError,
    _refusals,
    sharded_aggregator,
    split_payload,
    submit_fragments,
)
from proto.gonka.v1 import aggregator_pb2 as pb
from training.checkpoint import load_checkpoint
from training.codecs import get_codec

ORDER = SHARD_ORDER


@pytest.mark.parametrize("codec_name", ["fp32", "int8", "topk:chunk=64,k=8,bits=2"])
def test_a_split_payload_is_each_fragments_own_encoding(codec_name: str) -> None:
    g = torch.Generator().manual_seed(5)
    update = {"a.w": torch.randn(4, 40, generator=g), "b": torch.randn(70, generator=g), "c": torch.randn(130, generator=g)}
    spec = {n: tuple(t.shape) for n, t in update.items()}
    codec = get_codec(codec_name)
    whole = codec.encode(update)
    for shards in (1, 2, 3):
        got = split_payload(codec, whole, spec, shards)
        assert got == [codec.encode({n: update[n] for n in f.names}) for f in plan_fragments(spec, shards)]
    with pytest.raises(SplitError, match=f"payload is {len(whole) - 1} bytes, the model's"):
        split_payload(codec, whole[:-1], spec, 2)


def shard_server(h: Harness, i: int, exchange_dir: str) -> ServerThread:
    ctx = shard_context(h, i)

    def build() -> RoundEngine:
        return RoundEngine(
            ctx, h.settings, h.aggregation, Store(h.tmp / f"shard{i}").open(), ChainView(h.world.client(ORDER[i])),
            TrainingCheckpoints(), SigningKey(bytes([ORDER[i]]) * 32), exchange=DirExchange(h.tmp / exchange_dir),
        )

    server = ServerThread(build, h.identity).start()
    h.servers.append(server)
    return server


def test_hosts_upload_fragments_to_two_shard_servers_and_the_round_finalizes_with_the_root(
    harness: Harness, s3_endpoint: str, s3_bucket: str, capsys: pytest.CaptureFixture[str],
) -> None:
    h = harness
    h.schedule(n_hosts=3, aggregators=ORDER, quorum=2)
    servers = [shard_server(h, i, "exchange") for i in range(2)]
    clients = [s.client(timeout_s=30) for s in servers]
    updates = [{n: torch.randn(s, generator=torch.Generator().manual_seed(i)) * 0.01 for n, s in h.spec.items()}
               for i in range(3)]
    outcomes = []
    for host, u in zip(h.hosts, updates, strict=True):
        fragments = split_payload(h.codec, h.payload(u), h.spec, 2)
        if host is h.hosts[2]:
            fragments[1] = fragments[0]  # fragment 0 sent to shard 1: the wrong tensors
        outcomes.append(submit_fragments(clients, 1, fragments, host.address, host.key, 64))
    assert [ok for ok, _ in outcomes] == [True, True, True]  # received by every shard: checks pending
    status = clients[1].checked(h.epoch, 1, h.hosts[2].address)
    assert (status.state, status.reason) == (pb.SubmissionStatus.FAILED, Reason.WRONG_SHAPE.value)
    # Host 3's fragment 0 is in shard 0; shard 1's checks refused it: the round closes at the deadline (quorum 2).
    result = close_shards_at_deadline(h, servers, 60)
    for s in servers:
        rows = {c.host: c for c in s.engine.store.contributions(h.epoch, 1)}
        assert [a for a, c in rows.items() if c.aggregated] == sorted(x.address for x in h.hosts[:2])
        assert rows[h.hosts[2].address].reasons == ["fragment refused or missing at shard(s) [1]: not aggregated"]
    # The host's view of the shards: one aggregator whose files are every fragment merged.
    both = ShardedAggregator(clients, lambda r: h.codec, h.spec)
    merged = both.checkpoint(h.epoch, 1)
    model = safetensors_load(merged.data)
    (h.tmp / "merged.safetensors").write_bytes(merged.data)
    pulled = load_checkpoint(h.tmp / "merged.safetensors")  # no fragment's own recorded hash left in it
    assert pulled.metadata["round"] == "1" and "fragment" not in pulled.metadata
    assert set(model) == set(h.spec) and model_root(model, 2) == bytes(result.checkpoint_sha256)
    assert set(safetensors_load(both.round_update(h.epoch, 1).data)) == set(h.spec)
    _the_shards_publish_to_one_bucket(h, servers, f"s3://{s3_bucket}/net?endpoint={s3_endpoint}", capsys)
    _a_client_pulls_the_sharded_round(h, servers, bytes(result.checkpoint_sha256))
    # Finalized on chain once the last shard voted; each shard opens round 2 after its own close (the
    # next seed committed): wait for both, as a host's daemon polls for the open round.
    deadline = time.monotonic() + 60
    while not all(_taking(s.engine, 2) for s in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    info = both.open_round()
    assert info.round == 2
    host = h.hosts[0]
    both.submit(info, host.address, h.payload(updates[0]), host.key, 64)
    both.submit(info, host.address, h.payload(updates[0]), host.key, 64)  # every shard holds it: none re-sent
    for s in servers:
        assert s.engine.store.submitted_hosts(h.epoch, 2) == {host.address}
    closed = pb.RoundInfo()
    closed.CopyFrom(info)
    closed.round = 1
    with pytest.raises(SubmitRejected) as refused:
        both.submit(closed, h.hosts[1].address, h.payload(updates[1]), h.hosts[1].key, 64)
    assert refused.value.reason == "LATE" and refused.value.message.startswith("shard 0: round 1 is not open there")
    both.close()


def _the_shards_publish_to_one_bucket(h: Harness, servers: list[ServerThread], uri: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Each shard publishes its fragment of the round under a key of its own (one bucket for the
    epoch), and a client's pull takes every fragment from the store, not from the shards' streams."""
    objects = open_store(uri)
    assert isinstance(objects, S3Store)
    for i, server in enumerate(servers):
        server.engine.publisher = RoundPublisher(server.engine.store, objects, fragment=(i, 2))
        assert server.engine.publisher.publish(h.epoch, 1) == [
            f"checkpoints/{h.epoch}/000001.fragment-{i}-of-2.safetensors",
            f"updates/{h.epoch}/000001.fragment-{i}-of-2.safetensors",
            f"checkpoints/{h.epoch}/000001.fragments.fragment-{i}-of-2.json"]  # the leaves: one fragment's proof
        assert server.engine.publisher.upload_key(h.epoch, 1, b"\x01" * 20).endswith(f"01.fragment-{i}-of-2.bin")
    chain = h.world.client(0)
    for server, account in zip(servers, ORDER, strict=True):
        h.world.client(account).announce_aggregator(h.epoch, server.target, h.identity.cert_pem)
    out = h.tmp / "from-store.safetensors"
    capsys.readouterr()
    pull_fragments(chain, 2, chain_checkpoint(chain, h.epoch, "1"), out, timeout_s=30, max_bytes=1 << 30)
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("downloaded ")] == [
        f"downloaded checkpoints/{h.epoch}/000001.fragment-{i}-of-2.safetensors from the aggregator's object store"
        for i in range(2)]
    assert set(load_checkpoint(out).tensors) == set(h.spec)
    for server in servers:  # what follows reads the shards' own files
        server.engine.publisher = None


def _a_client_pulls_the_sharded_round(h: Harness, servers: list[ServerThread], root: bytes) -> None:
    """`checkpoint pull` of a sharded round: every shard announced on chain streams its fragment; the
    merge is written only once its Merkle root is the chain's; a tampered fragment writes nothing."""
    chain = h.world.client(0)
    for server, account in zip(servers, ORDER, strict=True):
        h.world.client(account).announce_aggregator(h.epoch, server.target, h.identity.cert_pem)
    want = chain_checkpoint(chain, h.epoch, "latest")
    out = h.tmp / "pulled" / "round-1.safetensors"
    out.parent.mkdir()
    size, note = pull_fragments(chain, 2, want, out, timeout_s=30, max_bytes=1 << 30)
    pulled = load_checkpoint(out)
    assert want.round == 1 and size == out.stat().st_size and note == "the file records no model config"
    assert set(pulled.tensors) == set(h.spec) and model_root(pulled.tensors, 2) == root
    assert "fragment" not in pulled.metadata and pulled.metadata["round"] == "1"
    # The explorer's download: one fragment from each shard, streamed as one file (headers merged).
    source = open_checkpoint(chain.aggregator_endpoints(h.epoch), h.epoch, 1, root, 30.0)
    try:
        streamed = b"".join(source.chunks)
    finally:
        source.close()
    assert len(streamed) == source.length and source.source == ", ".join(s.target for s in servers)
    merged = safetensors_load(streamed)
    assert set(merged) == set(h.spec) and all(torch.equal(merged[n], pulled.tensors[n]) for n in merged)
    with pytest.raises(NoSource, match=r"fragments \[1\] of 2 only"):
        open_checkpoint(chain.aggregator_endpoints(h.epoch)[1:], h.epoch, 1, root, 30.0)
    # Pulled as one aggregator's (no recipe said the epoch is sharded): refused with what to give instead.
    with pinned_channel(servers[0].target, h.identity.cert_pem) as channel, \
            pytest.raises(CliError, match=r"serves fragment 0/2 of a sharded epoch.*--recipe FILE"):
        pull_checkpoint(channel, want, h.tmp / "pulled" / "one.safetensors", timeout_s=30, max_bytes=1 << 30)
    with pytest.raises(CliError, match=f"epoch {h.epoch} has 3 aggregator shards and 2 announced"):
        pull_fragments(chain, 3, want, h.tmp / "pulled" / "three.safetensors", timeout_s=30, max_bytes=1 << 30)
    with pytest.raises(CliError, match=r"FileMeta.length \d[\d,]* exceeds --max-bytes 1,000"):
        pull_fragments(chain, 2, want, h.tmp / "pulled" / "small.safetensors", timeout_s=30, max_bytes=1000)
    # Shard 1 serves a fragment with one value changed (its file rewritten, its own recorded hash kept
    # consistent): every stream checks out, the merged root does not.
    path = servers[1].engine.store.checkpoint_path(h.epoch, 1)
    tampered = load_checkpoint(path)
    name = sorted(tampered.tensors)[0]
    tampered.tensors[name].view(-1)[0] += 1.0
    save_file(tampered.tensors, str(path), metadata=tampered.metadata)
    with pytest.raises(CliError, match=r"Merkle root is [0-9a-f]{64}, the chain records .*nothing was written"):
        pull_fragments(chain, 2, want, h.tmp / "pulled" / "bad.safetensors", timeout_s=30, max_bytes=1 << 30)
    assert sorted(p.name for p in (h.tmp / "pulled").iterdir()) == ["round-1.safetensors"]


def _taking(engine: RoundEngine, round_: int) -> bool:
    """Whether `engine` takes submissions for `round_` now."""
    r = engine.current
    return r is not None and r.round == round_ and not engine.closing


def test_one_client_per_fragment() -> None:
    no_clients: list[AggregatorClient] = []
    with pytest.raises(SplitError, match="2 fragments for 0 shards"):
        submit_fragments(no_clients, 1, [b"", b""], bytes(20), SigningKey(bytes(32)), 0)


def test_a_host_dials_every_shard_the_chain_announced_in_the_epochs_order(harness: Harness) -> None:
    h = harness
    h.schedule(n_hosts=1, aggregators=ORDER, quorum=2)
    recipe = dataclasses.replace(Recipe(model=h.cfg), shards=2)
    with pytest.raises(MissingPinError, match=f"epoch {h.epoch} has 2 aggregator shards and 0 announced"):
        sharded_aggregator(h.world.client(0), h.epoch, recipe)
    for port, account in ((7002, SECOND), (7001, AGGREGATOR)):  # announced out of order
        h.world.client(account).announce_aggregator(h.epoch, f"127.0.0.1:{port}", h.identity.cert_pem)
    both = sharded_aggregator(h.world.client(0), h.epoch, recipe)
    assert both.target == "127.0.0.1:7001, 127.0.0.1:7002" and both.spec == h.spec
    both.close()


def test_an_unreachable_shard_is_a_retryable_refusal_not_an_error() -> None:
    """A shard down or restarting when a host uploads: the daemon's submit loop retries UNAVAILABLE
    refusals, so the outage must come back as one (an RpcError would end the daemon)."""
    down = AggregatorClient("127.0.0.1:1", create_identity(["localhost"]).cert_pem, timeout_s=5)
    try:
        refusals = _refusals([down], 1, [b"fragment"], bytes(20), SigningKey(bytes(32)), 0)
    finally:
        down.close()
    assert [(i, r.code) for i, r in refusals] == [(0, grpc.StatusCode.UNAVAILABLE)]
    assert refusals[0][1].message.startswith("open_round: ")
