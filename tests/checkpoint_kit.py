"""What the checkpoint client's tests (tests/gonka_node/test_cli_checkpoint.py) and the model server's
(tests/gonka_node/serve/serve_world.py) both stand up: the embedded chain served on 127.0.0.1 with the
contracts deployed, an epoch whose rounds an aggregator account finalizes, and a Checkpoints stream of
a file as an aggregator sends it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.seed import new_secret, seed_commitment
from chain.server import ChainServer
from chain.types import EpochSpec
from gonka_node.core.recipe import Recipe
from proto.gonka.v1 import common_pb2 as common

GNK = 10**9
CHUNK = 64 << 10  # several chunks per tiny checkpoint file


@dataclass
class ServedChain:
    backend: EmbeddedBackend
    server: ChainServer
    accounts: list[Any]
    gov: ChainClient  # account 0: deployed everything, holds the GNK
    deployment_file: Path


def served_chain(root: Path) -> ServedChain:
    """The embedded chain on 127.0.0.1, contracts deployed by account 0, root/deployment.json written."""
    backend = EmbeddedBackend()
    server = ChainServer(backend).start()
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[0]).connect()
    deployment = gov.deploy_all(initial_mint={accounts[0].address: 10_000 * GNK})
    deployment.extra["rpc_url"] = server.url
    deployment.save(root / "deployment.json")
    return ServedChain(backend, server, accounts, gov, root / "deployment.json")


def open_epoch(chain: ServedChain, recipe: Recipe, init_sha: str, n_rounds: int) -> int:
    """An epoch of `recipe` with account 1 its aggregator, funded, sign-in closed; its number."""
    spec = EpochSpec(
        model_spec_hash=recipe.sha256(), model_uri="file:recipe.json", data_manifest_hash=bytes(range(32)),
        init_checkpoint_hash=bytes.fromhex(init_sha), inner_steps=20, inner_lr=2e-3, batch_size=8,
        outer_lr=0.7, outer_momentum=0.9, codec="int8", n_rounds=n_rounds, round_length=600, signin_window=60,
        min_stake=1500 * GNK, max_hosts=4, aggregators=(chain.accounts[1].address,), reward_per_round=1500 * GNK,
    )
    epoch = chain.gov.create_epoch(spec)
    chain.gov.fund_epoch(epoch, 5000 * GNK)
    chain.backend.increase_time(61)
    return epoch


def finalize(aggregator: ChainClient, epoch: int, round_: int, sha: str, root: bytes, hosts: int, total: int) -> None:
    """Finalize a round as an aggregator does, after the round seed's commit-reveal it requires."""
    secret = new_secret()
    aggregator.commit_round_seed(epoch, round_, seed_commitment(secret))
    aggregator.reveal_round_seed(epoch, round_, secret)
    aggregator.finalize_round(epoch, round_, sha, root, hosts, total)


def file_chunks(request: Any, data: bytes, content_sha: bytes, sent: bytes | None = None) -> Iterator[common.FileChunk]:
    """A Checkpoints stream: the meta announcing `data`, then `sent` (default: `data`) in chunks."""
    yield common.FileChunk(meta=common.FileMeta(
        length=len(data), file_sha256=hashlib.sha256(data).digest(), content_sha256=content_sha,
        epoch=request.epoch, round=request.round, format="safetensors"))
    sent = data if sent is None else sent
    for start in range(0, len(sent), CHUNK):
        yield common.FileChunk(data=sent[start : start + CHUNK])
