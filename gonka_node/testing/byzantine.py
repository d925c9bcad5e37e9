"""One epoch in one process, some hosts adversarial: what the adversary tests and the benchmark run.

Real parts: the embedded EVM (slashing by bonded challenges the aggregator files and upholds), the
aggregator's gRPC server (TLS) on 127.0.0.1:0 in its own event loop, honest `HostNode`s and `AdversarialHost`s in threads. Every
host's client is a `TappedClient`: the tap sees all uploads (copiers, mixers, grinders and
front-runners read it); the victim's uploads stay open `slow_link_s` after their last chunk when a
front-runner is in the plan. The aggregator's clock is driven: once every host has made its attempt in
a round, the clock jumps past the deadline, so a refused adversary costs no waiting (the round closes
with whoever was accepted); the wall time of that jump and of the round's close are kept, and their
difference is the close delay a staller causes. After the last round: held-out loss of the final
model, GNK paid per host and round, evidence collected from the aggregator's store and evidence log,
the documented slashes carried out through bonded challenges the aggregator files and upholds
(`gonka_node.slashing.challenge_all`), and the stake each host lost, read back from the chain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eth_account import Account
from eth_utils import to_checksum_address

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.units import NGONKA_PER_GNK as GNK
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.server import AggregatorServer
from gonka_node.aggregator.store import Store, now_ms
from gonka_node.core.config import AggregationSettings, RoundSettings
from gonka_node.core.keys import NodeKeys, NodeSigningKey
from gonka_node.core.recipe import Recipe
from gonka_node.core.tls import TlsIdentity, create_identity
from gonka_node.epoch_setup import EpochTerms, aggregator_context, epoch_spec, initial_checkpoint
from gonka_node.host.events import LogEvents
from gonka_node.host.node import HostNode, HostSettings
from gonka_node.slashing import EvidenceLog, RoundIdentity, SlashDecision, challenge_all, collect_evidence
from gonka_node.testing.adversary import (
    AdversarialHost,
    KitSettings,
    Outcome,
    Tap,
    TappedClient,
    make_behaviour,
)
from training.inner import evaluate
from training.model import build_model

GOVERNANCE, AGGREGATOR = 0, 9  # dev accounts; hosts are 1..8
STAKE = 10 * GNK


@dataclass(frozen=True)
class EpochPlan:
    recipe: Recipe
    hosts: int = 4
    adversaries: dict[int, str] = field(default_factory=dict)  # host index (1..hosts) → behaviour
    victim: int = 1  # whose uploads copiers, replayers and front-runners take
    reward_per_round: int = 100 * GNK
    replay_probability: float = 1.0  # the epoch's p: each host's round is replayed with it
    stake: int | None = None  # each host's stake and the epoch's min_stake; None: reward / p (the least)
    heldout_windows: int = 32
    eval_windows: int = 128
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    stall_cap_s: float = 600.0  # a staller cancels its own stream after this long
    slow_link_s: float = 1.5  # with a front-runner: the victim's stream stays open this long after its last chunk
    timeout_s: float = 900.0


@dataclass
class EpochReport:
    final_loss: float
    initial_loss: float
    rewards: dict[str, int]  # checksummed address → ngonka earned over the epoch
    adversaries: dict[str, str]  # address → behaviour
    outcomes: dict[str, list[Outcome]]
    slashed: list[SlashDecision]
    reasons: dict[str, dict[int, list[str]]]  # address → round → the aggregator's reasons
    seconds: float
    round_rewards: dict[str, dict[int, int]] = field(default_factory=dict)  # address → round → ngonka
    aggregated: dict[str, dict[int, bool]] = field(default_factory=dict)  # address → round → in the aggregate
    rounds: list[int] = field(default_factory=list)  # rounds that closed (finalized or skipped)
    stake: int = STAKE
    stake_lost: dict[str, int] = field(default_factory=dict)  # address → stake − what remains on chain
    # round → seconds from its deadline passing to its close beginning (uploads cut: LATE from then on)
    close_delay_s: dict[int, float] = field(default_factory=dict)
    epoch: int = 0
    addresses: dict[int, str] = field(default_factory=dict)  # host index (1..hosts) → address

    def gnk(self, adversarial: bool) -> float:
        return sum(a for h, a in self.rewards.items() if (h in self.adversaries) == adversarial) / GNK

    def honest(self) -> list[str]:
        return sorted(h for h in self.rewards if h not in self.adversaries)

    def slashed_adversary(self) -> bool:
        return any(self.stake_lost.get(h, 0) > 0 for h in self.adversaries)

    def net_gnk(self) -> float:
        """What the adversaries came out with: GNK earned minus stake lost."""
        return sum(self.rewards.get(h, 0) - self.stake_lost.get(h, 0) for h in self.adversaries) / GNK

    def honest_gnk_per_host(self) -> list[float]:
        return [self.rewards[h] / GNK for h in self.honest()]

    def honest_excluded(self) -> list[tuple[str, int, list[str]]]:
        """(host, round, reasons) of each honest host-round that did not make it into the aggregate."""
        out = []
        for h in self.honest():
            for r in self.rounds:
                if not self.aggregated.get(h, {}).get(r, False):
                    out.append((h, r, self.reasons.get(h, {}).get(r) or ["no accepted submission"]))
        return out

    def honest_slashed(self) -> int:
        return sum(1 for h in self.honest() if self.stake_lost.get(h, 0) > 0)

    def max_close_delay_s(self) -> float:
        return max(self.close_delay_s.values(), default=0.0)

    def median_honest_reward(self, round_: int) -> float:
        return statistics.median([self.round_rewards.get(h, {}).get(round_, 0) for h in self.honest()] or [0])


class Attempts(LogEvents):
    """Records the rounds in which a host has made its submission attempt (accepted or not)."""

    def __init__(self) -> None:
        self.rounds: set[int] = set()

    def submitted(self, round_: int, accepted: bool, reason: str, seconds: float) -> None:
        self.rounds.add(round_)


class DrivenClock:
    def __init__(self) -> None:
        self.offset = 0

    def __call__(self) -> int:
        return now_ms() + self.offset


class Aggregator:
    """The aggregator's server (TLS, `identity` or a fresh one) in a thread with its own event loop (a
    context manager → target; clients pin `identity.cert_pem`)."""

    def __init__(self, engine: RoundEngine, identity: TlsIdentity | None = None) -> None:
        self.engine = engine
        self.identity = identity or create_identity()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()

        async def boot() -> int:
            self.server = AggregatorServer(self.engine, self.identity, "127.0.0.1:0")
            return await self.server.start()

        return f"127.0.0.1:{asyncio.run_coroutine_threadsafe(boot(), self.loop).result(120)}"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.2), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


def run_epoch(plan: EpochPlan, root: Path, cache_dir: Path | None = None) -> EpochReport:
    started = time.monotonic()
    recipe = plan.recipe
    backend = EmbeddedBackend()
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[GOVERNANCE]).connect()
    terms = EpochTerms.staked_for(plan.reward_per_round, plan.replay_probability,
                                  aggregators=[accounts[AGGREGATOR].address], round_length_s=600,
                                  signin_window_s=60, max_hosts=8)
    if plan.stake is not None:
        terms = dataclasses.replace(terms, min_stake=plan.stake)
    stake = terms.min_stake
    mint = max(1_000 * GNK, stake + plan.reward_per_round * recipe.n_rounds)
    deployment = gov.deploy_all(initial_mint={a.address: mint for a in accounts})
    gov = ChainClient(backend, accounts[GOVERNANCE], deployment).connect()

    def client(i: int) -> ChainClient:
        return ChainClient(backend, accounts[i], deployment).connect()

    init_path = root / "init.safetensors"
    init_sha = initial_checkpoint(recipe, init_path)
    epoch = gov.create_epoch(epoch_spec(recipe, init_sha, terms, "file:recipe.json"))
    if plan.reward_per_round:
        gov.fund_epoch(epoch, plan.reward_per_round * recipe.n_rounds)
    keys = {i: NodeKeys(NodeSigningKey(bytes([i]) * 32), Account.from_key(accounts[i].key))
            for i in range(1, plan.hosts + 1)}
    for i, k in keys.items():
        client(i).join(epoch, stake, k.node_public_key)
    backend.increase_time(61)

    agg_chain = client(AGGREGATOR)
    ctx = aggregator_context(recipe, agg_chain.get_epoch(epoch), chain_id=deployment.chain_id,
                             registry=deployment.registry, init_path=init_path, cache_dir=cache_dir,
                             heldout_windows=plan.heldout_windows)
    store = Store(root / "aggregator").open()
    evidence = EvidenceLog(root / "aggregator" / "evidence")
    clock = DrivenClock()
    settings = RoundSettings(quorum=1, max_clock_skew_s=10**6)
    engine = RoundEngine(ctx, settings, plan.aggregation, store, ChainView(agg_chain), TrainingCheckpoints(),
                         NodeSigningKey(b"\x09" * 32).signing_key, clock=clock, evidence=evidence)
    tap = Tap()
    attempts = {i: Attempts() for i in keys}
    passed: dict[int, float] = {}
    began: dict[int, float] = {}
    try:
        server = Aggregator(engine)
        with server as target:
            pin = server.identity.cert_pem
            nodes = [_node(plan, stake, i, (target, pin), tap, keys, client(i), attempts[i], root, cache_dir)
                     for i in keys]
            with ThreadPoolExecutor(len(nodes)) as pool:
                futures = [pool.submit(n.run) for n in nodes]
                _drive(engine, clock, attempts, futures, plan.timeout_s, passed, began)
                for f in futures:
                    f.result(timeout=60)
        records = collect_evidence(store, epoch, RoundIdentity.of(ctx), evidence)
        # Anyone may challenge with a bond; the epoch's aggregator (quorum 1 here) rules on it.
        slashed = challenge_all(agg_chain, [agg_chain], epoch, records, "evidence/<sha256>.json")
        report = _report(plan, stake, root, store, epoch, nodes, slashed, started, cache_dir)
        report.stake_lost = {h: gov.host_info(epoch, h).slashed for h in report.rewards}
        report.close_delay_s = _close_delays(store, epoch, passed, began)
        return report
    finally:
        store.close()


def _node(plan: EpochPlan, stake: int, i: int, aggregator: tuple[str, bytes], tap: Tap, keys: dict[int, NodeKeys],
          chain: ChainClient, events: Attempts, root: Path, cache_dir: Path | None) -> HostNode:
    settings = HostSettings(epoch=chain.epoch_count(), stake=stake, state_dir=root / f"host{i}",
                            cache_dir=cache_dir, poll_s=0.05, backoff_s=0.1)
    target, pin = aggregator  # the address and the pinned certificate
    address = {j: bytes.fromhex(k.evm_address[2:]) for j, k in keys.items()}
    slow = i == plan.victim and "front_run" in plan.adversaries.values()
    agg = TappedClient(target, pin, tap, 120.0, owner=address[i], hold_s=plan.slow_link_s if slow else 0.0)
    if i not in plan.adversaries:
        return HostNode(settings, plan.recipe, chain, agg, keys[i], events)
    kit = KitSettings(sources=tuple(a for j, a in address.items() if j not in plan.adversaries),
                      replay_fraction=plan.replay_probability, stall_cap_s=plan.stall_cap_s)
    victim = address[plan.victim]
    behaviour = make_behaviour(plan.adversaries[i], tap, victim, kit)
    return AdversarialHost(settings, plan.recipe, chain, agg, keys[i], events, behaviour=behaviour, victim=victim)


def _drive(engine: RoundEngine, clock: DrivenClock, attempts: dict[int, Attempts], futures: list[Any],
           timeout_s: float, passed: dict[int, float], began: dict[int, float]) -> None:
    """Move the aggregator's clock past a round's deadline once every host has made its attempt;
    `passed` gets the wall time (time.time()) at which each round's deadline was passed so, `began` the
    wall time at which its close was first seen under way (polled: up to 50 ms late)."""
    deadline = time.monotonic() + timeout_s
    while not all(f.done() for f in futures):
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        r = engine.current
        if r is not None and engine.closing:
            began.setdefault(r.round, time.time())
        if r is not None and not engine.closing and all(r.round in a.rounds for a in attempts.values()):
            clock.offset = max(clock.offset, r.deadline_ms - now_ms() + 1)
            passed.setdefault(r.round, time.time())
        if time.monotonic() > deadline:
            raise TimeoutError(f"the epoch did not finish within {timeout_s:.0f} s")
        time.sleep(0.05)


def _close_delays(store: Store, epoch: int, passed: dict[int, float], began: dict[int, float]) -> dict[int, float]:
    """round → seconds from the driven clock passing its deadline to its close beginning (`began`; a close
    over before the poll saw it: its end, the store's closed_ms); 0 for a round that closed before its
    deadline (everyone had submitted). What follows the beginning (the checks, replays, scoring) is the
    close's own work, which no host can stretch by holding an upload open: it takes seconds more on a
    loaded machine and measures the machine, not the stall."""
    out = {}
    for row in store.rounds(epoch):
        if row.closed_ms is not None:
            start = began.get(row.round, row.closed_ms / 1000)
            out[row.round] = max(0.0, start - passed[row.round]) if row.round in passed else 0.0
    return out


def _report(plan: EpochPlan, stake: int, root: Path, store: Store, epoch: int, nodes: list[HostNode],
            slashed: list[SlashDecision], started: float, cache_dir: Path | None) -> EpochReport:
    rewards: dict[str, int] = {}
    reasons: dict[str, dict[int, list[str]]] = {}
    per_round: dict[str, dict[int, int]] = {}
    aggregated: dict[str, dict[int, bool]] = {}
    closed: list[int] = []
    last = None
    for row in store.rounds(epoch):
        for c in store.contributions(epoch, row.round):
            h = to_checksum_address(c.host)
            rewards[h] = rewards.get(h, 0) + c.reward
            reasons.setdefault(h, {})[row.round] = list(c.reasons)
            per_round.setdefault(h, {})[row.round] = c.reward
            aggregated.setdefault(h, {})[row.round] = bool(c.aggregated)
        if row.state in ("finalized", "skipped"):
            closed.append(row.round)
        if row.state == "finalized":
            last = row.round
    for n in nodes:
        rewards.setdefault(to_checksum_address(n.keys.evm_address), 0)
    windows = plan.recipe.windows(cache_dir)
    held = windows.sample_heldout(12345, plan.eval_windows)
    model = build_model(plan.recipe.model, plan.recipe.init_seed)
    initial = evaluate(model, windows.batches(held, 32))
    if last is not None:
        model.load_state_dict(TrainingCheckpoints().load(store.checkpoint_path(epoch, last)))
    final = evaluate(model, windows.batches(held, 32))
    adversaries: dict[str, str] = {to_checksum_address(n.keys.evm_address): plan.adversaries[i]
                   for i, n in enumerate(nodes, start=1) if i in plan.adversaries}
    outcomes: dict[str, list[Outcome]] = {to_checksum_address(n.keys.evm_address): n.outcomes
                for n in nodes if isinstance(n, AdversarialHost)}
    return EpochReport(final, initial, rewards, adversaries, outcomes, slashed, reasons,
                       round(time.monotonic() - started, 1), per_round, aggregated, closed, stake,
                       epoch=epoch, addresses={i: to_checksum_address(n.keys.evm_address)
                                               for i, n in enumerate(nodes, start=1)})


