"""Faults against real processes: SIGKILLed aggregator and host, the chain unreachable for 30 s, a slow
uplink against the round deadline. Each ends with the round finalized on chain exactly once, every
accepted submission kept, every reward claimable once, and a log line saying what happened.

"Finalized once" is checked three ways: the registry's latest round, the number of transactions ever
mined from the aggregator's account (it sends nothing but `finalize_round`), and the registry refusing
a second `finalize_round` for the same round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fault_harness import AGGREGATOR, FaultNet, TcpProxy

from chain.errors import ChainError
from gonka_node.aggregator.client import AggregatorClient, SubmitRejected

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture
def net_factory(tmp_path: Path) -> Iterator[object]:
    nets: list[FaultNet] = []
    proxies: list[TcpProxy] = []

    def make(**kwargs: object) -> FaultNet:
        net = FaultNet(tmp_path / f"net{len(nets)}", **kwargs)  # type: ignore[arg-type]
        nets.append(net)
        return net

    make.proxies = proxies  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for p in proxies:
            p.stop()
        for n in nets:
            n.close()


def assert_finalized_once(net: FaultNet, round_: int = 1) -> None:
    chain = net.client(0)
    assert chain.latest_round(net.epoch) == round_
    assert chain.round_result(net.epoch, round_).finalized
    assert net.finalize_txs_sent() == round_  # one finalize_round transaction per round, ever
    result = chain.round_result(net.epoch, round_)
    with pytest.raises(ChainError, match="round out of order"):
        net.client(AGGREGATOR).finalize_round(
            net.epoch, round_, bytes(result.checkpoint_sha256), bytes(result.rewards_root),
            result.n_contributors, result.total_reward,
        )


def claim_all_once(net: FaultNet, target: str, round_: int, hosts: list[int]) -> int:
    """Each paid host claims by proof (succeeds), then again (reverts); returns the total claimed."""
    total = 0
    with AggregatorClient(target, 30) as agg:
        for i in hosts:
            host = net.client(i)
            before = host.gnk_balance()
            proof = agg.reward_proof(net.epoch, round_, net.host_address(i))
            host.claim(net.epoch, round_, int(proof.amount), list(proof.proof))
            assert host.gnk_balance() - before == proof.amount > 0
            with pytest.raises(ChainError):
                host.claim(net.epoch, round_, int(proof.amount), list(proof.proof))
            total += int(proof.amount)
    assert total == net.client(0).round_result(net.epoch, round_).total_reward
    return total


def test_aggregator_sigkilled_mid_round_keeps_accepted_submissions_and_finalizes_once(net_factory) -> None:
    net: FaultNet = net_factory(hosts=2, quorum=2)
    target = net.start_aggregator()
    assert net.submit_update(target, 1, seed=1).accepted
    assert net.open_round(target).submissions == 1

    net.kill("aggregator")  # SIGKILL between an accepted receipt and the round's close
    target = net.start_aggregator()
    info = net.open_round(target)
    assert (info.round, info.submissions) == (1, 1)  # the receipt was a promise: the submission survived
    assert "resumed open round" in net.log("aggregator") and "with 1 accepted submissions" in net.log("aggregator")
    with pytest.raises(SubmitRejected) as dup:
        net.submit_update(target, 1, seed=1)
    assert dup.value.reason == "DUPLICATE"

    assert net.submit_update(target, 2, seed=2).accepted  # everyone in: the round closes at once
    net.wait("round 1 on chain", lambda: net.client(0).latest_round(net.epoch) >= 1, 60)
    net.wait("the aggregator to record it", lambda: net.agg_state(1) == "finalized", 30)
    assert_finalized_once(net)
    assert claim_all_once(net, target, 1, [1, 2]) == 100 * 10**9  # both hosts scored 1: equal halves


def test_aggregator_sigkilled_after_sending_finalize_does_not_finalize_twice(net_factory) -> None:
    """The dangerous window: the finalize transaction is mined, its answer lost, the process killed
    before it records "finalized". The restarted aggregator must find the round on chain and stop."""
    net: FaultNet = net_factory(hosts=2, quorum=2)
    proxy = TcpProxy(net.chain_port).start()
    net_factory.proxies.append(proxy)
    proxy.cut_after(b"eth_sendRawTransaction")
    target = net.start_aggregator(rpc_url=f"http://{proxy.target}")
    assert net.submit_update(target, 1, seed=1).accepted
    assert net.submit_update(target, 2, seed=2).accepted
    net.wait("the finalize transaction to be mined", lambda: net.client(0).latest_round(net.epoch) >= 1, 60)
    assert net.agg_state(1) == "finalizing"  # the answer never came back: the intent is all it has
    net.kill("aggregator")

    proxy.restore()
    target = net.start_aggregator(rpc_url=f"http://{proxy.target}")
    net.wait("the restarted aggregator to mark round 1 finalized", lambda: net.agg_state(1) == "finalized", 30)
    log = net.log("aggregator")
    assert "resuming the finalization of round" in log
    assert "was already finalized on chain with the recorded checkpoint" in log and "not sending finalize again" in log
    assert_finalized_once(net)
    claim_all_once(net, target, 1, [1, 2])


def test_chain_unreachable_for_30s_during_finalization(net_factory) -> None:
    net: FaultNet = net_factory(hosts=2, quorum=2)
    proxy = TcpProxy(net.chain_port).start()
    net_factory.proxies.append(proxy)
    proxy.cut_after(b"eth_sendRawTransaction")  # the outage starts as the finalize transaction leaves
    target = net.start_aggregator(rpc_url=f"http://{proxy.target}")
    assert net.submit_update(target, 1, seed=1).accepted
    assert net.submit_update(target, 2, seed=2).accepted
    net.wait("the outage to start", lambda: proxy.tripped_at is not None, 60)
    time.sleep(max(0.0, 30.0 - (time.monotonic() - proxy.tripped_at)))
    assert net.agg_state(1) == "finalizing"  # 30 s without the chain: still only the intent
    with AggregatorClient(target, 10) as agg, pytest.raises(grpc.RpcError) as closed:
        agg.open_round()
    assert closed.value.code() == grpc.StatusCode.NOT_FOUND  # meanwhile no round takes submissions
    proxy.restore()

    net.wait("the aggregator to finish round 1", lambda: net.agg_state(1) == "finalized", 60)
    log = net.log("aggregator")
    assert "closing failed (state finalizing" in log and "retrying every tick" in log
    assert "closing completed after" in log
    assert "not sending finalize again" in log  # the transaction sent before the outage had landed
    assert_finalized_once(net)
    claim_all_once(net, target, 1, [1, 2])
