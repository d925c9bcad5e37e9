"""The replay and the score in sharded epochs (docs/PROTOCOL.md "Sharded aggregators"): the same hosts'
updates of a (micro) model closed by one aggregator and by two shards (S = 2, LocalExchange). Every
shard puts the picked hosts' fragment payloads in the exchange; the verifier reassembles the whole
updates and replays and scores them; the verdicts, scores and rewards equal the one aggregator's, and
the host whose update is twice its replay is excluded with the slashable mismatch by both."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from pathlib import Path

import pytest
import torch
from agg_harness import AGGREGATOR
from engine_kit import Kit, payload
from micro_model import INNER, SEED, SLOTS, micro_windows, model
from nacl.signing import SigningKey
from test_shard_round import ORDER, address, fragment_payload

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.close import NOT_SAMPLED, score_step
from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.replay import MISMATCH, PASSED, ReplayData, chosen_for_replay
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.scoring import Scorer, ScoringData
from gonka_node.aggregator.shard import (
    BASE_KEY,
    DirExchange,
    FragmentReport,
    LocalExchange,
    ShardExchange,
    payload_key,
    sampled,
    shard_role,
)
from gonka_node.aggregator.store import ContributionRow, Store
from gonka_node.core.config import AggregationSettings
from gonka_node.core.fragments import plan_fragments
from training.checkpoint import load_checkpoint
from training.data import Windows
from training.worker import Assignment, replay_round


@pytest.fixture(scope="module")
def windows() -> Windows:
    return micro_windows()


def micro_context(kit: Kit, epoch: int, windows: Windows) -> EpochContext:
    """The kit's context of `epoch` with a micro Llama as its model, replaying every host (p = 1)."""
    base = {n: p.detach().clone() for n, p in model().named_parameters()}
    path = kit.tmp / "micro.safetensors"
    sha = TrainingCheckpoints().save(path, base, {"round": "0"})
    return dataclasses.replace(
        kit.context(epoch), spec={n: tuple(t.shape) for n, t in base.items()}, initial_checkpoint=path,
        initial_sha256=sha, model_factory=model, scoring=ScoringData(windows, SEED, SLOTS, 4, 4),
        replay=ReplayData(model, INNER, windows, SEED, SLOTS), replay_probability=1.0,
    )


def engine(kit: Kit, ctx: EpochContext, name: str, who: int, key: bytes, exchange: ShardExchange | None) -> RoundEngine:
    e = RoundEngine(
        ctx, kit.settings, kit.aggregation, Store(kit.tmp / name).open(), ChainView(kit.world.chain.client(who)),
        TrainingCheckpoints(), SigningKey(key), clock=kit.clock, exchange=exchange,
    )
    kit.engines.append(e)
    e.start()
    return e


def slots(e: RoundEngine) -> dict[bytes, int]:
    return {m.address: m.slot for m in e.chain.members(e.ctx.epoch)}


def seen(c: ContributionRow) -> tuple[bytes, float, int, bool, list[str]]:
    """What the verdict decides of a host: its score, reward, whether aggregated, and its replay line."""
    return c.host, c.score, c.reward, c.aggregated, [r for r in c.reasons if r.startswith(("replay", "score"))]


def test_two_shards_replay_and_score_the_picked_hosts_as_one_aggregator(kit: Kit, windows: Windows) -> None:
    kit.settings = dataclasses.replace(kit.settings, max_payload_bytes=1 << 20, max_chunk_bytes=1 << 16)
    kit.aggregation = AggregationSettings(rule="clip_median")
    epoch, epoch4 = kit.world.epoch, kit.world.epoch4
    ctx = micro_context(kit, epoch, windows)
    whole = engine(kit, ctx, "agg", AGGREGATOR, b"\x09" * 32, None)
    exchange = LocalExchange()
    shards = []
    for i, who in enumerate(ORDER):
        role = shard_role(ctx.spec, [address(kit, a) for a in ORDER], address(kit, who), kit.aggregation.rule)
        assert role is not None and role.index == i
        shard_ctx = dataclasses.replace(micro_context(kit, epoch4, windows), spec=role.spec, shard=role)
        shards.append(engine(kit, shard_ctx, f"shard{i}", who, bytes([who]) * 32, exchange))
    assert slots(whole) == slots(shards[0])  # the same windows: the same honest updates in both epochs
    base = {n: p.detach().clone() for n, p in model().named_parameters()}
    cheat = kit.hosts[2].address
    for rnd in (1, 2):  # round 2's base is the round-1 fragments: the verifier reassembles it too
        honest = {h.address: replay_round(model(), INNER, windows, Assignment(SEED, slots(whole)[h.address], SLOTS),
                                          rnd, base) for h in kit.hosts}
        ups = {h: {n: t * 2 for n, t in u.items()} if h == cheat else u for h, u in honest.items()}
        close_round(kit, whole, shards, ups)
        want = [seen(c) for c in whole.store.contributions(epoch, rnd)]
        assert {w[0]: w[3] for w in want} == {h.address: h.address != cheat for h in kit.hosts}
        mismatch = next(w[4] for w in want if w[0] == cheat)
        assert len(mismatch) == 1 and mismatch[0].startswith(f"{MISMATCH}: cosine +1.0000, norm ratio 2.0000")
        assert all(w[4][0].startswith(PASSED) and w[1] != 1.0 for w in want if w[0] != cheat)  # really scored
        for s in shards:
            got = s.store.get_round(epoch4, rnd)
            assert got is not None and got.state == "finalized"
            rows = s.store.contributions(epoch4, rnd)
            if rnd == 1:  # the same base hash: the held-out windows the score reads are the same
                assert [seen(c) for c in rows] == want
            else:  # they are keyed by the base's hash on chain: the sharded root is another key
                assert [(c.reward, c.aggregated, [r for r in c.reasons if r.startswith('replay')]) for c in rows] == [
                    (w[2], w[3], [r for r in w[4] if r.startswith('replay')]) for w in want]
                root = shards[0].store.get_round(epoch4, 1)
                assert root is not None and root.checkpoint_sha256 != whole.store.get_round(epoch, 1).checkpoint_sha256
                for c in rows:
                    if c.host != cheat:
                        live = {h: u for h, u in honest.items() if h != cheat}
                        want_score = keyed_score(windows, base, live, c.host, slots(whole)[c.host], root.checkpoint_sha256)
                        assert c.score == pytest.approx(want_score, abs=1e-7)
        # What the verifier read: every shard's fragment payload of every picked (here: every) host.
        for h in kit.hosts:
            for k, fragment in enumerate(plan_fragments(ctx.spec, 2)):
                part = {n: ups[h.address][n] for n in fragment.names}
                assert exchange.blob(epoch4, rnd, k, payload_key(h.address)) == payload(part)
        base = load_checkpoint(whole.store.checkpoint_path(epoch, rnd)).tensors
    assert exchange.blob(epoch4, 1, 0, BASE_KEY) is None and exchange.blob(epoch4, 2, 1, BASE_KEY) is not None


def close_round(kit: Kit, whole: RoundEngine, shards: list[RoundEngine], ups: dict[bytes, dict[str, torch.Tensor]]) -> None:
    for h in kit.hosts:
        assert kit.submit(whole, h, payload(ups[h.address])).body.accepted
        for s in shards:
            assert kit.submit(s, h, fragment_payload(ups[h.address], s)).body.accepted
    kit.run(whole.tick())
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())


def keyed_score(
    windows: Windows, base: dict[str, torch.Tensor], live: dict[bytes, dict[str, torch.Tensor]], host: bytes,
    slot: int, base_key: bytes,
) -> float:
    """Round 2's held-out score of a live host as `close._scores` takes it (clipped to the live hosts'
    median norm, at its share of the outer step, not vetoed: replayed), the windows keyed by `base_key`."""
    scoring = ScoringData(windows, SEED, SLOTS, 4, 4)
    norms = {h: math.sqrt(sum(float(t.double().square().sum()) for t in u.values())) for h, u in live.items()}
    factor = min(1.0, statistics.median(norms.values()) / norms[host]) * score_step(0.5, len(live))
    scorer = Scorer(model(), base, scoring.heldout(2, base_key), "heldout_gain")
    delta = {n: t * torch.tensor(factor, dtype=torch.float32) for n, t in live[host].items()}
    return scorer.score(delta, scoring.assigned(2, slot), veto=False).score


def test_the_sample_is_the_replay_pick_and_blobs_cross_a_directory(kit: Kit, windows: Windows, tmp_path: Path) -> None:
    hosts = [bytes([i]) * 20 for i in range(1, 41)]
    ctx = dataclasses.replace(micro_context(kit, kit.world.epoch4, windows), replay_probability=0.25)
    picked = sampled(ctx, b"\x05" * 32, 3, hosts)
    assert picked == chosen_for_replay(0.25, b"\x05" * 32, 3, hosts) and 0 < len(picked) < len(hosts)
    assert sampled(dataclasses.replace(ctx, replay=None, scoring=None), b"\x05" * 32, 3, hosts) == set()
    on_disk = DirExchange(tmp_path / "x")
    on_disk.put_blob(4, 3, 1, payload_key(hosts[0]), b"fragment bytes")
    assert on_disk.blob(4, 3, 1, payload_key(hosts[0])) == b"fragment bytes"
    assert on_disk.blob(4, 3, 0, payload_key(hosts[0])) is None and on_disk.blob(4, 3, 1, BASE_KEY) is None


def two_shards(kit: Kit, ctx: EpochContext, exchange: ShardExchange) -> list[RoundEngine]:
    """The epoch's two shards of `ctx`'s model, meeting in `exchange`."""
    shards = []
    for i, who in enumerate(ORDER):
        role = shard_role(ctx.spec, [address(kit, a) for a in ORDER], address(kit, who), kit.aggregation.rule)
        assert role is not None
        shards.append(engine(kit, dataclasses.replace(ctx, spec=role.spec, shard=role), f"shard{i}", who,
                             bytes([who]) * 32, exchange))
    return shards


def test_hosts_not_picked_are_neither_replayed_nor_scored_and_no_payload_crosses(kit: Kit, windows: Windows) -> None:
    kit.settings = dataclasses.replace(kit.settings, max_payload_bytes=1 << 20, max_chunk_bytes=1 << 16)
    exchange, ctx = LocalExchange(), dataclasses.replace(micro_context(kit, kit.world.epoch4, windows), replay_probability=0.0)
    shards = two_shards(kit, ctx, exchange)
    gen = torch.Generator().manual_seed(5)
    ups = {h.address: {n: torch.randn(s, generator=gen) * 1e-3 for n, s in ctx.spec.items()} for h in kit.hosts}
    for h in kit.hosts:
        for s in shards:
            assert kit.submit(s, h, fragment_payload(ups[h.address], s)).body.accepted
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())
    for s in shards:
        rows = s.store.contributions(kit.world.epoch4, 1)
        assert [(c.score, c.aggregated) for c in rows] == [(1.0, True)] * 3
        assert all(NOT_SAMPLED in c.reasons and not any(r.startswith("replay") for r in c.reasons) for c in rows)
    assert all(exchange.blob(kit.world.epoch4, 1, k, payload_key(h.address)) is None for k in (0, 1) for h in kit.hosts)


class Forging(LocalExchange):
    """Shard 1 puts, for one honest host, a fragment payload the host never sent there (its own doubled);
    with `report_it`, its report also names that payload's digest and length in the host's header."""

    def __init__(self, victim: bytes, forged: bytes, report_it: bool) -> None:
        super().__init__()
        self.victim, self.forged, self.report_it = victim, forged, report_it

    def put_blob(self, epoch: int, round_: int, index: int, key: str, data: bytes) -> None:
        super().put_blob(epoch, round_, index, key, self.forged if (index, key) == (1, payload_key(self.victim)) else data)

    def put_report(self, report: FragmentReport) -> None:
        if self.report_it and report.index == 1:
            digest, size = hashlib.sha256(self.forged).digest(), len(self.forged)
            hosts = tuple(dataclasses.replace(h, signed=dataclasses.replace(h.signed, payload_sha256=digest,
                                                                              payload_length=size))
                          if h.host == self.victim and h.signed is not None else h for h in report.hosts)
            report = dataclasses.replace(report, hosts=hosts)
        super().put_report(report)


@pytest.mark.parametrize(
    ("report_it", "why"),
    [
        (False, "shard 1's payload blob of 0x{victim} ({size} bytes, sha256 {forged}…) is not the payload its "
                "report names ({size} bytes, sha256 {signed}…)"),
        (True, "the header shard 1's report names for 0x{victim}'s fragment is not signed by 0x{victim}'s node key"),
    ],
)
def test_the_verifier_refuses_a_payload_blob_the_host_did_not_sign(
    kit: Kit, windows: Windows, monkeypatch: pytest.MonkeyPatch, report_it: bool, why: str
) -> None:
    """A shard cannot make an honest host fail the replay with bytes of its own: the verifier checks
    each blob against the digest of the header the shard reports for the host, and that header against
    the host's node key. It judges nobody on a blob that fails: the round waits, saying why."""
    kit.settings = dataclasses.replace(kit.settings, max_payload_bytes=1 << 20, max_chunk_bytes=1 << 16)
    ctx = micro_context(kit, kit.world.epoch4, windows)
    victim = kit.hosts[0].address
    gen = torch.Generator().manual_seed(7)
    ups = {h.address: {n: torch.randn(s, generator=gen) * 1e-3 for n, s in ctx.spec.items()} for h in kit.hosts}
    fragment = plan_fragments(ctx.spec, 2)[1]
    sent = payload({n: ups[victim][n] for n in fragment.names})
    forged = payload({n: ups[victim][n] * 2 for n in fragment.names})
    exchange = Forging(victim, forged, report_it)
    shards = two_shards(kit, ctx, exchange)
    for h in kit.hosts:
        for s in shards:
            assert kit.submit(s, h, fragment_payload(ups[h.address], s)).body.accepted
    for _ in range(3):  # the seed revealed, the reports in: the verifier's close meets the forged blob
        for s in shards:
            kit.run(s.tick())
    failures: list[str] = []
    monkeypatch.setattr(shards[0], "_note_close_failure", lambda r, skip, exc: failures.append(str(exc)))
    kit.run(shards[0].tick())  # (the log says a failure once, then every 50: the reason of this attempt)
    assert exchange.verdict(kit.world.epoch4, 1) is None
    assert all(s.store.get_round(kit.world.epoch4, 1).state == "open" for s in shards)  # type: ignore[union-attr]
    expected = why.format(victim=victim.hex(), size=len(sent), forged=hashlib.sha256(forged).hexdigest()[:16],
                          signed=hashlib.sha256(sent).hexdigest()[:16])
    assert failures == [f"round {kit.world.epoch4}/1: {expected}: the verifier's close waits (it judges no host on "
                        "such a blob)"]
