"""The round engine around its closes, without a server (engine_kit.py): the sign-in window holding an
early close, the periodic loop, a next round whose seed commitment fails and is retried, a restart into
an open round, a stale resubmission in the next round, and a round that needs two aggregators' votes."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import sqlite3
import time
from pathlib import Path

import pytest
from agg_harness import AGGREGATOR
from engine_kit import SECOND_AGGREGATOR, Kit, payload, update
from eth_utils import to_checksum_address
from test_engine_close import row, set_state, submit_all
from test_shard_round import fragment_payload, shard_engine

from chain.backends import RpcBackend
from chain.client import ChainClient, round_result_hash
from chain.merkle import RewardTree
from chain.seed import new_secret, seed_commitment
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.engine_types import clock_text
from gonka_node.aggregator.metrics import PrometheusMetrics
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard import LocalExchange
from gonka_node.aggregator.store import ShardDecision


def unreachable(kit: Kit) -> ChainView:
    world = kit.world.chain
    return ChainView(ChainClient(RpcBackend("http://127.0.0.1:9", 2.0), world.accounts[AGGREGATOR], world.deployment))


def test_everyone_submitted_waits_for_the_signin_window_to_close(kit: Kit) -> None:
    ep = kit.epoch_in_signin()
    e = kit.engine(ep)
    submit_all(kit, e, 3)
    kit.run(e.tick())
    assert row(e).state == "open" and not e._signin_closed_seen
    kit.world.chain.backend.increase_time(31)
    kit.run(e.tick())
    assert row(e).state == "finalized" and e._signin_closed_seen
    assert kit.world.chain.client(0).round_result(ep, 1).n_contributors == 3


def test_the_members_are_read_once_per_round(kit: Kit) -> None:
    e = kit.engine()
    submit_all(kit, e, 2)
    kit.run(e.tick())
    assert e._members_of_round == (1, {h.address for h in kit.hosts})
    e._members_of_round = (1, {kit.hosts[0].address, kit.hosts[1].address})  # what a later read would see
    kit.run(e.tick())  # ... is used as cached: the two who submitted are everyone
    assert row(e).state == "finalized"
    e._members_of_round = (1, set())  # a stale entry of another round is read again
    submit_all(kit, e, 3, seed=40)
    kit.run(e.tick())
    assert row(e, 2).state == "finalized" and e._members_of_round == (2, {h.address for h in kit.hosts})


def test_the_loop_closes_rounds_and_survives_a_failing_tick(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    e = kit.engine()
    submit_all(kit, e, 3)

    async def loop_until_closed() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(e.run(stop, interval_s=0.01))
        await asyncio.wait_for(e.round_closed.wait(), 5)
        stop.set()
        await asyncio.wait_for(task, 5)

    kit.run(loop_until_closed())
    assert row(e).state == "finalized" and e.current is not None and e.current.round == 2
    submit_all(kit, e, 1, seed=50)
    e.chain = unreachable(kit)
    e._signin_closed_seen = False

    async def two_failing_ticks() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(e.run(stop, interval_s=0.01))
        async def two_failures() -> None:
            while len([r for r in caplog.records if r.message == "round tick failed"]) < 2:
                await asyncio.sleep(0.01)

        try:
            await asyncio.wait_for(two_failures(), 5)
        finally:
            stop.set()
        await asyncio.wait_for(task, 5)

    with caplog.at_level(logging.ERROR, "gonka_node.aggregator.rounds"):
        kit.run(two_failing_ticks())
    failed = [r for r in caplog.records if r.message == "round tick failed"]
    assert failed[0].exc_info is not None and row(e, 2).state == "open"


def test_a_next_round_whose_commitment_fails_is_retried_every_tick(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    e = kit.engine()
    ep = kit.world.epoch
    other_secret = new_secret()
    # This aggregator's account already committed another secret for round 2 (a lost store, say): the
    # engine's own commitment for round 2 is refused until its stored secret is that one.
    kit.world.chain.client(AGGREGATOR).commit_round_seed(ep, 2, seed_commitment(other_secret))
    submit_all(kit, e, 3)
    kit.run(e.tick())
    assert row(e).state == "finalized" and e._opening_failed == 1
    assert e.current is not None and e.current.round == 1 and e.closing  # still the closed round: LATE
    [line] = caplog.messages
    assert line.startswith(f"epoch {ep}: opening the next round (committing its seed on chain) failed 1 time(s) "
                           "(RuntimeError: round ")
    assert line.endswith("; retrying every tick")
    for _ in range(50):
        kit.run(e.tick())
    assert e._opening_failed == 51 and len(caplog.messages) == 2
    assert "failed 51 time(s)" in caplog.messages[1]
    db = sqlite3.connect(kit.tmp / "agg" / "state.sqlite3")
    with db:
        db.execute("UPDATE rounds SET seed_secret=? WHERE epoch=? AND round=2", (other_secret, ep))
    db.close()
    kit.run(e.tick())
    assert e._opening_failed == 0 and e.current == row(e, 2) and not e.closing


def test_a_restart_resumes_the_open_round_and_commits_a_missing_secret(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gonka_node.aggregator.rounds")
    e = kit.engine()
    ep = kit.world.epoch
    r1 = row(e)
    assert f"round {ep}/1 open until {clock_text(r1.deadline_ms)}" in caplog.messages
    submit_all(kit, e, 1)
    caplog.clear()
    kit.clock.ms = r1.opened_ms + 1000
    again = kit.engine()
    assert again.current == r1 and caplog.messages == []
    kit.clock.ms = r1.opened_ms + 1001
    again = kit.engine()
    assert caplog.messages == [
        f"resumed open round {ep}/1 with 1 accepted submissions (deadline {clock_text(r1.deadline_ms)})"
    ]
    # A round stored by a version that kept no secret: one is made, stored and committed on restart.
    db = sqlite3.connect(kit.tmp / "agg" / "state.sqlite3")
    with db:
        db.execute("UPDATE rounds SET seed_secret=NULL WHERE epoch=? AND round=1", (ep,))
    db.close()
    with pytest.raises(RuntimeError, match="not the commitment of its stored secret"):
        kit.engine()  # the chain has the first secret's commitment: a new one cannot replace it
    secret = row(again).seed_secret
    assert secret is not None and secret != r1.seed_secret and len(secret) == 32
    chain = kit.world.chain.client(0)
    assert chain.seed_commitment(ep, 1, kit.world.chain.accounts[AGGREGATOR].address) == seed_commitment(
        r1.seed_secret or b""
    )


def test_a_round_two_resubmission_of_round_one_work_is_excluded_and_the_close_is_timed(kit: Kit) -> None:
    e = kit.engine()
    metrics = PrometheusMetrics()
    e.metrics = metrics
    ep = kit.world.epoch
    submit_all(kit, e, 3)
    kit.run(e.tick())
    a, b, c = kit.hosts
    stale = payload(update(10))  # a's round-1 update, sent again
    assert kit.submit(e, a, stale).body.accepted
    assert kit.submit(e, b, payload(update(21))).body.accepted
    assert kit.submit(e, c, payload(update(22))).body.accepted
    kit.run(e.tick())
    rows = {x.host: x for x in e.store.contributions(ep, 2)}
    assert not rows[a.address].aggregated and rows[a.address].reasons[0].startswith(
        f"copy: sketch cosine 1.0000 with 0x{a.address.hex()}, round 1 (its own earlier submission)"
    )
    assert rows[b.address].aggregated and rows[c.address].aggregated
    assert kit.world.chain.client(0).round_result(ep, 2).n_contributors == 2
    assert metrics.registry.get_sample_value("gonka_aggregator_rounds_total", {"state": "finalized"}) == 2
    assert metrics.registry.get_sample_value("gonka_aggregator_round") == 2
    seconds = metrics.registry.get_sample_value("gonka_aggregator_close_seconds_sum")
    assert seconds is not None and 0 < seconds < 60 and e._closing_since is None


def test_another_epochs_rounds_in_the_same_store_are_not_this_epochs_models(kit: Kit) -> None:
    first = kit.engine()
    submit_all(kit, first, 3)
    kit.run(first.tick())  # the first epoch's round 1 is finalized
    e = kit.engine(kit.world.epoch2)  # the same aggregator (one store), a later epoch
    for _ in range(2):  # its round 1: nobody submits, extended once, then skipped
        kit.clock.ms = row(e).deadline_ms + 1
        kit.run(e.tick())
    assert row(e).state == "skipped"
    assert e.global_path(1) == kit.init_path and e.base_path(2) == kit.init_path
    assert row(e, 2).base_sha256 == kit.world.init_sha
    inputs = e._closing_inputs(row(e, 2), b"\x02" * 32)  # nothing carried over from the other epoch's round 1
    assert (inputs.prev_outer_state, inputs.prev_residual, inputs.earlier) == (None, None, [])


def test_a_host_that_left_is_not_paid(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 2)
    kit.world.chain.client(kit.hosts[1].index).leave(ep)
    kit.clock.ms = row(e).deadline_ms + 1
    kit.run(e.tick())
    rows = {x.host: x for x in e.store.contributions(ep, 1)}
    assert rows[kit.hosts[1].address].reasons[0] == "host is no longer signed in to the epoch (left or slashed)"
    assert [h for h, x in rows.items() if x.reward > 0] == [kit.hosts[0].address]
    assert row(e).state == "finalized" and kit.world.chain.client(0).round_result(ep, 1).n_contributors == 1


def test_a_close_that_leaves_nobody_eligible_is_a_skip_that_keeps_the_reasons(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 2)
    for h in kit.hosts[:2]:
        kit.world.chain.client(h.index).leave(ep)
    kit.clock.ms = row(e).deadline_ms + 1
    kit.run(e.tick())  # a quorum was accepted, so the round is computed, and every update is excluded
    r1 = row(e)
    assert (r1.state, r1.checkpoint_sha256, r1.rewards_root, r1.total_reward, r1.aggregation) == (
        "skipped", kit.world.init_sha, bytes(32), 0, "skipped"
    )
    rows = e.store.contributions(ep, 1)
    assert sorted((x.host, x.aggregated, x.reward) for x in rows) == sorted((h.address, False, 0) for h in kit.hosts[:2])
    assert all(x.reasons[0] == "host is no longer signed in to the epoch (left or slashed)" for x in rows)
    on_chain = kit.world.chain.client(0).round_result(ep, 1)
    assert on_chain.finalized and (on_chain.checkpoint_sha256, on_chain.n_contributors) == (kit.world.init_sha, 0)


def test_a_later_round_whose_updates_are_all_excluded_keeps_the_model_of_the_round_before(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 3)
    kit.run(e.tick())
    r1 = row(e)
    assert r1.state == "finalized" and r1.checkpoint_sha256 != kit.world.init_sha
    submit_all(kit, e, 3)  # round 1's updates again: every one a copy of its own earlier submission
    kit.run(e.tick())
    r2 = row(e, 2)
    assert (r2.state, r2.checkpoint_sha256, r2.total_reward) == ("skipped", r1.checkpoint_sha256, 0)
    assert all(not x.aggregated and x.reasons[0].startswith("copy:") for x in e.store.contributions(ep, 2))


def test_the_hosts_records_are_read_ahead_once_per_round_not_every_tick(kit: Kit, monkeypatch: pytest.MonkeyPatch) -> None:
    e = kit.engine(start=False)
    warmed: list[int] = []
    real = e.chain.warm_now
    monkeypatch.setattr(e.chain, "warm_now", lambda epoch: warmed.append(epoch) or real(epoch))
    e.start()  # the opening reads them
    for _ in range(3):  # nobody submits: the round stays open
        kit.clock.ms += 100
        kit.run(e.tick())
    assert warmed == [kit.world.epoch] and row(e).state == "open"


def test_with_two_votes_needed_a_restart_does_not_vote_twice(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    ep = kit.world.epoch4
    e = kit.engine(ep)
    submit_all(kit, e, 3)
    kit.run(e.tick())
    r1 = row(e)
    assert r1.state == "finalized" and r1.finalize_tx and len(r1.finalize_tx) == 32  # voted, not yet final
    chain = kit.world.chain.client(0)
    assert not chain.round_result(ep, 1).finalized
    share = r1.total_reward // 3 if r1.total_reward else 0
    assert r1.checkpoint_sha256 and r1.rewards_root and share > 0
    mine = round_result_hash(r1.checkpoint_sha256, r1.rewards_root, 3, r1.total_reward or 0)
    me = kit.world.chain.accounts[AGGREGATOR].address
    assert chain.round_vote(ep, 1, me) == mine
    set_state(kit, ep, 1, "finalizing")
    caplog.clear()
    again = kit.engine(ep)
    assert row(again).state == "finalized" and row(again).finalize_tx == b""
    assert caplog.messages == [
        f"round {ep}/1: this aggregator already voted for the recorded result ({mine.hex()[:16]}…) before a restart; "
        "not voting again, the round finalizes when the other aggregators' votes reach the quorum"
    ]
    assert chain.round_vote(ep, 1, kit.world.chain.accounts[SECOND_AGGREGATOR].address) == bytes(32)
    set_state(kit, ep, 1, "finalizing", checkpoint=b"\x06" * 32)
    other = round_result_hash(b"\x06" * 32, r1.rewards_root, 3, r1.total_reward or 0)
    with pytest.raises(RuntimeError) as info:
        kit.engine(ep)
    assert str(info.value) == (
        f"round {ep}/1: this aggregator's vote on chain {mine.hex()} is not the recorded intent's result {other.hex()}"
    )


def test_an_engine_is_its_signers_key(kit: Kit) -> None:
    e: RoundEngine = kit.engine(start=False)
    assert e.aggregator_key == bytes(e.signer.verify_key) and len(e.aggregator_key) == 32
    assert e.current is None and not e.closing and e._opening_failed == 0


def test_a_retried_close_finishes_the_recorded_intent_and_never_recomputes_it(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 3)
    # An earlier attempt revealed the seed, recorded its intent (here: a skip) and failed before the
    # chain heard of it.
    secret = row(e).seed_secret
    assert secret is not None
    e.chain.reveal_seed(ep, 1, secret)
    e.store.record_finalize_intent(ep, 1, "skipping", kit.world.init_sha, bytes(32), 0, "skipped", [])
    kit.run(e.close(skip=False))
    r1 = row(e)
    assert (r1.state, r1.checkpoint_sha256, r1.total_reward) == ("skipped", kit.world.init_sha, 0)
    assert kit.world.chain.client(0).round_result(ep, 1).checkpoint_sha256 == kit.world.init_sha


def test_a_retried_close_finishes_a_recorded_finalizing_intent_as_recorded(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 3)
    secret = row(e).seed_secret
    assert secret is not None
    e.chain.reveal_seed(ep, 1, secret)
    recorded = b"\x07" * 32  # not what a recomputation gives: the intent is sent as it is
    e.store.record_finalize_intent(ep, 1, "finalizing", recorded, bytes(32), 0, "mean", [])
    kit.run(e.close(skip=False))
    assert (row(e).state, row(e).checkpoint_sha256) == ("finalized", recorded)
    assert kit.world.chain.client(0).round_result(ep, 1).checkpoint_sha256 == recorded


def test_the_reward_tree_holds_the_paid_hosts_only_down_to_one_ngonka(kit: Kit) -> None:
    e = kit.engine()
    e.ctx = dataclasses.replace(e.ctx, reward_per_round=3)  # one ngonka each
    ep = kit.world.epoch
    a, b, c = kit.hosts
    assert kit.submit(e, a, payload(update(1))).body.accepted
    assert kit.submit(e, b, payload(update(2))).body.accepted
    zero = payload({n: t * 0 for n, t in update(3).items()})  # excluded: paid nothing
    assert kit.submit(e, c, zero).body.accepted
    kit.run(e.tick())
    r1 = row(e)
    assert [(x.host, x.reward) for x in e.store.contributions(ep, 1)] == sorted(
        [(a.address, 1), (b.address, 1), (c.address, 0)]
    )
    assert kit.world.chain.client(0).round_result(ep, 1).n_contributors == 2  # paid 1 ngonka: counted
    tree = e.reward_tree(1)
    assert tree is not None and tree.root == r1.rewards_root
    assert tree.root == RewardTree(e.ctx.chain_id, to_checksum_address(e.ctx.registry), ep, 1,
                                   [(to_checksum_address(h.address), 1) for h in (a, b)]).root


def test_the_signin_window_is_closed_from_its_end_time_on(kit: Kit) -> None:
    ep = kit.epoch_in_signin()
    e = kit.engine(ep)
    backend = kit.world.chain.backend
    end = kit.world.chain.client(0).get_epoch(ep).signin_end
    with backend.lock:
        backend.tester.time_travel(end - 1)
        backend.tester.mine_blocks(1)
    assert kit.world.chain.client(0).chain_time() == end - 1
    assert not kit.run(e._signin_closed(ep))
    with backend.lock:
        backend.tester.time_travel(end)
        backend.tester.mine_blocks(1)
    assert kit.world.chain.client(0).chain_time() == end
    assert kit.run(e._signin_closed(ep)) and e._signin_closed_seen


def test_the_loop_ticks_every_fifth_of_a_second_by_default(kit: Kit) -> None:
    e = kit.engine()
    ticked: list[float] = []
    stop = asyncio.Event()
    real_tick = e.tick

    async def timed_tick() -> None:  # the real tick, its start time recorded
        ticked.append(time.monotonic())
        if len(ticked) == 3:
            stop.set()
        await real_tick()

    e.tick = timed_tick  # type: ignore[method-assign]
    kit.run(e.run(stop))
    gaps = [b - a for a, b in itertools.pairwise(ticked)]
    # 0.2 s apart, not 1 s or more (one gap may stretch on a loaded machine; both would at 1 s)
    assert len(gaps) == 2 and all(g > 0.19 for g in gaps) and min(gaps) < 0.9, gaps
    assert row(e).state == "open"


def test_a_close_reads_its_own_epochs_earlier_rounds_and_the_seed_it_is_given(kit: Kit) -> None:
    other = kit.engine()
    submit_all(kit, other, 3)
    kit.run(other.tick())  # another epoch's round 1 in the same store: not this epoch's history
    e = kit.engine(kit.world.epoch2)
    for seed in (10, 20):
        submit_all(kit, e, 3, seed=seed)
        kit.run(e.tick())
    assert (row(e, 1).state, row(e, 2).state, row(e, 3).state) == ("finalized", "finalized", "open")
    submit_all(kit, e, 1, seed=30)  # round 3's own submission is not "earlier"
    inputs = e._closing_inputs(row(e, 3), b"\x07" * 32)
    assert inputs.seed == b"\x07" * 32 and inputs.round_row.round == 3
    assert [s.host for s in inputs.submissions] == [kit.hosts[0].address]
    hosts = sorted(h.address for h in kit.hosts)
    assert sorted((s.epoch, s.round, s.host) for s in inputs.earlier) == [
        (kit.world.epoch2, r, h) for r in (1, 2) for h in hosts
    ]
    assert inputs.step_base == (e.global_path(2), e.global_sha256(2)) and inputs.base_path == e.base_path(3)
    assert inputs.eager is None and inputs.prev_outer_state == e.store.outer_state_path(kit.world.epoch2, 2)


def test_an_eager_close_rebuilds_bases_from_the_last_rounds_payloads_and_the_momentum_before_it(kit: Kit) -> None:
    e = kit.engine(start=False)
    e.ctx = dataclasses.replace(e.ctx, overlap="eager", outer_momentum=0.9)  # unlike outer_lr = 0.5
    e.start()
    ep = kit.world.epoch
    submit_all(kit, e, 3)
    kit.run(e.tick())
    first = e._closing_inputs(row(e, 2), b"\x01" * 32).eager
    assert first is not None and first.outer_state is None  # no round before round 1: fresh momentum
    assert first.previous == {s.host: Path(s.path) for s in e.store.submissions(ep, 1)} and len(first.previous) == 3
    submit_all(kit, e, 2, seed=20)
    kit.clock.ms = row(e, 2).deadline_ms + 1  # two of three: closed at the deadline
    kit.run(e.tick())
    assert row(e, 2).state == "finalized"
    eager = e._closing_inputs(row(e, 3), b"\x01" * 32).eager
    assert eager is not None
    assert eager.previous == {s.host: Path(s.path) for s in e.store.submissions(ep, 2)} and len(eager.previous) == 2
    assert eager.outer_state == e.store.outer_state_path(ep, 1)  # the momentum after round r − 2
    assert (eager.outer_lr, eager.outer_momentum, dict(eager.spec)) == (e.ctx.outer_lr, e.ctx.outer_momentum, dict(e.ctx.spec))
    assert eager.codec.name == e.ctx.codec_for(2).name


def test_a_shard_keeps_its_close_decision_before_the_seed_and_restarted_takes_no_upload(kit: Kit) -> None:
    """Shard 1 closes (a skip: below quorum) before shard 0 revealed its seed: the close waits on the
    seed, but what its one report covers is already kept with the round, before any seed could sway it.
    Restarted, the shard is closed for uploads: it closes as it decided."""
    exchange = LocalExchange()
    shards = [shard_engine(kit, i, exchange) for i in range(2)]  # both commit their seeds
    s = shards[1]
    assert kit.submit(s, kit.hosts[0], fragment_payload(update(90), s)).body.accepted
    kit.clock.ms += 11_000  # past the deadline
    kit.run(s.close(skip=True))
    got = s.store.get_round(kit.world.epoch4, 1)
    assert got is not None and (got.state, got.round_seed) == ("open", None)  # shard 0 has not revealed
    assert ShardDecision.of(got) == ShardDecision(True, (kit.hosts[0].address,))
    s.store.close()
    s = shard_engine(kit, 1, exchange)  # restarted
    assert s.closing and s.closed_for_submissions.is_set()
    with pytest.raises(Rejected) as late:
        kit.submit(s, kit.hosts[1], fragment_payload(update(91), s))
    assert late.value.reason == Reason.LATE
