"""`gonka-node challenge file|list|vote|resolve` against a real chain served over JSON-RPC on 127.0.0.1.

Host 1 has signed, with the node key it registered for epoch 1, a submission an aggregator kept as
garbage evidence. Account 5, a stranger, files the record with a bond; the epoch's aggregator
(account 9) upholds it; host 1's stake is slashed. A record the host did not sign is refused before
any bond is escrowed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.server import ChainServer
from chain.types import EpochSpec
from gonka_node.cli import main
from gonka_node.core.envelope import Submission
from gonka_node.core.keys import NodeSigningKey
from gonka_node.slashing import Evidence, header_fields

GNK = 10**9
STAKE = 100 * GNK


@dataclass
class World:
    deployment: Path
    backend: EmbeddedBackend
    reader: ChainClient
    host: str
    evidence: Path  # signed by host 1's registered node key
    forged: Path  # the same claim, signed by another key


def record(path: Path, key: NodeSigningKey, host: str, registry: str, chain_id: int) -> Path:
    sub = Submission(chain_id, bytes.fromhex(registry[2:]), 1, 1, bytes.fromhex(host[2:]), b"\x02" * 32,
                     "int8", b"\x03" * 32, 10, 0, 1, b"\x04" * 32)
    ev = Evidence("garbage", 1, 1, host, header_fields(sub), sub.sign(key.signing_key).hex(), "UNDECODABLE: …")
    out = path / f"{ev.hash.hex()}.json"
    out.write_bytes(ev.canonical())
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("challenge-cli")
    backend = EmbeddedBackend()
    server = ChainServer(backend).start()
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[0]).connect()
    deployment = gov.deploy_all(initial_mint={a.address: 1_000 * GNK for a in accounts})
    deployment.extra["rpc_url"] = server.url
    deployment.save(tmp / "deployment.json")
    spec = EpochSpec(
        model_spec_hash=hashlib.sha256(b"m").digest(), model_uri="m", data_manifest_hash=hashlib.sha256(b"d").digest(),
        init_checkpoint_hash=hashlib.sha256(b"i").digest(), inner_steps=1, inner_lr=1e-3, batch_size=1, outer_lr=0.7,
        outer_momentum=0.9, codec="int8", n_rounds=2, round_length=600, signin_window=60, min_stake=STAKE,
        max_hosts=4, aggregators=(accounts[9].address,), reward_per_round=STAKE,
    )  # fmt: skip
    epoch = gov.create_epoch(spec)
    key = NodeSigningKey(b"\x01" * 32)
    host = ChainClient(backend, accounts[1], deployment).connect()
    host.join(epoch, STAKE, key.public_key)
    yield World(
        tmp / "deployment.json", backend, gov, host.address,
        record(tmp, key, host.address, deployment.registry, deployment.chain_id),
        record(tmp, NodeSigningKey(b"\x07" * 32), host.address, deployment.registry, deployment.chain_id),
    )
    server.stop()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["challenge", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_stranger_files_evidence_and_the_aggregator_upholds_it(world: World, capsys) -> None:
    chain = ["--deployment", str(world.deployment)]
    code, _, err = run(capsys, "file", *chain, "--dev-account", "5", "--evidence", str(world.forged))
    assert code == 2 and err.count("\n") == 1
    assert f"not signed by the node key {world.host} registered for epoch 1" in err
    assert world.reader.challenges(1) == []  # refused before any bond was escrowed

    stranger = world.backend.dev_accounts()[5].address
    before = world.reader.gnk_balance(stranger)
    code, out, err = run(capsys, "file", *chain, "--dev-account", "5", "--evidence", str(world.evidence),
                         "--uri", "https://example.org/e.json")
    assert (code, err) == (0, "")
    assert out.startswith(f"challenge 1: {world.host}'s stake in epoch 1 frozen on garbage evidence")
    code, out, _ = run(capsys, "list", *chain, "--epoch", "1")
    assert code == 0 and "open" in out and world.evidence.stem in out and "https://example.org/e.json" in out

    code, out, err = run(capsys, "vote", *chain, "--dev-account", "9", "--id", "1", "--uphold")
    assert (code, err) == (0, "") and "1 to uphold, 0 to reject (upheld)" in out
    assert world.reader.host_info(1, world.host).slashed == STAKE
    assert world.reader.gnk_balance(stranger) - before == STAKE // 2  # its bond back and half the stake

    code, _, err = run(capsys, "vote", *chain, "--dev-account", "9", "--id", "1", "--reject")
    assert code == 2 and err.count("\n") == 1 and "registry:" in err  # resolved already: a one-line revert


def test_records_that_are_not_evidence_are_refused(world: World, tmp_path: Path, capsys) -> None:
    chain = ["--deployment", str(world.deployment), "--dev-account", "5"]
    (tmp_path / "junk.json").write_text("{\"kind\": 1}")
    (tmp_path / "late.json").write_text(world.evidence.read_text().replace('"garbage"', '"late"'))
    # A top-k mismatch claimed on an opening that does not answer its challenge: its challenge is the
    # aggregator's words until checked against the chain's seed and the recipe, so not without a recipe.
    record = json.loads(world.evidence.read_text())
    record.update(kind="replay_mismatch", other={"opening": {}, "claim": "unverified", "challenge": {}})
    (tmp_path / "topk.json").write_text(json.dumps(record))
    for path, message in ((tmp_path / "missing.json", "no such file"),
                          (tmp_path / "junk.json", "not an evidence record"),
                          (tmp_path / "late.json", "kind 'late' is not slashable"),
                          (tmp_path / "topk.json", "give --recipe FILE")):
        code, out, err = run(capsys, "file", *chain, "--evidence", str(path))
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
