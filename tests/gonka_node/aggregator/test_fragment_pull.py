"""`checkpoint pull --fragment K` of a sharded round (cli/checkpoint_one_fragment.py): two real shard
servers (gRPC on 127.0.0.1, TLS) finalize round 1 and publish their fragments to one bucket on a real
S3-speaking server (moto); a client fetches fragment 1 alone, from shard 1's store, with shard 0 stopped
(no byte of fragment 0 is needed), and checks it by the proof shard 1 serves against the chain's root.
A wrong index, a proof that does not lead to the root and a tampered fragment each write nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from agg_harness import SHARD_ORDER, Harness, ServerThread, close_shards_at_deadline, shard_context
from nacl.signing import SigningKey
from safetensors.torch import save_file

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard import DirExchange
from gonka_node.aggregator.shard_close import fragments_path
from gonka_node.aggregator.store import Store
from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint, chain_checkpoint
from gonka_node.cli.checkpoint_one_fragment import check_fragment_index, pull_one_fragment
from gonka_node.core.fragments import FragmentProof, fragment_root, plan_fragments
from gonka_node.core.storage import S3Store, open_store
from gonka_node.host.shards import split_payload, submit_fragments
from training.checkpoint import canonical_sha256, load_checkpoint, tensors_view


def publishing_shard(h: Harness, i: int, objects: S3Store) -> ServerThread:
    """Shard i of SHARD_ORDER, publishing its fragment of each finalized round into `objects`."""
    ctx = shard_context(h, i)

    def build() -> RoundEngine:
        engine = RoundEngine(
            ctx, h.settings, h.aggregation, Store(h.tmp / f"shard{i}").open(),
            ChainView(h.world.client(SHARD_ORDER[i])), TrainingCheckpoints(), SigningKey(bytes([SHARD_ORDER[i]]) * 32),
            exchange=DirExchange(h.tmp / "exchange"),
        )
        engine.publisher = RoundPublisher(engine.store, objects, fragment=(i, 2))
        return engine

    server = ServerThread(build, h.identity).start()
    h.servers.append(server)
    return server


def finalized_round(h: Harness, servers: list[ServerThread]) -> bytes:
    """Two hosts' fragments to both shards, round 1 closed and finalized on chain (and in each shard's
    store); returns the chain's root."""
    clients = [s.client(timeout_s=30) for s in servers]
    for n, host in enumerate(h.hosts):
        update = {name: torch.randn(s, generator=torch.Generator().manual_seed(n)) * 0.01 for name, s in h.spec.items()}
        ok, _ = submit_fragments(clients, 1, split_payload(h.codec, h.payload(update), h.spec, 2), host.address,
                                 host.key, 64)
        assert ok
    for c in clients:
        c.close()
    root = bytes(close_shards_at_deadline(h, servers, 60).checkpoint_sha256)
    deadline = time.monotonic() + 30
    while not all(_recorded(s, h.epoch) for s in servers):
        assert time.monotonic() < deadline, "a shard never recorded round 1 as finalized"
        time.sleep(0.05)
    return root


def _recorded(server: ServerThread, epoch: int) -> bool:
    row = server.engine.store.get_round(epoch, 1)
    return row is not None and row.state == "finalized"


def pull(h: Harness, want: ChainCheckpoint, index: int, out: Path) -> tuple[int, FragmentProof, str]:
    return pull_one_fragment(h.world.client(0), 2, index, want, out, timeout_s=30, max_bytes=1 << 30)


def test_a_client_pulls_one_fragment_and_checks_it_alone_by_its_proof(
    harness: Harness, s3_endpoint: str, s3_bucket: str, capsys: pytest.CaptureFixture[str],
) -> None:
    h = harness
    h.schedule(n_hosts=2, aggregators=SHARD_ORDER, quorum=2)
    objects = open_store(f"s3://{s3_bucket}/frag?endpoint={s3_endpoint}")
    assert isinstance(objects, S3Store)
    servers = [publishing_shard(h, i, objects) for i in range(2)]
    root = finalized_round(h, servers)
    want = chain_checkpoint(h.world.client(0), h.epoch, "1")
    pulled = h.tmp / "pulled"
    with pytest.raises(CliError, match=r"shard 1 of epoch \d+ \(aggregator 0x[0-9a-fA-F]{40}\) has not announced"):
        pull(h, want, 1, pulled / "early.safetensors")
    for server, account in zip(servers, SHARD_ORDER, strict=True):
        h.world.client(account).announce_aggregator(h.epoch, server.target, h.identity.cert_pem)
    # Each shard published the round's S leaf hashes beside its fragment: a store-only client's proof.
    for i in range(2):
        leaves = [bytes.fromhex(x) for x in json.loads(objects.get_bytes(
            f"checkpoints/{h.epoch}/000001.fragments.fragment-{i}-of-2.json"))]
        stored = objects.get_bytes(f"checkpoints/{h.epoch}/000001.fragment-{i}-of-2.safetensors")
        assert FragmentProof.of(leaves, i).proves(root) and fragment_root(leaves) == root
        assert bytes.fromhex(canonical_sha256(tensors_view(stored))) == leaves[i]
    servers[0].stop()  # fragment 1 alone: shard 0 is not needed
    capsys.readouterr()
    size, proof, note = pull(h, want, 1, pulled / "one.safetensors")
    got = load_checkpoint(pulled / "one.safetensors")
    assert set(got.tensors) == set(plan_fragments(h.spec, 2)[1].names) and size == (pulled / "one.safetensors").stat().st_size
    assert (proof.index, proof.count, len(proof.siblings)) == (1, 2, 1)
    assert bytes.fromhex(got.sha256) == proof.fragment_sha256 and proof.proves(root)
    assert note == "the file records no model config" and got.metadata["fragment"] == "1/2"
    assert f"downloaded checkpoints/{h.epoch}/000001.fragment-1-of-2.safetensors from the aggregator's object store" \
        in capsys.readouterr().err

    with pytest.raises(CliError, match=r"--fragment 2: epoch \d+ has 2 fragments, 0 to 1"):
        pull(h, want, 2, pulled / "two.safetensors")
    _a_proof_of_another_fragment_is_refused(h, servers[1], want, pulled)
    _a_proof_that_does_not_lead_to_the_root_is_refused_before_downloading(h, servers[1], want, pulled, capsys)
    _a_tampered_fragment_is_refused(h, servers[1], want, pulled)
    assert sorted(p.name for p in pulled.iterdir()) == ["one.safetensors"]


def _a_proof_of_another_fragment_is_refused(h: Harness, shard: ServerThread, want: ChainCheckpoint, pulled: Path) -> None:
    """Shard 0's account announces shard 1's server: asked for fragment 0, it proves its own fragment 1."""
    h.world.client(SHARD_ORDER[0]).announce_aggregator(h.epoch, shard.target, h.identity.cert_pem)
    with pytest.raises(CliError, match=r"serves the proof of fragment 1 of 2, not of fragment 0 of 2; nothing was"):
        pull(h, want, 0, pulled / "zero.safetensors")


def _a_proof_that_does_not_lead_to_the_root_is_refused_before_downloading(
    h: Harness, shard: ServerThread, want: ChainCheckpoint, pulled: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Shard 1's kept leaves with leaf 0 changed: the proof it serves has a wrong sibling."""
    leaves = fragments_path(shard.engine.store.checkpoint_path(h.epoch, 1))
    honest = leaves.read_text()
    hashes = json.loads(honest)
    leaves.write_text(json.dumps([bytes(32).hex(), hashes[1]]))
    try:
        with pytest.raises(CliError, match=r"shard 1 \(127.0.0.1:\d+\)'s proof of fragment 1 does not lead to the "
                           r"root [0-9a-f]{64} the chain records .*nothing was written"):
            pull(h, want, 1, pulled / "bad-proof.safetensors")
        assert "downloaded" not in capsys.readouterr().err  # refused before a byte of the fragment was fetched
    finally:
        leaves.write_text(honest)


def _a_tampered_fragment_is_refused(h: Harness, shard: ServerThread, want: ChainCheckpoint, pulled: Path) -> None:
    """Shard 1 serves its fragment with one value changed (streamed: no store copy to fall back on), with
    the honest proof: the transfer checks pass, the fragment's hash is no leaf of the root."""
    shard.engine.publisher = None
    path = shard.engine.store.checkpoint_path(h.epoch, 1)
    tampered = load_checkpoint(path)
    name = sorted(tampered.tensors)[0]
    tampered.tensors[name].view(-1)[0] += 1.0
    save_file(tampered.tensors, str(path), metadata=tampered.metadata)
    with pytest.raises(CliError, match=r"fragment 1's tensors hash to [0-9a-f]{64}, not to a leaf of the chain's "
                       r"root .*it was deleted"):
        pull(h, want, 1, pulled / "tampered.safetensors")


def test_no_proof_answers_round_0_an_index_outside_the_fragments_or_an_unsharded_epoch() -> None:
    want = ChainCheckpoint(1, 3, bytes(32), 1337, "0x" + "00" * 20)
    check_fragment_index(2, 3, want)
    with pytest.raises(CliError, match=r"--fragment 3: epoch 1 has 3 fragments, 0 to 2"):
        check_fragment_index(3, 3, want)
    with pytest.raises(CliError, match=r"--fragment -1: epoch 1 has 3 fragments"):
        check_fragment_index(-1, 3, want)
    with pytest.raises(CliError, match=r"round 0 is epoch 1's initial model, recorded whole on chain"):
        check_fragment_index(0, 3, ChainCheckpoint(1, 0, bytes(32), 1337, "0x" + "00" * 20))
    with pytest.raises(CliError, match=r"epoch 1 is not sharded"):
        check_fragment_index(0, 1, want)
