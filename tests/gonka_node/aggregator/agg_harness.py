"""A real aggregator on 127.0.0.1:0 over the embedded EVM, a tiny real model and real files.

`Harness` deploys the contracts once per module, schedules an epoch per test (three hosts signed in
with ed25519 node keys), and runs the asyncio gRPC server (TLS, the harness's identity, kept across
restarts like an aggregator's data_dir) in a background thread with its own loop. `server.client()`
dials it pinning that certificate.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from eth_account.signers.local import LocalAccount
from nacl.signing import SigningKey
from stdlib_corpus import small_corpus_bytes

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.types import Deployment, EpochSpec
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.scoring import ScoringData
from gonka_node.aggregator.server import AggregatorServer
from gonka_node.aggregator.store import Store
from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import AggregationSettings, RoundSettings
from gonka_node.core.tls import TlsIdentity, create_identity
from gonka_node.slashing import EvidenceLog
from training.codecs import get_codec
from training.data import Windows
from training.diloco import pseudo_gradient
from training.model import ModelConfig, build_model

GNK = 10**9
MODEL_SEED = 7
AGGREGATOR = 9  # dev account index of the aggregator
SEQ_LEN = 32
WINDOWS_PER_HOST = 8


def corpus_windows() -> Windows:
    """~160 KB of the running Python's own sources: real text, no download, same on every machine."""
    return Windows(np.frombuffer(small_corpus_bytes(), dtype=np.uint8).astype(np.int64), SEQ_LEN, heldout_fraction=0.1)


@dataclass
class Host:
    index: int
    account: LocalAccount
    key: SigningKey
    slot: int = -1

    @property
    def address(self) -> bytes:
        return bytes.fromhex(self.account.address[2:])


@dataclass
class ChainWorld:
    backend: EmbeddedBackend
    accounts: list[LocalAccount]
    deployment: Deployment

    def client(self, i: int) -> ChainClient:
        return ChainClient(self.backend, self.accounts[i], self.deployment).connect()


@pytest.fixture(scope="module")
def chain_world() -> ChainWorld:
    backend = EmbeddedBackend()
    accounts = backend.dev_accounts()
    deployment = (
        ChainClient(backend, accounts[0])
        .connect()
        .deploy_all(initial_mint={a.address: 1_000_000 * GNK for a in accounts})
    )
    return ChainWorld(backend, accounts, deployment)


@pytest.fixture(scope="module")
def windows() -> Windows:
    return corpus_windows()


class ServerThread:
    """Runs `AggregatorServer` on its own event loop in a thread; `run(coro)` executes there."""

    def __init__(self, build: Callable[[], RoundEngine], identity: TlsIdentity) -> None:
        self.build = build
        self.identity = identity
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: AggregatorServer | None = None
        self.port = 0

    def start(self) -> ServerThread:
        self.thread.start()

        async def boot() -> int:
            self.server = AggregatorServer(self.build(), self.identity, "127.0.0.1:0")
            return await self.server.start()

        self.port = self.run(boot())
        return self

    @property
    def engine(self) -> RoundEngine:
        assert self.server is not None
        return self.server.engine

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, timeout_s: float = 120.0) -> AggregatorClient:
        """A client that pins this server's certificate."""
        return AggregatorClient(self.target, self.identity.cert_pem, timeout_s)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(0.2))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():  # else it is still running: closing it would raise
            self.loop.close()
        self.engine.store.close()


@dataclass
class Harness:
    world: ChainWorld
    tmp: Path
    windows: Windows
    cfg: ModelConfig = field(default_factory=lambda: ModelConfig.preset("tiny"))
    codec_name: str = "fp32"
    n_rounds: int = 3
    reward_per_round: int = 10 * GNK  # the stake rule: min_stake (10 GNK) × p (1) covers it
    round_length_s: float = 600.0
    settings: RoundSettings = field(
        default_factory=lambda: RoundSettings(quorum=2, max_update_norm=100.0, max_chunk_bytes=1 << 16)
    )
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    hosts: list[Host] = field(default_factory=list)
    epoch: int = 0
    servers: list[ServerThread] = field(default_factory=list)
    identity: TlsIdentity = field(default_factory=create_identity)

    def __post_init__(self) -> None:
        self.base = {n: p.detach().clone() for n, p in build_model(self.cfg, MODEL_SEED).named_parameters()}
        self.spec = {n: tuple(t.shape) for n, t in self.base.items()}
        self.init_path = self.tmp / "init.safetensors"
        self.init_sha = TrainingCheckpoints().save(self.init_path, self.base, {"round": "0"})
        self.codec = get_codec(self.codec_name)

    def schedule(self, n_hosts: int = 3, aggregators: tuple[int, ...] = (AGGREGATOR,), quorum: int = 1) -> None:
        gov = self.world.client(0)
        spec = EpochSpec(
            model_spec_hash=hashlib.sha256(b"tiny").digest(),
            model_uri="preset:tiny",
            data_manifest_hash=hashlib.sha256(b"stdlib").digest(),
            init_checkpoint_hash=self.init_sha,
            inner_steps=20,
            inner_lr=3e-3,
            batch_size=WINDOWS_PER_HOST,
            outer_lr=0.7,
            outer_momentum=0.9,
            codec=self.codec_name,
            n_rounds=self.n_rounds,
            round_length=int(self.round_length_s),
            signin_window=30,
            min_stake=10 * GNK,
            max_hosts=8,
            aggregators=tuple(self.world.accounts[i].address for i in aggregators),
            aggregator_quorum=quorum,
            reward_per_round=self.reward_per_round,
        )
        self.epoch = gov.create_epoch(spec)
        gov.fund_epoch(self.epoch, self.reward_per_round * self.n_rounds)
        for i in range(1, n_hosts + 1):
            host = Host(i, self.world.accounts[i], SigningKey(hashlib.sha256(f"host-{i}".encode()).digest()))
            host.slot = self.world.client(i).join(self.epoch, 10 * GNK, bytes(host.key.verify_key))
            self.hosts.append(host)
        self.world.backend.increase_time(31)  # close the sign-in window: rounds may be finalized

    def context(self) -> EpochContext:
        return EpochContext(
            chain_id=self.world.deployment.chain_id,
            registry=bytes.fromhex(self.world.deployment.registry[2:]),
            epoch=self.epoch,
            codec_name=self.codec_name,
            codec=self.codec,
            spec=self.spec,
            n_rounds=self.n_rounds,
            round_length_s=self.round_length_s,
            outer_lr=0.7,
            outer_momentum=0.9,
            reward_per_round=self.reward_per_round,
            initial_checkpoint=self.init_path,
            initial_sha256=self.init_sha,
            model_factory=lambda: build_model(self.cfg, MODEL_SEED),
            scoring=ScoringData(self.windows, MODEL_SEED, 8, WINDOWS_PER_HOST, 8),
        )

    def build_engine(self) -> RoundEngine:
        chain = self.world.client(AGGREGATOR)
        return RoundEngine(
            self.context(),
            self.settings,
            self.aggregation,
            Store(self.tmp / "agg").open(),
            ChainView(chain),
            TrainingCheckpoints(),
            SigningKey(b"\x09" * 32),
            evidence=EvidenceLog(self.tmp / "agg" / "evidence"),
        )

    def start_server(self) -> ServerThread:
        server = ServerThread(self.build_engine, self.identity).start()
        self.servers.append(server)
        return server

    # ---- what hosts send -----------------------------------------------------------------------------

    def honest_update(
        self, host: Host, round_: int, base: dict[str, torch.Tensor] | None = None, steps: int = 20
    ) -> dict[str, torch.Tensor]:
        """Train the tiny model on this host's assigned windows (AdamW) and return Δ = θ_base − θ_local."""
        base = self.base if base is None else base
        model = build_model(self.cfg, MODEL_SEED)
        model.load_state_dict(base)
        ids = self.windows.assignment(
            epoch_seed=MODEL_SEED,
            round_index=round_,
            slot=host.slot,
            max_slots=8,
            windows_per_host=WINDOWS_PER_HOST,
        )
        batch = self.windows.stack(ids)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        model.train()
        for _ in range(steps):
            opt.zero_grad()
            model.loss(batch[:, :-1], batch[:, 1:]).backward()
            opt.step()
        return pseudo_gradient(base, dict(model.named_parameters()))

    def payload(self, update: dict[str, torch.Tensor]) -> bytes:
        return self.codec.encode(update)

    def stop(self) -> None:
        for s in self.servers:
            if s.thread.is_alive():
                s.stop()


@pytest.fixture
def harness(chain_world: ChainWorld, windows: Windows, tmp_path: Path) -> Iterator[Harness]:
    # One intra-op thread: the server's loop thread and torch's OpenMP pool otherwise fight over 2 cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    snapshot = chain_world.backend.snapshot()
    h = Harness(chain_world, tmp_path, windows)
    try:
        yield h
    finally:
        h.stop()
        chain_world.backend.revert(snapshot)
        torch.set_num_threads(threads)


async def expire(engine: RoundEngine) -> None:
    """Move the open round's deadline into the past (the store's own call), as time passing would."""
    r = engine.current
    assert r is not None
    engine.store.extend_round(r.epoch, r.round, 0)
    engine.current = engine.store.get_round(r.epoch, r.round)


def close_shards_at_deadline(h: Harness, servers: list[ServerThread], timeout_s: float) -> Any:
    """Every shard's open round past its deadline; round 1 finalized on chain within `timeout_s`, its
    hash the Merkle root over the fragment hashes the shards wrote. Returns the chain's round result."""
    from gonka_node.aggregator.shard_close import read_fragment_hashes
    from gonka_node.core.fragments import fragment_root

    for s in servers:
        s.run(expire(s.engine))
    chain = h.world.client(0)
    deadline = time.monotonic() + timeout_s
    while not chain.round_result(h.epoch, 1).finalized and time.monotonic() < deadline:
        time.sleep(0.2)
    result = chain.round_result(h.epoch, 1)
    hashes = read_fragment_hashes(servers[0].engine.store.checkpoint_path(h.epoch, 1))
    assert result.finalized and bytes(result.checkpoint_sha256) == fragment_root(hashes)
    return result


SECOND = 8  # the second aggregator's dev account in the two-shard tests (AGGREGATOR is the first)
SHARD_ORDER = (AGGREGATOR, SECOND)  # the epoch's aggregators in order: shard i is SHARD_ORDER[i]


def shard_context(h: Harness, i: int) -> EpochContext:
    """Shard i's context in an epoch naming SHARD_ORDER (no scoring: the shard tests check the fragments)."""
    import dataclasses

    from gonka_node.aggregator.shard import shard_role

    me = bytes.fromhex(h.world.accounts[SHARD_ORDER[i]].address[2:])
    agg = [bytes.fromhex(h.world.accounts[a].address[2:]) for a in SHARD_ORDER]
    role = shard_role(h.spec, agg, me, h.aggregation.rule)
    assert role is not None
    return dataclasses.replace(h.context(), spec=role.spec, shard=role, model_factory=None, scoring=None)
