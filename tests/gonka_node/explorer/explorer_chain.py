"""A small epoch played on the embedded EVM for the explorer's tests: scheduled, funded, hosts signed in,
rounds opened (seed commit), closed (reveal) and finalized with a real reward Merkle root."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.merkle import RewardTree
from chain.seed import seed_commitment
from chain.types import Deployment, EpochSpec

GNK = 10**9
AGGREGATOR = 9  # dev account index; hosts are 1..3
REWARD = 30 * GNK


def sha(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass
class Net:
    backend: EmbeddedBackend
    deployment: Deployment

    def client(self, i: int = 0) -> ChainClient:
        return ChainClient(self.backend, self.backend.dev_accounts()[i], self.deployment).connect()

    def address(self, i: int) -> str:
        return str(self.backend.dev_accounts()[i].address)

    def schedule(self, n_rounds: int = 3) -> int:
        gov = self.client(0)
        spec = EpochSpec(
            model_spec_hash=sha("model"), model_uri="file:recipe.json", data_manifest_hash=sha("data"),
            init_checkpoint_hash=sha("ckpt-0"), inner_steps=8, inner_lr=3e-3, batch_size=8, outer_lr=0.7,
            outer_momentum=0.9, codec="int8", n_rounds=n_rounds, round_length=600, signin_window=600,
            min_stake=REWARD, max_hosts=8, aggregators=(self.address(AGGREGATOR),), reward_per_round=REWARD,
        )
        epoch = gov.create_epoch(spec)
        gov.fund_epoch(epoch, n_rounds * REWARD)
        return epoch

    def join(self, epoch: int, host: int) -> None:
        self.client(host).join(epoch, REWARD, sha(f"node-key-{host}"))

    def finalize(self, epoch: int, round_: int, hosts: tuple[int, ...]) -> RewardTree:
        agg = self.client(AGGREGATOR)
        secret = sha(f"secret-{epoch}-{round_}")
        agg.commit_round_seed(epoch, round_, seed_commitment(secret))
        agg.reveal_round_seed(epoch, round_, secret)
        share = REWARD // len(hosts)
        tree = RewardTree(self.deployment.chain_id, self.deployment.registry, epoch, round_,
                          [(self.address(h), share) for h in hosts])
        agg.finalize_round(epoch, round_, sha(f"ckpt-{round_}"), tree.root, len(hosts), share * len(hosts))
        return tree


def deploy() -> Net:
    backend = EmbeddedBackend()
    accounts = backend.dev_accounts()
    deployment = ChainClient(backend, accounts[0]).connect().deploy_all(
        initial_mint={a.address: 1_000_000 * GNK for a in accounts}
    )
    return Net(backend, deployment)
