"""A `RoundEngine` without a server, for fast unit tests of acceptance and close: a real SQLite store,
real checkpoint files, the real embedded EVM (deployed and scheduled once per process, reverted after
every test), a clock the test holds, and a two-tensor "model" so that a close takes milliseconds.

`shared_world()` is cached per process: scripts/mutation.sh calls it while its fork server collects the
tests, so that every mutant's forked test run starts with the chain already deployed.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from agg_harness import AGGREGATOR, GNK, ChainWorld, Host
from nacl.signing import SigningKey

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.types import EpochSpec
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.engine_types import EpochContext, SignedReceipt
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.store import Store, now_ms
from gonka_node.core.config import AggregationSettings, RoundSettings
from gonka_node.core.envelope import Submission
from gonka_node.slashing import EvidenceLog
from training.codecs import get_codec

T = TypeVar("T")
SECOND_AGGREGATOR = 8
OUTSIDER = 4  # a dev account that never signs in
SPEC = {"b": (3,), "w": (2, 4)}
REWARD = 10 * GNK
N_ROUNDS = 3
ROUND_S = 10.0


@dataclass
class World:
    chain: ChainWorld
    epoch: int  # three hosts signed in, this aggregator alone
    epoch2: int  # the same hosts, two aggregators (either one's vote finalizes)
    epoch4: int  # the same hosts, two aggregators, both votes needed to finalize
    hosts: list[Host]
    outsider: Host
    init_sha: bytes


def initial_tensors() -> dict[str, torch.Tensor]:
    return {"b": torch.tensor([0.5, -0.25, 1.0]), "w": torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8}


def host(world: ChainWorld, i: int) -> Host:
    return Host(i, world.accounts[i], SigningKey(hashlib.sha256(f"kit-host-{i}".encode()).digest()))


def _schedule(
    world: ChainWorld, init_sha: bytes, aggregators: tuple[int, ...], hosts: list[Host], quorum: int = 1
) -> int:
    gov = world.client(0)
    spec = EpochSpec(
        model_spec_hash=hashlib.sha256(b"kit").digest(), model_uri="preset:tiny",
        data_manifest_hash=hashlib.sha256(b"kit-data").digest(), init_checkpoint_hash=init_sha,
        inner_steps=2, inner_lr=1e-3, batch_size=2, outer_lr=0.5, outer_momentum=0.0, codec="fp32",
        n_rounds=N_ROUNDS, round_length=int(ROUND_S), signin_window=30, min_stake=10 * GNK, max_hosts=8,
        aggregators=tuple(world.accounts[i].address for i in aggregators), aggregator_quorum=quorum,
        reward_per_round=REWARD,
    )
    epoch = gov.create_epoch(spec)
    gov.fund_epoch(epoch, REWARD * N_ROUNDS)
    for h in hosts:
        h.slot = world.client(h.index).join(epoch, 10 * GNK, bytes(h.key.verify_key))
    return epoch


@functools.cache
def shared_world() -> World:
    backend = EmbeddedBackend()
    accounts = backend.dev_accounts()
    deployment = (
        ChainClient(backend, accounts[0]).connect()
        .deploy_all(initial_mint={a.address: 1_000_000 * GNK for a in accounts})
    )
    chain = ChainWorld(backend, accounts, deployment)
    init_sha = TrainingCheckpoints().sha256(initial_tensors())
    hosts = [host(chain, i) for i in (1, 2, 3)]
    epoch = _schedule(chain, init_sha, (AGGREGATOR,), hosts)
    both = (AGGREGATOR, SECOND_AGGREGATOR)
    epoch2 = _schedule(chain, init_sha, both, [host(chain, i) for i in (1, 2, 3)])
    epoch4 = _schedule(chain, init_sha, both, [host(chain, i) for i in (1, 2, 3)], quorum=2)
    backend.increase_time(31)  # these sign-in windows are closed: rounds may close early and be finalized
    return World(chain, epoch, epoch2, epoch4, hosts, host(chain, OUTSIDER), init_sha)


class HeldClock:
    """The engine's clock in ms; it moves only when the test moves it."""

    def __init__(self) -> None:
        self.ms = now_ms()

    def __call__(self) -> int:
        return self.ms


@dataclass
class Kit:
    world: World
    tmp: Path
    clock: HeldClock = field(default_factory=HeldClock)
    settings: RoundSettings = field(
        default_factory=lambda: RoundSettings(
            quorum=2, extend_s=5.0, max_extensions=1, max_update_norm=10.0, max_payload_bytes=4096,
            max_clock_skew_s=2.0, max_chunk_bytes=64,
        )
    )
    aggregation: AggregationSettings = field(default_factory=lambda: AggregationSettings(rule="mean"))
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    engines: list[RoundEngine] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.init_path = self.tmp / "init.safetensors"
        assert TrainingCheckpoints().save(self.init_path, initial_tensors(), {"round": "0"}) == self.world.init_sha
        self.evidence = EvidenceLog(self.tmp / "evidence")

    @property
    def hosts(self) -> list[Host]:
        return self.world.hosts

    def context(self, epoch: int | None = None) -> EpochContext:
        d = self.world.chain.deployment
        return EpochContext(
            chain_id=d.chain_id, registry=bytes.fromhex(d.registry[2:]),
            epoch=self.world.epoch if epoch is None else epoch, codec_name="fp32", codec=get_codec("fp32"),
            spec=SPEC, n_rounds=N_ROUNDS, round_length_s=ROUND_S, outer_lr=0.5,
            outer_momentum=0.5, reward_per_round=REWARD, initial_checkpoint=self.init_path,
            initial_sha256=self.world.init_sha,
        )

    def epoch_in_signin(self) -> int:
        """A new epoch like `world.epoch` (the three hosts, this aggregator alone) whose 30 s sign-in window
        opens now. Not one scheduled with the shared world: the chain's clock is the wall clock, so that
        window may be long closed when a test runs (scripts/mutation.sh forks every mutant's test run
        from a process that built the world minutes before)."""
        w = self.world.chain
        return _schedule(w, self.world.init_sha, (AGGREGATOR,), [host(w, i) for i in (1, 2, 3)])

    def engine(self, epoch: int | None = None, start: bool = True) -> RoundEngine:
        """An engine on this kit's store (a second call: the same aggregator restarted)."""
        e = RoundEngine(
            self.context(epoch), self.settings, self.aggregation, Store(self.tmp / "agg").open(),
            ChainView(self.world.chain.client(AGGREGATOR)), TrainingCheckpoints(), SigningKey(b"\x09" * 32),
            clock=self.clock, evidence=self.evidence,
        )
        self.engines.append(e)
        if start:
            e.start()
        return e

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
        """Run `coro` on the kit's loop; a coroutine still waiting after `timeout_s` fails the test (nothing
        here takes a second: a wait that never ends is a bug, and should not hold a test run for minutes)."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def header(self, engine: RoundEngine, h: Host, payload: bytes, **changes: Any) -> Submission:
        """The header an honest host sends for `payload` in the engine's open round."""
        r = engine.current
        assert r is not None
        fields: dict[str, Any] = dict(
            chain_id=engine.ctx.chain_id, registry=engine.ctx.registry, epoch=r.epoch, round=r.round,
            host=h.address, base_checkpoint_sha256=r.base_sha256, codec="fp32",
            payload_sha256=hashlib.sha256(payload).digest(), payload_length=len(payload), tokens_trained=64,
            timestamp_ms=self.clock.ms, residual_root=hashlib.sha256(h.address).digest(),
        )
        fields.update(changes)
        return Submission(**fields)

    def submit(self, engine: RoundEngine, h: Host, payload: bytes) -> SignedReceipt:
        """Submit and wait for the payload's checks (they run after the receipt, in the engine's pool)."""
        sub = self.header(engine, h, payload)
        receipt = self.run(engine.submit(sub, sub.sign(h.key), chunks(payload), engine.stream_guard("test")))
        self.run(engine.checks.drain(sub.epoch, sub.round))
        return receipt

    def stop(self) -> None:
        for e in self.engines:
            e.checks.close()
            e.store.close()
        self.loop.close()


def update(seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SPEC.items()}


def payload(u: dict[str, torch.Tensor]) -> bytes:
    return get_codec("fp32").encode(u)


async def chunks(data: bytes, size: int = 64) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[Kit]:
    world = shared_world()
    snapshot = world.chain.backend.snapshot()
    k = Kit(world, tmp_path)
    try:
        yield k
    finally:
        k.stop()
        world.chain.backend.revert(snapshot)
