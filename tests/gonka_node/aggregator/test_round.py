"""A full round on the embedded chain, and a restart that loses nothing and finalizes once."""

from __future__ import annotations

import sqlite3
import time

import grpc
import pytest
import torch
from agg_harness import AGGREGATOR, Harness, ServerThread
from eth_utils import to_checksum_address
from safetensors.torch import load as load_safetensors

from chain.client import round_result_hash
from chain.merkle import reward_leaf, verify_proof
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import AggregationSettings
from proto.gonka.v1 import aggregator_pb2 as pb
from training.diloco import OuterOptimizer
from training.inner import evaluate


def wait_open(client: AggregatorClient, round_: int, timeout: float = 60.0) -> pb.RoundInfo:
    """The open round once it is `round_` (a round opens only after its seed commitment is on chain)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = client.open_round()
            if info.round == round_:
                return info
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        time.sleep(0.05)
    raise AssertionError(f"round {round_} did not open")


def wait_state(
    server: ServerThread, epoch: int, round_: int, states: tuple[str, ...], timeout: float = 90.0
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = server.engine.store.get_round(epoch, round_)
        if row is not None and row.state in states:
            return row.state
        time.sleep(0.1)
    raise AssertionError(f"round {epoch}/{round_} did not reach {states}")


def test_three_honest_hosts_finalize_on_chain_and_hosts_recompute_the_hash(harness: Harness) -> None:
    h = harness
    h.schedule(3)
    server = h.start_server()
    with server.client() as client:
        info = client.open_round()
        assert (info.epoch, info.round, info.base_checkpoint_sha256) == (h.epoch, 1, h.init_sha)
        assert info.expected_hosts == 3
        for host in h.hosts:
            receipt = client.submit(
                info, host.address, h.payload(h.honest_update(host, info.round)), host.key, 1000
            )
            assert receipt.accepted
        # Every signed-in host submitted: the round closes without waiting for its deadline.
        assert wait_state(server, h.epoch, 1, ("finalized", "skipped")) == "finalized"
        result = client.round_result(h.epoch, 1)
        on_chain = h.world.client(0).round_result(h.epoch, 1)
        assert on_chain.finalized and on_chain.checkpoint_sha256 == result.checkpoint_sha256
        assert on_chain.rewards_root == result.rewards_root and on_chain.total_reward == result.total_reward
        assert [c.aggregated for c in result.contributions] == [True] * 3
        assert all(c.score > 0 for c in result.contributions), [c.reasons for c in result.contributions]

        # A host applies the served aggregate with its own outer optimizer and gets the on-chain hash.
        update = load_safetensors(client.round_update(h.epoch, 1).data)
        params = {n: t.clone() for n, t in h.base.items()}
        OuterOptimizer(0.7, 0.9).step(params, update)
        assert TrainingCheckpoints().sha256(params) == on_chain.checkpoint_sha256
        served = client.checkpoint(h.epoch, 1)
        assert served.meta.content_sha256 == on_chain.checkpoint_sha256

        # The held-out loss it reports is the base's and the new checkpoint's on the round's scoring windows.
        ctx = h.context()
        assert ctx.model_factory is not None and ctx.scoring is not None
        batch = ctx.scoring.heldout(1, h.init_sha)
        model = ctx.model_factory()
        model.load_state_dict(h.base)
        assert result.heldout_loss_base == pytest.approx(evaluate(model, [batch], autocast="off"), rel=1e-9)
        model.load_state_dict(load_safetensors(served.data))
        assert result.heldout_loss == pytest.approx(evaluate(model, [batch], autocast="off"), rel=1e-9)
        assert result.heldout_loss < result.heldout_loss_base  # three honest updates help

        # Rewards: every host's proof verifies against the root on chain; the pool split sums up.
        total = 0
        for host in h.hosts:
            proof = client.reward_proof(h.epoch, 1, host.address)
            leaf = reward_leaf(
                h.world.deployment.chain_id,
                h.world.deployment.registry,
                h.epoch,
                1,
                to_checksum_address(host.address),
                proof.amount,
            )
            assert verify_proof(leaf, list(proof.proof), on_chain.rewards_root)
            total += proof.amount
        assert total == on_chain.total_reward <= h.reward_per_round
        assert total > 0.99 * h.reward_per_round

        # The next round is open on the new checkpoint.
        nxt = wait_open(client, 2)
        assert (nxt.round, nxt.base_checkpoint_sha256) == (2, on_chain.checkpoint_sha256)


def test_noise_and_untrained_hosts_score_at_or_below_zero(harness: Harness) -> None:
    h = harness
    # The harness's honest update memorises its 8 windows (20 steps over them): the proof-of-assignment
    # rule can then tell a host that trained on another slot's windows.
    h.aggregation = AggregationSettings(score_rule="assignment_gap")
    h.schedule(3)
    server = h.start_server()
    honest, noisy, idle = h.hosts
    with server.client() as client:
        info = client.open_round()
        client.submit(info, honest.address, h.payload(h.honest_update(honest, 1)), honest.key)
        gen = torch.Generator().manual_seed(5)
        noise = {n: torch.randn(s, generator=gen) * 0.01 for n, s in h.spec.items()}
        client.submit(info, noisy.address, h.payload(noise), noisy.key)
        # Trained, but on another slot's windows: not its assignment.
        other = type(idle)(idle.index, idle.account, idle.key, slot=7)
        client.submit(info, idle.address, h.payload(h.honest_update(other, 1)), idle.key)
        wait_state(server, h.epoch, 1, ("finalized",))
        by_host = {c.host: c for c in client.round_result(h.epoch, 1).contributions}
    assert by_host[honest.address].score > 0 and by_host[honest.address].aggregated
    assert by_host[noisy.address].score <= 0 and not by_host[noisy.address].aggregated
    assert by_host[idle.address].score <= 0 and not by_host[idle.address].aggregated
    assert by_host[noisy.address].reward == by_host[idle.address].reward == 0


def test_restart_mid_round_keeps_accepted_submissions_and_finalizes_once(harness: Harness) -> None:
    h = harness
    h.schedule(3)
    first = h.start_server()
    updates = {host.index: h.payload(h.honest_update(host, 1)) for host in h.hosts}
    with first.client() as client:
        info = client.open_round()
        for host in h.hosts[:2]:
            assert client.submit(info, host.address, updates[host.index], host.key).accepted
    first.stop()  # torn down mid-round: the third host has not submitted yet

    second = h.start_server()
    with second.client() as client:
        info2 = client.open_round()
        assert (info2.round, info2.submissions, info2.deadline_unix_ms) == (1, 2, info.deadline_unix_ms)
        # What was accepted before the restart is still accepted: a resend is a duplicate.
        host = h.hosts[0]
        try:
            client.submit(info2, host.address, updates[host.index], host.key)
            raise AssertionError("a resend after restart must be refused")
        except Exception as exc:
            assert "DUPLICATE" in str(exc)
        last = h.hosts[2]
        assert client.submit(info2, last.address, updates[last.index], last.key).accepted
        wait_state(second, h.epoch, 1, ("finalized",))
        sha = client.round_result(h.epoch, 1).checkpoint_sha256
    second.stop()

    # A third start finds the round finalized on chain and in its records: it finalizes nothing again.
    engine_row = None
    third = h.start_server()
    try:
        engine_row = third.engine.store.get_round(h.epoch, 1)
        assert (
            engine_row is not None and engine_row.state == "finalized" and engine_row.checkpoint_sha256 == sha
        )
        assert third.engine.current is not None and third.engine.current.round == 2
        assert h.world.client(0).latest_round(h.epoch) == 1
    finally:
        third.stop()


def close_round_one(h: Harness) -> None:
    """Every host submits an honest round-1 update; the aggregator closes the round; then it stops."""
    server = h.start_server()
    with server.client() as client:
        info = client.open_round()
        for host in h.hosts:
            client.submit(info, host.address, h.payload(h.honest_update(host, 1)), host.key)
        wait_state(server, h.epoch, 1, ("finalized",))
    server.stop()


def rewind_to_finalizing(h: Harness) -> None:
    """Set round 1 back to "finalizing" (intent recorded, outcome not), as a crash right after the chain
    transaction would leave it."""
    db = sqlite3.connect(h.tmp / "agg" / "state.sqlite3")
    with db:
        db.execute("UPDATE rounds SET state='finalizing', finalize_tx=NULL WHERE epoch=? AND round=?", (h.epoch, 1))
    db.close()


def test_interrupted_finalization_checks_the_chain_before_sending_again(harness: Harness) -> None:
    """Crash after the chain transaction but before recording it: the restart must not re-send."""
    h = harness
    h.schedule(3)
    close_round_one(h)
    rewind_to_finalizing(h)
    again = h.start_server()
    try:
        row = again.engine.store.get_round(h.epoch, 1)
        assert row is not None and row.state == "finalized" and row.finalize_tx == b""  # nothing re-sent
        assert h.world.client(0).latest_round(h.epoch) == 1
    finally:
        again.stop()


def test_restart_after_voting_below_quorum_does_not_vote_again(harness: Harness) -> None:
    """Two aggregators, quorum 2: ours votes, crashes before recording it, restarts. The chain already
    holds its vote (a second one would revert): it must see that, not re-send, and let the other
    aggregator's vote finalize the round."""
    h = harness
    h.schedule(3, aggregators=(AGGREGATOR, 8), quorum=2)
    close_round_one(h)
    ours = h.world.client(AGGREGATOR)
    voted = ours.round_vote(h.epoch, 1)
    assert voted != bytes(32) and ours.latest_round(h.epoch) == 0  # one vote of two
    rewind_to_finalizing(h)
    again = h.start_server()
    try:
        row = again.engine.store.get_round(h.epoch, 1)
        assert row is not None and row.state == "finalized" and row.finalize_tx == b""  # no second vote
        assert row.checkpoint_sha256 is not None and row.rewards_root is not None and row.total_reward is not None
        n = sum(1 for c in again.engine.store.contributions(h.epoch, 1) if c.reward > 0)
        assert round_result_hash(row.checkpoint_sha256, row.rewards_root, n, row.total_reward) == voted
        h.world.client(8).finalize_round(h.epoch, 1, row.checkpoint_sha256, row.rewards_root, n, row.total_reward)
        assert ours.latest_round(h.epoch) == 1  # the second aggregator's vote reached the quorum
    finally:
        again.stop()


def test_a_round_the_chain_finalized_is_served_before_the_aggregator_marks_it(harness: Harness) -> None:
    """A host follows the chain: once the finalize transaction is mined it asks for the round's update,
    and may ask before this aggregator has recorded that the transaction went through. The update, the
    checkpoint and the result are served in that window (a NOT_FOUND there sent hosts to pull the whole
    checkpoint, and lose their outer momentum)."""
    h = harness
    h.schedule(3)
    server = h.start_server()
    view = server.engine.chain
    asked: dict[str, object] = {}
    real_finalize = view.finalize_round

    def finalize_then_ask(*args: object, **kwargs: object) -> object:
        sent = real_finalize(*args, **kwargs)  # type: ignore[arg-type]
        row = server.engine.store.get_round(h.epoch, 1)
        asked["state"] = None if row is None else row.state
        with server.client() as asking:
            try:
                asked["update"] = asking.round_update(h.epoch, 1).data
                asked["checkpoint"] = asking.checkpoint(h.epoch, 1).meta.content_sha256
                asked["result"] = asking.round_result(h.epoch, 1)
            except grpc.RpcError as exc:
                asked["error"] = f"{exc.code()}: {exc.details()}"
        return sent

    view.finalize_round = finalize_then_ask  # type: ignore[method-assign]
    with server.client() as client:
        info = client.open_round()
        for host in h.hosts:
            assert client.submit(info, host.address, h.payload(h.honest_update(host, 1)), host.key, 1000).accepted
        assert wait_state(server, h.epoch, 1, ("finalized", "skipped")) == "finalized"
        assert "error" not in asked, asked.get("error")
        assert asked["state"] == "finalizing"  # asked in the window, not after it
        on_chain = h.world.client(0).round_result(h.epoch, 1)
        assert asked["checkpoint"] == on_chain.checkpoint_sha256
        assert asked["update"] == client.round_update(h.epoch, 1).data  # the same bytes as after the mark
        result = asked["result"]
        assert isinstance(result, pb.RoundResult)
        assert (result.state, result.checkpoint_sha256) == ("finalizing", on_chain.checkpoint_sha256)
