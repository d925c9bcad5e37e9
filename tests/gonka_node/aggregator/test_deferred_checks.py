"""Receipts before the checks (aggregator/deferred.py): a payload is receipted once hashed and stored,
its decode-time checks drained by a bounded pool. A kill between the receipt and the checks loses
nothing, a payload that fails a check is excluded from the aggregate and the rewards, the close waits
for pending checks, and the pool never decodes more payloads at once than it has slots.
(engine_kit.py: a real store, checkpoints and embedded chain; the engine's clock held by the test.)"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_kit import REWARD, Kit, chunks, payload, update
from eth_utils import to_checksum_address
from test_engine_close import row, stepped, submit_all
from test_shard_round import fragment_payload, shard_engine

from gonka_node.aggregator import validate
from gonka_node.aggregator.deferred import CHECK_NICE, CheckPool
from gonka_node.aggregator.engine_types import SignedReceipt
from gonka_node.aggregator.metrics import PrometheusMetrics
from gonka_node.aggregator.reasons import Reason
from gonka_node.aggregator.rounds import DECODE_SLOTS, RoundEngine
from gonka_node.aggregator.shard import LocalExchange
from gonka_node.aggregator.store import SubmissionRow
from gonka_node.aggregator.validate import count_sketch
from gonka_node.slashing import KIND_GARBAGE
from training.checkpoint import load_checkpoint

HUGE = payload({"b": torch.full((3,), 9.0), "w": torch.zeros(2, 4)})  # norm 15.6 > the kit's bound 10


def receipted(kit: Kit, e: RoundEngine, i: int, data: bytes) -> SignedReceipt:
    """Submit without waiting for the checks (what a host sees: the receipt)."""
    h = kit.hosts[i]
    sub = kit.header(e, h, data)
    return kit.run(e.submit(sub, sub.sign(h.key), chunks(data), e.stream_guard("test")))


def gated(e: RoundEngine, gate: threading.Event) -> CheckPool:
    """The engine's own checks, each held until `gate` opens (a backlog the test controls)."""

    def check(row: SubmissionRow) -> None:
        assert gate.wait(30), "the test never opened the gate"
        e._check_stored(row)

    return CheckPool(2, check)


def never_checked(row: SubmissionRow) -> None:
    """The process dies after the receipt and before the checks: nothing of them is recorded."""


def test_a_receipt_then_a_kill_before_the_checks_loses_nothing(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    e.checks = CheckPool(1, never_checked)
    ups = [update(20 + i) for i in range(3)]
    receipts = [receipted(kit, e, i, payload(u)) for i, u in enumerate(ups)]
    assert all(r.body.accepted for r in receipts)
    pending = e.store.pending_submissions(ep)
    assert [(s.host, s.check_state) for s in pending] == sorted((h.address, "pending") for h in kit.hosts)
    assert e.store.submissions(ep, 1) == []  # nothing counts before its checks
    e.store.close()  # killed

    again = kit.engine()  # restarted on the same store: the payloads and rows are there
    kit.clock.ms += 100
    kit.run(again.tick())  # resumes the checks, waits for them, then everyone has submitted: closes
    r1 = again.store.get_round(ep, 1)
    assert r1 is not None and r1.state == "finalized"
    by_host = {s.host: s for s in again.store.submissions(ep, 1)}
    for h, u in zip(kit.hosts, ups, strict=True):
        assert by_host[h.address].sketch == count_sketch(u).numpy().tobytes()
        assert by_host[h.address].norm == pytest.approx(float(torch.cat([t.flatten() for t in u.values()]).norm()))
    share = REWARD // 3
    assert [(c.host, c.reward, c.aggregated) for c in again.store.contributions(ep, 1)] == sorted(
        (h.address, share, True) for h in kit.hosts
    )
    ckpt = load_checkpoint(again.store.checkpoint_path(ep, 1), expected_sha256=r1.checkpoint_sha256.hex())
    want, _ = stepped(load_checkpoint(kit.init_path).tensors, ups, None)
    for n, t in want.items():
        torch.testing.assert_close(ckpt.tensors[n], t, rtol=0, atol=1e-7)


def test_a_payload_that_fails_a_deferred_check_is_excluded_from_the_aggregate_and_the_rewards(kit: Kit) -> None:
    e = kit.engine()
    e.metrics = metrics = PrometheusMetrics()
    ep = kit.world.epoch
    ups = [update(30), update(31)]
    for i, u in enumerate(ups):
        assert receipted(kit, e, i, payload(u)).body.accepted
    cheat = kit.hosts[2]
    assert receipted(kit, e, 2, HUGE).body.accepted  # received: its norm is not known yet
    kit.clock.ms = e.current.deadline_ms + 1 if e.current else 0  # quorum 2 at the deadline
    kit.run(e.tick())
    r1 = e.store.get_round(ep, 1)
    assert r1 is not None and r1.state == "finalized"
    failed = e.store.submission(ep, 1, cheat.address)
    assert failed is not None and (failed.check_state, failed.check_reason) == ("failed", Reason.NORM_TOO_LARGE.value)
    assert failed.check_message == "update L2 norm 15.59 exceeds the epoch's bound 10"
    share = REWARD // 2
    assert [(c.host, c.reward, c.aggregated) for c in e.store.contributions(ep, 1)] == sorted(
        (h.address, share, True) for h in kit.hosts[:2]
    )
    on_chain = kit.world.chain.client(0).round_result(ep, 1)
    assert (on_chain.n_contributors, on_chain.total_reward) == (2, 2 * share)
    ckpt = load_checkpoint(e.store.checkpoint_path(ep, 1), expected_sha256=r1.checkpoint_sha256.hex())
    want, _ = stepped(load_checkpoint(kit.init_path).tensors, ups, None)  # the two honest updates only
    for n, t in want.items():
        torch.testing.assert_close(ckpt.tensors[n], t, rtol=0, atol=1e-7)
    [ev] = kit.evidence.records()  # the same evidence as a refusal at upload kept
    assert (ev.kind, ev.host, ev.detail) == (
        KIND_GARBAGE, to_checksum_address(cheat.address), f"NORM_TOO_LARGE: {failed.check_message}")
    assert (kit.evidence.root / ev.payload_file).read_bytes() == HUGE
    # the operator's count of uploads by outcome has the decode-time reason (docs: aggregator/metrics.py)
    assert metrics.registry.get_sample_value("gonka_aggregator_submissions_total", {"outcome": "NORM_TOO_LARGE"}) == 1


def test_the_close_waits_for_every_pending_check(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    gate = threading.Event()
    e.checks = gated(e, gate)
    ups = [update(40 + i) for i in range(3)]
    for i, u in enumerate(ups):
        assert receipted(kit, e, i, payload(u)).body.accepted
    kit.clock.ms = e.current.deadline_ms + 1 if e.current else 0
    with pytest.raises(TimeoutError):
        kit.run(e.close(skip=False), timeout_s=0.5)  # the checks are held: the close cannot read the round
    r1 = e.store.get_round(ep, 1)
    assert r1 is not None and r1.state == "open" and e.store.contributions(ep, 1) == []
    assert e.closing  # no upload joins the round any more while its checks finish
    gate.set()
    kit.run(e.close(skip=False))
    r1 = e.store.get_round(ep, 1)
    assert r1 is not None and r1.state == "finalized"
    assert [(c.host, c.aggregated) for c in e.store.contributions(ep, 1)] == sorted((h.address, True) for h in kit.hosts)


def test_the_pool_never_decodes_more_payloads_at_once_than_its_slots() -> None:
    gate, seen = threading.Event(), []

    def check(row: SubmissionRow) -> None:
        assert gate.wait(30)
        seen.append(row.host)

    rows = [SubmissionRow(1, 1, bytes([i]) * 20, bytes(32), 1, 0, 0, b"", 0, 0.0, b"", "") for i in range(7)]

    async def scenario() -> tuple[int, int, int, bool]:
        pool = CheckPool(3, check)
        assert all(pool.schedule(r) for r in rows) and not pool.schedule(rows[0])  # queued once
        deadline = time.monotonic() + 10
        while pool.running < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # time for a fourth to start, were the bound broken
        running, queued = pool.running, pool.pending(1, 1)
        gate.set()
        await pool.drain(1, 1)
        pool.close()
        return running, queued, pool.peak, pool.pending(1, 1) == 0

    running, queued, peak, drained = asyncio.run(scenario())
    assert (running, queued, peak, drained) == (3, 7, 3, True)
    assert sorted(seen) == sorted(r.host for r in rows)


def started_counting_reads(kit: Kit, monkeypatch: pytest.MonkeyPatch, fail_first: bool) -> tuple[RoundEngine, list[str]]:
    """An engine started with every chain read of a host's record counted (the first one failing, as a
    restarting node would, with `fail_first`)."""
    e = kit.engine(start=False)
    chain = e.chain.chain
    asked: list[str] = []
    real = chain.host_info

    def counted(epoch: int, host: str) -> Any:
        asked.append(host)
        if fail_first and len(asked) == 1:
            raise ConnectionError("the node is restarting")
        return real(epoch, host)

    monkeypatch.setattr(chain, "host_info", counted)
    e.start()  # opens round 1
    assert e.current is not None and e.current.round == 1  # the round opens all the same
    return e, asked


def test_a_round_reads_every_hosts_record_once_before_it_takes_uploads(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    e, asked = started_counting_reads(kit, monkeypatch, fail_first=False)
    assert sorted(asked) == sorted(to_checksum_address(h.address) for h in kit.hosts)  # before any upload
    kit.run(e.tick())  # the first tick reads nothing again
    for i in range(2):
        assert receipted(kit, e, i, payload(update(50 + i))).body.accepted
    assert len(asked) == 3  # the uploads authenticated from the cache: no chain read of their own


def test_a_round_whose_opening_could_not_read_the_records_reads_them_at_its_first_tick(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    e, asked = started_counting_reads(kit, monkeypatch, fail_first=True)
    kit.run(e.tick())
    assert len(asked) == 1 + 3
    assert receipted(kit, e, 0, payload(update(60))).body.accepted
    assert len(asked) == 4


def test_a_payload_the_aggregator_cannot_check_is_dropped_not_held_forever(kit: Kit) -> None:
    """A stored payload whose checks fail for a reason of the aggregator's (its file gone after a crash
    between removing a failed payload and recording the verdict, a disk error) does not keep the round
    from closing: it is dropped as UNAVAILABLE (never slashable: no evidence), and the host may resend."""
    e = kit.engine()
    ep = kit.world.epoch
    e.checks = CheckPool(1, never_checked)
    ups = [update(40 + i) for i in range(3)]
    assert all(receipted(kit, e, i, payload(u)).body.accepted for i, u in enumerate(ups))
    gone, flaky = kit.hosts[0].address, kit.hosts[1].address
    e.store.payload_path(ep, 1, gone).unlink()
    e.store.close()

    again = kit.engine()
    original = again._check
    tries: list[bytes] = []

    def check(part: Path, round_: int) -> tuple[float, bytes]:
        if part.name.startswith(flaky.hex()):
            tries.append(flaky)
            raise OSError("disk error")
        return original(part, round_)

    again._check = check  # type: ignore[method-assign]
    again.metrics = metrics = PrometheusMetrics()
    for _ in range(4):  # each tick queues the pending checks again and waits for them
        kit.clock.ms += 100
        kit.run(again.tick())
    assert len(tries) == 3  # tried CHECK_TRIES times, then dropped
    for host in (gone, flaky):
        row = again.store.submission(ep, 1, host)
        assert row is not None and (row.check_state, row.check_reason) == ("failed", Reason.UNAVAILABLE.value)
        assert "could not check this payload (" in (row.check_message or "")
    flaky_row = again.store.submission(ep, 1, flaky)
    assert flaky_row is not None and "could not check this payload (OSError); send it again" in flaky_row.check_message
    assert [s.host for s in again.store.submissions(ep, 1)] == [kit.hosts[2].address]
    assert not [p for p in (kit.tmp / "evidence").rglob("*") if p.is_file()]  # ours, not the host's: no evidence
    assert metrics.registry.get_sample_value("gonka_aggregator_submissions_total", {"outcome": "UNAVAILABLE"}) == 2


def unchecked_then_restarted(kit: Kit, seed: int) -> RoundEngine:
    """Three payloads receipted, the process killed before their checks ran, the engine started again."""
    e = kit.engine()
    e.checks = CheckPool(1, never_checked)
    for i in range(3):
        assert receipted(kit, e, i, payload(update(seed + i))).body.accepted
    e.store.close()
    return kit.engine()


def flaky_checks(e: RoundEngine, host: bytes, failures: int) -> None:
    """The engine's checks, with `host`'s first `failures` tries failing for a reason of the aggregator's."""
    original, left = e._check, [OSError("disk error")] * failures

    def check(part: Path, round_: int) -> tuple[float, bytes]:
        if part.name.startswith(host.hex()) and left:
            raise left.pop()
        return original(part, round_)

    e._check = check  # type: ignore[method-assign]


def test_a_payload_whose_check_awaits_a_retry_keeps_the_round_open_not_closing(kit: Kit) -> None:
    """Everyone has a payload stored, but one's check failed for a reason of the aggregator's and waits
    for its retry: the round is not "everyone submitted" yet, so it neither closes nor starts closing
    (which would refuse every resend as late); the next tick's retry passes and the round closes."""
    ep, flaky = kit.world.epoch, kit.hosts[1].address
    again = unchecked_then_restarted(kit, 60)
    flaky_checks(again, flaky, 1)
    kit.clock.ms += 100
    kit.run(again.tick())
    pending = again.store.submission(ep, 1, flaky)
    assert pending is not None and pending.check_state == "pending" and not again.closing
    assert again.store.get_round(ep, 1) == again.current and again.current.state == "open"
    kit.clock.ms += 100
    kit.run(again.tick())
    closed = again.store.get_round(ep, 1)
    assert closed is not None and closed.state == "finalized"


def test_a_close_that_finds_a_check_awaiting_its_retry_waits_and_finishes_at_the_next_tick(kit: Kit) -> None:
    ep = kit.world.epoch
    again = unchecked_then_restarted(kit, 70)
    flaky_checks(again, kit.hosts[1].address, 2)  # fails in the tick's drain and in the close's: passes next
    kit.clock.ms = row(again).deadline_ms + 1  # the deadline passed with a quorum checked: the round closes
    kit.run(again.tick())
    assert again.closing and again._close_failed is False and row(again).state == "open"  # waiting, not skipped
    kit.run(again.tick())
    assert row(again).state == "finalized"
    assert sorted(x.host for x in again.store.contributions(ep, 1) if x.reward > 0) == sorted(h.address for h in kit.hosts)


def test_another_epochs_unchecked_payload_does_not_hold_this_epochs_close(kit: Kit) -> None:
    other = kit.engine(kit.world.epoch2)  # the same store
    other.checks = CheckPool(1, never_checked)
    assert receipted(kit, other, 0, payload(update(80))).body.accepted  # its round 1: unchecked for good
    e = kit.engine()
    submit_all(kit, e, 3)
    kit.run(e.tick())
    assert row(e).state == "finalized"
    theirs = e.store.submission(kit.world.epoch2, 1, kit.hosts[0].address)
    assert theirs is not None and theirs.check_state == "pending"  # this epoch's engine checks only its own


def test_checks_run_on_named_threads_below_the_transport_and_are_counted_out_when_done() -> None:
    """The decode-time checks yield a shared core to the threads that move bytes (nice + CHECK_NICE),
    run on threads named for them, and `running` falls back to 0 once they are done."""
    seen: list[tuple[str, int]] = []
    ours = os.getpriority(os.PRIO_PROCESS, 0)

    def check(row: SubmissionRow) -> None:
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    rows = [SubmissionRow(1, 1, bytes([i]) * 20, bytes(32), 1, 0, 0, b"", 0, 0.0, b"", "") for i in range(3)]

    async def scenario() -> int:
        pool = CheckPool(2, check)
        for r in rows:
            pool.schedule(r)
        await pool.drain(1, 1)
        pool.close()
        return pool.running

    assert asyncio.run(scenario()) == 0
    assert len(seen) == 3
    assert all(name.startswith("check_") and nice == min(ours + CHECK_NICE, 19) for name, nice in seen)


def pool_rows(n: int) -> list[SubmissionRow]:
    return [SubmissionRow(1, 1, bytes([i]) * 20, bytes(32), 1, 0, 0, b"", 0, 0.0, b"", "") for i in range(n)]


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the checks never got there"
        await asyncio.sleep(0.01)


def test_drain_waits_for_the_last_check_of_a_round_when_another_ended_first() -> None:
    """Two checks of a round: the second still runs when the first ends, so the round has one pending
    and `drain` (what the close waits on) returns only once the second has recorded its verdict."""
    gates = [threading.Event(), threading.Event()]
    seen: list[bytes] = []

    def check(row: SubmissionRow) -> None:
        assert gates[row.host[0]].wait(30)
        seen.append(row.host)

    async def scenario() -> tuple[int, bool, list[bytes]]:
        pool = CheckPool(2, check)
        for r in pool_rows(2):
            pool.schedule(r)
        await until(lambda: pool.running == 2)
        gates[0].set()
        await until(lambda: pool.running == 1)
        await until(lambda: pool.pending(1, 1) < 2)  # the first one's completion reaches the loop
        pending = pool.pending(1, 1)
        drain = asyncio.ensure_future(pool.drain(1, 1))
        await asyncio.sleep(0.2)
        drained_early = drain.done()
        gates[1].set()
        await asyncio.wait_for(drain, 10)
        pool.close()
        return pending, drained_early, list(seen)

    assert asyncio.run(scenario()) == (1, False, [bytes([0]) * 20, bytes([1]) * 20])


def test_closing_the_pool_drops_the_queued_checks_and_waits_for_the_running_one() -> None:
    """At shutdown the queued checks are dropped (their rows stay pending for a restart) and the one
    running finishes before `close` returns (the store it writes to is closed after)."""
    gate, seen = threading.Event(), []

    def check(row: SubmissionRow) -> None:
        assert gate.wait(30)
        seen.append(row.host)

    async def scenario() -> tuple[bool, list[bytes]]:
        pool = CheckPool(1, check)
        for r in pool_rows(3):
            pool.schedule(r)
        await until(lambda: pool.running == 1)
        closer = threading.Thread(target=pool.close)
        closer.start()
        await asyncio.sleep(0.2)
        returned_early = not closer.is_alive()
        gate.set()
        closer.join(10)
        return returned_early, list(seen)

    assert asyncio.run(scenario()) == (False, [bytes([0]) * 20])


def test_a_check_that_fails_for_the_aggregator_is_logged_with_its_host_and_a_passing_one_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def check(row: SubmissionRow) -> None:
        if row.host[0] == 1:
            raise OSError("disk full")

    async def scenario() -> None:
        pool = CheckPool(2, check)
        for r in pool_rows(3):
            pool.schedule(r)
        await pool.drain(1, 1)
        pool.close()

    with caplog.at_level(logging.ERROR, logger="gonka_node.aggregator.deferred"):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.name == "gonka_node.aggregator.deferred"] == [
        f"checking the payload of 0x{'01' * 20} in round 1/1 failed: OSError('disk full')"
    ]


def test_a_prepared_job_runs_before_the_checks_scheduled_after_it_and_its_failure_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    order: list[str] = []

    def warm() -> None:
        time.sleep(0.1)  # were the check not queued behind it, it would go first
        order.append("warm")
        raise OSError("no memory")

    async def scenario() -> None:
        pool = CheckPool(1, lambda row: order.append(row.host.hex()))
        pool.prepare(warm, "warming up")
        pool.schedule(pool_rows(1)[0])
        await pool.drain(1, 1)
        pool.close()

    with caplog.at_level(logging.ERROR, logger="gonka_node.aggregator.deferred"):
        asyncio.run(scenario())
    assert order == ["warm", "00" * 20]
    assert [r.getMessage() for r in caplog.records if r.name == "gonka_node.aggregator.deferred"] == [
        "warming up failed (the checks will do it themselves): OSError('no memory')"
    ]


def test_the_engine_computes_the_sketchs_hash_tables_before_the_first_upload(kit: Kit) -> None:
    validate._sketch_hash.cache_clear()
    e = kit.engine()
    assert e.sketch_tables.result(timeout=30) == sum(math.prod(s) for s in e.ctx.spec.values())
    assert validate._sketch_hash.cache_info().currsize == len(e.ctx.spec)


@pytest.mark.parametrize("refusal", ["OSError", "AttributeError"])
def test_checks_still_run_where_a_threads_priority_cannot_be_lowered(
    refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the OS refuses a thread its own nice value (an unprivileged container, a platform whose
    thread ids are no process ids) or has no `setpriority` (Windows), the checks run at the normal one."""
    if refusal == "OSError":

        def refuse(which: int, who: int, prio: int) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "setpriority", refuse)
    else:
        monkeypatch.delattr(os, "setpriority")
    seen: list[bytes] = []

    async def scenario() -> None:
        pool = CheckPool(2, lambda row: seen.append(row.host))
        for r in pool_rows(2):
            pool.schedule(r)
        await pool.drain(1, 1)
        pool.close()

    asyncio.run(scenario())
    assert sorted(seen) == [bytes([0]) * 20, bytes([1]) * 20]


def test_each_shard_sketches_its_fragment_where_it_sits_in_the_whole_update(kit: Kit) -> None:
    """A shard's deferred check sketches its fragment at the fragment's coordinates in the whole
    update, so the shards' sketches of a host's fragments sum to the sketch of its whole update (what
    the copy check compares across hosts)."""
    exchange = LocalExchange()
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    u, host = update(90), kit.hosts[0]
    whole = count_sketch(u)
    parts = []
    for s in shards:
        assert kit.submit(s, host, fragment_payload(u, s)).body.accepted
        stored = s.store.submission(kit.world.epoch4, 1, host.address)
        assert stored is not None and stored.check_state == "checked"
        parts.append(torch.frombuffer(bytearray(stored.sketch), dtype=whole.dtype))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-7)


def test_the_engine_decodes_at_most_its_decode_slots_payloads_at_once(kit: Kit) -> None:
    """The engine's own pool bounds the payloads held decoded at once (memory: slots × a tensor),
    whatever the backlog of stored payloads waiting for their checks."""
    e = kit.engine()
    gate = threading.Event()

    def check(part: Path, round_: int) -> tuple[float, bytes]:
        assert gate.wait(30)
        return 0.0, b""

    e._check = check  # type: ignore[method-assign]
    backlog = [SubmissionRow(kit.world.epoch, 1, bytes([i]) * 20, bytes(32), 1, 0, 0, b"", 0, 0.0, b"",
                             str(kit.tmp / f"p{i}"), "") for i in range(DECODE_SLOTS + 2)]

    async def scenario() -> tuple[int, int]:
        for r in backlog:
            e.checks.schedule(r)
        await until(lambda: e.checks.running == DECODE_SLOTS)
        await asyncio.sleep(0.2)  # time for one more to start, were the bound broken
        running = e.checks.running
        gate.set()
        await e.checks.drain(kit.world.epoch, 1)
        return running, e.checks.peak

    assert kit.run(scenario()) == (DECODE_SLOTS, DECODE_SLOTS)
