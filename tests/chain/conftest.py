"""Chain fixtures: every contract/client test runs on the embedded py-evm and on a real anvil node.

Each backend is deployed once per session (an EOA-governed set and a Governor-governed set); every
test runs between an evm_snapshot and an evm_revert, so tests see a fresh chain and stay fast.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from eth_account.signers.local import LocalAccount

from chain.anvil import AnvilNode
from chain.backends import ChainBackend, EmbeddedBackend, RpcBackend
from chain.client import ChainClient
from chain.errors import ChainRevert
from chain.seed import seed_commitment
from chain.types import Deployment, EpochSpec

GNK = 10**9
DEV_BALANCE = 1_000_000 * GNK
REPO = Path(__file__).resolve().parents[2]


def sha(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@pytest.fixture(scope="session")
def anvil_url() -> Iterator[str]:
    node_bin = REPO / "node_modules" / ".bin" / "anvil"
    binary = "anvil" if AnvilNode.available() else str(node_bin)
    if not AnvilNode.available(binary):
        if os.environ.get("CI"):
            pytest.fail("anvil is not installed but CI is set: the chain tests must run on anvil in CI")
        pytest.skip("anvil not installed (npm install puts it in node_modules/.bin)")
    node = AnvilNode(binary)
    yield node.start()
    node.stop()


@dataclass
class World:
    """One backend with both deployments; `client(i)` signs as dev account i."""

    name: str
    backend: ChainBackend
    accounts: list[LocalAccount]
    deployment: Deployment  # governance = accounts[0] (an EOA)
    governed: Deployment  # governance = the Governor contract

    def client(self, i: int = 0, governed: bool = False) -> ChainClient:
        deployment = self.governed if governed else self.deployment
        return ChainClient(self.backend, self.accounts[i], deployment).connect()

    def address(self, i: int) -> str:
        return str(self.accounts[i].address)

    def spec(self, **overrides: object) -> EpochSpec:
        return make_spec(self.address(1), **overrides)


def make_spec(aggregator: str, **overrides: object) -> EpochSpec:
    base = EpochSpec(
        model_spec_hash=sha("model"), model_uri="https://example.org/llama-tiny.json",
        data_manifest_hash=sha("data"), init_checkpoint_hash=sha("ckpt-0"),
        inner_steps=50, inner_lr=3e-4, batch_size=8, outer_lr=0.7, outer_momentum=0.9, codec="topk-int8",
        n_rounds=3, round_length=600, signin_window=3600, min_stake=100 * GNK, max_hosts=4,
        aggregators=(aggregator,), aggregator_quorum=1, reward_per_round=100 * GNK,
        replay_probability=1.0, challenge_window=3600, challenge_bond=GNK,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def reverts(reason: str) -> pytest.RaisesExc[ChainRevert]:
    return pytest.raises(ChainRevert, match=f"^reverted: {reason}")


def seed_secret(epoch: int, round_: int, aggregator: int) -> bytes:
    return sha(f"seed-secret-{epoch}-{round_}-{aggregator}")


def settle_seed(world: World, epoch: int, round_: int, aggregators: tuple[int, ...] = (1,)) -> None:
    """Each listed aggregator (dev account index) commits, then each reveals: the round can be final."""
    for i in aggregators:
        world.client(i).commit_round_seed(epoch, round_, seed_commitment(seed_secret(epoch, round_, i)))
    for i in aggregators:
        world.client(i).reveal_round_seed(epoch, round_, seed_secret(epoch, round_, i))


def _deploy_world(name: str, backend: ChainBackend) -> World:
    accounts = backend.dev_accounts()
    deployer = ChainClient(backend, accounts[0]).connect()
    mint = {a.address: DEV_BALANCE for a in accounts}
    deployment = deployer.deploy_all(initial_mint=mint)
    governed = ChainClient(backend, accounts[0]).connect().deploy_all(
        use_governor=True, voting_period_s=3600, quorum_bps=1000, initial_mint=mint
    )
    return World(name, backend, accounts, deployment, governed)


@pytest.fixture(scope="session", params=["embedded", "anvil"])
def world_session(request: pytest.FixtureRequest) -> World:
    if request.param == "embedded":
        return _deploy_world("embedded", EmbeddedBackend())
    return _deploy_world("anvil", RpcBackend(request.getfixturevalue("anvil_url")))


@pytest.fixture
def world(world_session: World) -> Iterator[World]:
    snapshot = world_session.backend.snapshot()
    yield world_session
    world_session.backend.revert(snapshot)
