"""The round engine's close rule and its close, without a server (engine_kit.py): everyone submitted,
the deadline with and without quorum, extension then skip, a close that fails and is retried, and a
restart that finds its intent on disk. Each close here is a real one: checks, the outer step, the new
checkpoint, the Merkle root, and the embedded chain's finalize."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import time

import pytest
import torch
from agg_harness import AGGREGATOR
from engine_kit import N_ROUNDS, REWARD, SECOND_AGGREGATOR, SPEC, Kit, chunks, payload, update
from eth_utils import to_checksum_address
from micro_model import micro_windows
from safetensors.torch import load_file
from test_openings import TopkHost, by_host, honest, slots, start, state, topk_context

from chain.merkle import RewardTree
from chain.seed import new_secret, seed_commitment
from gonka_node.aggregator.broadcast import residual_path
from gonka_node.aggregator.challenges import deadline_ms
from gonka_node.aggregator.engine_types import clock_text
from gonka_node.aggregator.metrics import PrometheusMetrics, RoundMetrics
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.replay import PASSED
from gonka_node.aggregator.rounds import RoundEngine, _tx_bytes
from gonka_node.aggregator.store import ContributionRow, RoundRow
from gonka_node.core.envelope import Submission
from training.checkpoint import load_checkpoint
from training.codecs import get_codec, round_seed
from training.residual_commit import commitment_layout


def submit_all(kit: Kit, e: RoundEngine, n: int, seed: int = 10) -> list[dict[str, torch.Tensor]]:
    ups = [update(seed + i) for i in range(n)]
    for h, u in zip(kit.hosts, ups, strict=False):
        assert kit.submit(e, h, payload(u)).body.accepted
    return ups


def row(e: RoundEngine, round_: int = 1) -> RoundRow:
    got = e.store.get_round(e.ctx.epoch, round_)
    assert got is not None
    return got


def stepped(base: dict[str, torch.Tensor], ups: list[dict[str, torch.Tensor]], buf: dict[str, torch.Tensor] | None
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The outer step the kit's epoch prescribes (mean rule, lr 0.5, Nesterov momentum 0.5)."""
    mean = {n: torch.stack([u[n] for u in ups]).mean(0) for n in base}
    new_buf = {n: mean[n] if buf is None else 0.5 * buf[n] + mean[n] for n in base}
    return {n: base[n] - 0.5 * (mean[n] + 0.5 * new_buf[n]) for n in base}, new_buf


def test_everyone_submitted_closes_before_the_deadline_and_opens_the_next_round(kit: Kit) -> None:
    e = kit.engine()
    e.metrics = PrometheusMetrics()
    ep = kit.world.epoch
    closed, for_submissions = e.round_closed, e.closed_for_submissions
    ups = submit_all(kit, e, 3)
    kit.clock.ms += 100
    kit.run(e.tick())
    r1 = row(e)
    assert (r1.state, r1.extensions, r1.aggregation) == ("finalized", 0, "mean")
    on_chain = kit.world.chain.client(0).round_result(ep, 1)
    assert (on_chain.checkpoint_sha256, on_chain.rewards_root) == (r1.checkpoint_sha256, r1.rewards_root)
    share = REWARD // 3
    assert (on_chain.n_contributors, on_chain.total_reward, r1.total_reward) == (3, 3 * share, 3 * share)
    assert r1.finalize_tx is not None and len(r1.finalize_tx) == 32
    ckpt = load_checkpoint(e.store.checkpoint_path(ep, 1), expected_sha256=r1.checkpoint_sha256.hex())
    want, _ = stepped(load_checkpoint(kit.init_path).tensors, ups, None)
    for n, t in want.items():
        torch.testing.assert_close(ckpt.tensors[n], t, rtol=0, atol=1e-7)
    assert [(c.host, c.reward, c.aggregated) for c in e.store.contributions(ep, 1)] == sorted(
        (h.address, share, True) for h in kit.hosts
    )
    tree = e.reward_tree(1)
    assert tree is not None and tree.root == r1.rewards_root and e.reward_tree(1) is tree
    assert tree.root == RewardTree(
        e.ctx.chain_id, to_checksum_address(e.ctx.registry), ep, 1,
        [(to_checksum_address(h.address), share) for h in kit.hosts],
    ).root
    assert e.reward_tree(2) is None
    # The next round: open, from the new checkpoint, a full round length from now, taking submissions.
    r2 = row(e, 2)
    assert e.current == r2 and not e.closing
    assert (r2.state, r2.base_sha256, r2.deadline_ms) == ("open", r1.checkpoint_sha256, kit.clock.ms + 10_000)
    assert closed.is_set() and not e.round_closed.is_set() and for_submissions.is_set()
    assert not e.closed_for_submissions.is_set()
    assert e.base_path(2) == e.store.checkpoint_path(ep, 1) and e.base_path(1) == kit.init_path
    assert kit.world.chain.client(0).seed_commitment(ep, 2, kit.world.chain.accounts[AGGREGATOR].address) != bytes(32)
    reg = e.metrics.registry  # type: ignore[attr-defined]
    assert reg.get_sample_value("gonka_aggregator_rounds_total", {"state": "finalized"}) == 1
    assert reg.get_sample_value("gonka_aggregator_round") == 1
    assert reg.get_sample_value("gonka_aggregator_close_seconds_count") == 1
    # Round 2 steps on from round 1's checkpoint and its momentum buffer.
    ups2 = submit_all(kit, e, 3, seed=20)
    kit.run(e.tick())
    r2 = row(e, 2)
    assert r2.state == "finalized"
    _, buf = stepped(load_checkpoint(kit.init_path).tensors, ups, None)
    want2, _ = stepped(ckpt.tensors, ups2, buf)
    got2 = load_checkpoint(e.store.checkpoint_path(ep, 2)).tensors
    for n, t in want2.items():
        torch.testing.assert_close(got2[n], t, rtol=0, atol=1e-7)
    assert e.base_path(3) == e.store.checkpoint_path(ep, 2)


def test_with_delayed_overlap_a_round_trains_from_two_rounds_back_and_steps_from_the_last(kit: Kit) -> None:
    e = kit.engine(start=False)
    e.ctx = dataclasses.replace(e.ctx, overlap="delayed")
    e.start()
    ep = kit.world.epoch
    ups = submit_all(kit, e, 3)
    kit.run(e.tick())
    r2 = row(e, 2)
    assert (r2.state, r2.base_sha256, e.base_path(2)) == ("open", kit.world.init_sha, kit.init_path)
    ups2 = submit_all(kit, e, 3, seed=20)
    kit.run(e.tick())
    assert row(e, 2).state == "finalized" and row(e, 3).base_sha256 == row(e).checkpoint_sha256
    ckpt1, buf = stepped(load_checkpoint(kit.init_path).tensors, ups, None)
    want2, _ = stepped(ckpt1, ups2, buf)  # the outer step applies to round 1's model, not round 2's base
    got2 = load_checkpoint(e.store.checkpoint_path(ep, 2)).tensors
    for n, t in want2.items():
        torch.testing.assert_close(got2[n], t, rtol=0, atol=1e-6)


def test_a_compressed_broadcast_carries_each_rounds_residual_into_the_next_closed_one(kit: Kit) -> None:
    e = kit.engine(start=False)
    e.ctx = dataclasses.replace(e.ctx, codec_name="int8", codec=get_codec("int8"), broadcast="codec")
    e.start()
    ep = kit.world.epoch
    held_back: dict[str, torch.Tensor] = {n: torch.zeros(s) for n, s in SPEC.items()}
    for r in (1, 2, 3):
        if r == 2:  # skipped (nobody submits): round 3 carries round 1's residual
            for _ in range(2):  # extended once, then skipped
                kit.clock.ms = row(e, 2).deadline_ms + 1
                kit.run(e.tick())
            assert row(e, 2).state == "skipped"
            assert row(e, 2).checkpoint_sha256 == row(e).checkpoint_sha256  # the model it left unchanged
            continue
        codec = e.ctx.codec_for(r)
        sent = [codec.encode(update(10 * r + i)) for i in range(3)]
        for h, data in zip(kit.hosts, sent, strict=True):
            sub = kit.header(e, h, data, codec="int8")
            assert kit.run(e.submit(sub, sub.sign(h.key), chunks(data), e.stream_guard("test"))).body.accepted
        kit.run(e.tick())
        assert row(e, r).state == "finalized"
        mean = {n: torch.stack([codec.decode(d, SPEC)[n].float() for d in sent]).mean(0) for n in SPEC}
        path = e.store.update_path(ep, r)
        broadcast = get_codec("int8").for_round(round_seed(0, r)).decode(path.read_bytes(), SPEC)
        residual = load_file(str(residual_path(path)))
        for n in SPEC:  # what was broadcast + what is held back = this round's mean + what was held back before
            torch.testing.assert_close(broadcast[n].float() + residual[n], mean[n] + held_back[n], rtol=0, atol=1e-6)
        assert any(float(t.abs().max()) > 1e-5 for t in residual.values())  # int8 left something out
        held_back = residual


def test_a_tick_before_the_deadline_with_a_quorum_but_not_everyone_leaves_the_round_open(kit: Kit) -> None:
    e = kit.engine()
    submit_all(kit, e, 2)
    deadline = row(e).deadline_ms
    kit.clock.ms = deadline
    kit.run(e.tick())
    assert (row(e).state, row(e).extensions, e.closing) == ("open", 0, False)
    kit.clock.ms = deadline + 1
    kit.run(e.tick())
    assert row(e).state == "finalized"
    assert kit.world.chain.client(0).round_result(kit.world.epoch, 1).n_contributors == 2


def test_below_quorum_the_round_is_extended_once_then_skipped(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gonka_node.aggregator.rounds")
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 1)
    deadline = row(e).deadline_ms
    kit.clock.ms = deadline
    kit.run(e.tick())
    assert row(e).extensions == 0
    kit.clock.ms = deadline + 1
    kit.run(e.tick())
    extended = deadline + 1 + 5000
    assert (row(e).state, row(e).extensions, row(e).deadline_ms) == ("open", 1, extended)
    assert e.current == row(e)
    assert f"round {ep}/1 below quorum (1): extended to {clock_text(extended)}" in caplog.messages
    kit.clock.ms = extended
    kit.run(e.tick())
    assert row(e).state == "open"
    kit.clock.ms = extended + 1
    kit.run(e.tick())
    r1 = row(e)
    assert (r1.state, r1.checkpoint_sha256, r1.rewards_root, r1.total_reward) == ("skipped", kit.world.init_sha, bytes(32), 0)
    assert r1.aggregation == "skipped" and e.store.contributions(ep, 1) == []
    on_chain = kit.world.chain.client(0).round_result(ep, 1)
    assert on_chain.finalized and (on_chain.checkpoint_sha256, on_chain.n_contributors) == (kit.world.init_sha, 0)
    r2 = row(e, 2)
    assert (r2.state, r2.base_sha256) == ("open", kit.world.init_sha) and e.base_path(2) == kit.init_path


def test_nobody_submitted_is_not_everyone(kit: Kit) -> None:
    e = kit.engine()
    kit.run(e.tick())
    assert row(e).state == "open" and e._members_of_round is None


def test_an_epoch_over_is_no_round_and_ticks_do_nothing(kit: Kit) -> None:
    e = kit.engine()
    for r in range(1, N_ROUNDS + 1):
        submit_all(kit, e, 3, seed=10 * r)
        kit.run(e.tick())
        assert row(e, r).state == "finalized"
    assert e.current is None and row(e, N_ROUNDS).round == N_ROUNDS
    assert len(e.store.rounds(kit.world.epoch)) == N_ROUNDS
    kit.run(e.tick())
    d = kit.world.chain.deployment
    late = Submission(d.chain_id, bytes.fromhex(d.registry[2:]), kit.world.epoch, N_ROUNDS, kit.hosts[0].address,
                      bytes(32), "fp32", bytes(32), 1, 1, kit.clock.ms, bytes(32))
    with pytest.raises(Rejected) as info:
        kit.run(e.authenticate(late, b""))
    assert info.value.reason is Reason.WRONG_ROUND
    again = kit.engine()  # a restart after the epoch's last round opens nothing
    assert again.current is None


def test_a_close_that_fails_keeps_refusing_and_is_retried_every_tick(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    ep = kit.world.epoch2
    other = kit.world.chain.client(SECOND_AGGREGATOR)
    secret = new_secret()
    other.commit_round_seed(ep, 1, seed_commitment(secret))  # the other aggregator committed, not revealed
    e = kit.engine(ep)
    submit_all(kit, e, 3)
    t0 = kit.clock.ms
    kit.run(e.tick())
    assert e.closing and row(e).state == "open"
    pending = f"round {ep}/1: 1 of 2 aggregators revealed their seed"
    assert caplog.messages == [
        f"round {ep}/1: closing failed (state open, SeedPending: {pending}); submissions stay refused, retrying every tick"
    ]
    with pytest.raises(Rejected) as info:
        kit.run(e.authenticate(kit.header(e, kit.world.outsider, payload(update(1))), b""))
    assert info.value.reason is Reason.LATE
    for _ in range(50):
        kit.clock.ms += 30
        kit.run(e.tick())
    assert caplog.messages[1:] == [f"round {ep}/1: closing still failing after 51 attempts ({pending})"]
    other.reveal_round_seed(ep, 1, secret)
    kit.run(e.tick())
    assert row(e).state == "finalized" and row(e, 2).state == "open" and not e.closing
    assert caplog.messages[2:] == [
        f"round {ep}/1: closing completed after 51 failed attempts over 1.5 s (state finalized)"
    ]
    assert e._close_failed is None and e._close_failures == (0, 0)
    assert kit.clock.ms == t0 + 1500


def test_a_restart_finishes_a_recorded_close_without_finalizing_twice(kit: Kit, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gonka_node.aggregator.rounds")
    e = kit.engine()
    ep = kit.world.epoch
    submit_all(kit, e, 3)
    kit.run(e.tick())
    r1 = row(e)
    tx = r1.finalize_tx
    assert tx and f"round {ep}/1 finalized on chain: checkpoint {r1.checkpoint_sha256.hex()[:16]}…, 3 paid, tx {tx.hex()}" in caplog.messages
    # A crash after the chain's finalize and before the store said so: the intent is still on disk.
    set_state(kit, ep, 1, "finalizing")
    caplog.clear()
    again = kit.engine()
    assert row(again).state == "finalized" and row(again).finalize_tx == b""
    assert caplog.messages[0] == f"resuming the finalization of round {ep}/1"
    assert caplog.messages[1] == (
        f"round {ep}/1 was already finalized on chain with the recorded checkpoint {r1.checkpoint_sha256.hex()[:16]}…: "
        "not sending finalize again"
    )
    assert again.current == row(again, 2)
    # A store whose intent differs from what the chain finalized: refuse to go on.
    set_state(kit, ep, 1, "finalizing", checkpoint=b"\x05" * 32)
    with pytest.raises(RuntimeError, match=f"round {ep}/1 is finalized on chain with checkpoint {r1.checkpoint_sha256.hex()}, "
                       f"but this aggregator computed {'05' * 32}"):
        kit.engine()


def test_a_restart_finishes_a_recorded_skip_too(kit: Kit) -> None:
    e = kit.engine()
    ep = kit.world.epoch
    for _ in range(2):  # nobody submits: extended once, then skipped
        kit.clock.ms = row(e).deadline_ms + 1
        kit.run(e.tick())
    assert row(e).state == "skipped"
    set_state(kit, ep, 1, "skipping")  # a crash after the chain recorded the skip, before the store did
    again = kit.engine()
    assert row(again).state == "skipped" and row(again).checkpoint_sha256 == kit.world.init_sha
    assert again.current == row(again, 2)


def set_state(kit: Kit, epoch: int, round_: int, state: str, checkpoint: bytes | None = None) -> None:
    db = sqlite3.connect(kit.tmp / "agg" / "state.sqlite3")
    with db:
        db.execute("UPDATE rounds SET state=? WHERE epoch=? AND round=?", (state, epoch, round_))
        if checkpoint is not None:
            db.execute("UPDATE rounds SET checkpoint_sha256=? WHERE epoch=? AND round=?", (checkpoint, epoch, round_))
    db.close()


def test_tx_bytes_reads_receipts_and_tx_objects() -> None:
    class Sent:
        tx_hash = "0x" + "ab" * 32

    assert _tx_bytes({"transactionHash": b"\x01" * 32}) == b"\x01" * 32
    assert _tx_bytes({"transactionHash": bytearray(b"\x02" * 32)}) == b"\x02" * 32
    assert _tx_bytes({"transactionHash": "0x" + "cd" * 32}) == bytes.fromhex("cd" * 32)
    assert _tx_bytes(Sent()) == bytes.fromhex("ab" * 32)
    assert _tx_bytes("0x12") == b"\x12" and _tx_bytes("12") == b"" and _tx_bytes(None) == b"" and _tx_bytes({}) == b""


def test_clock_text_is_utc_to_the_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    assert clock_text(1_748_786_592_345) == "2025-06-01 14:03:12.345 UTC"
    assert clock_text(0) == "1970-01-01 00:00:00.000 UTC"
    monkeypatch.setenv("TZ", "EST+05")  # a machine whose local time is not UTC: the text is still UTC
    time.tzset()
    try:
        assert clock_text(1_748_786_592_345) == "2025-06-01 14:03:12.345 UTC"
    finally:
        monkeypatch.undo()
        time.tzset()


class ClosedRounds(RoundMetrics):
    """Metrics that want each closed round's contributions, and keep what they were given."""

    def __init__(self, wants: bool) -> None:
        self.wants, self.closed = wants, list[tuple[int, list[ContributionRow]]]()

    @property
    def wants_contributions(self) -> bool:
        return self.wants

    def round_closed(self, row: RoundRow, seconds: float, contributions: list[ContributionRow]) -> None:
        self.closed.append((row.round, contributions))


@pytest.mark.parametrize("wants", [True, False])
def test_metrics_get_the_closed_rounds_contributions_only_when_they_want_them(kit: Kit, wants: bool) -> None:
    e = kit.engine()
    e.metrics = metrics = ClosedRounds(wants)
    submit_all(kit, e, 3)
    kit.run(e.tick())
    contributions = e.store.contributions(kit.world.epoch, 1)
    assert len(contributions) == 3
    assert metrics.closed == [(1, contributions if wants else [])]


def test_a_top_k_close_waits_from_the_seeds_time_and_judges_each_host_on_its_opening(kit: Kit) -> None:
    """Two hosts of a top-k epoch (every host challenged) submit and open their residual after the
    deadline's close revealed the seed: the openings' clock starts at the seed, and each host's opening
    reaches its replay, which it passes."""
    windows = micro_windows()
    ctx = topk_context(kit, windows)
    e = start(kit, ctx)
    hosts = [TopkHost(kit, h, commitment_layout(ctx.spec, ctx.codec)) for h in kit.hosts[:2]]
    where, base = slots(e), load_checkpoint(ctx.initial_checkpoint).tensors
    for host in hosts:
        host.submit(e, honest(windows, base, where[host.h.address], 1))
    kit.clock.ms += 11_000  # past the deadline with a quorum of two
    kit.run(e.tick())
    got = e.store.get_round(ctx.epoch, 1)
    assert got is not None and got.seed_complete_ms == kit.clock.ms and state(e, 1) == "open"
    assert deadline_ms(got, kit.aggregation.opening_timeout_s) == kit.clock.ms + 120_000
    for host in hosts:
        host.open(e, 1, *host.body(host.challenged(e, 1)))
    kit.run(e.tick())
    assert state(e, 1) == "finalized"
    judged = by_host(e, 1)
    assert [(judged[h.h.address].aggregated, judged[h.h.address].reasons[0].startswith(f"{PASSED} cosine +1.0000"))
            for h in hosts] == [(True, True)] * 2
