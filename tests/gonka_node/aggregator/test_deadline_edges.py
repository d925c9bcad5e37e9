"""The deadline to the millisecond, on a real aggregator (gRPC on 127.0.0.1:0, embedded chain) whose clock
the test holds: a submission at the deadline is on time, one a millisecond later is LATE; a round is
judged against its quorum only once its deadline has passed, and closes then with exactly `quorum`
accepted submissions (no extension), or is extended with one fewer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from agg_harness import AGGREGATOR, Harness, Host, ServerThread
from nacl.signing import SigningKey

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.engine_types import clock_text
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.store import RoundRow, Store, now_ms
from gonka_node.core.client import SubmitRejected
from gonka_node.core.config import RoundSettings


class HeldClock:
    """The aggregator's clock in ms; it moves only when the test moves it."""

    def __init__(self) -> None:
        self.ms = now_ms()

    def __call__(self) -> int:
        return self.ms


def start_with_clock(h: Harness, clock: HeldClock) -> ServerThread:
    def build() -> RoundEngine:
        return RoundEngine(
            h.context(), h.settings, h.aggregation, Store(h.tmp / "agg").open(),
            ChainView(h.world.client(AGGREGATOR)), TrainingCheckpoints(), SigningKey(b"\x09" * 32), clock=clock,
        )

    server = ServerThread(build, h.identity).start()
    h.servers.append(server)
    return server


def small_update(h: Harness, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 1e-3 for n, s in h.spec.items()}


@pytest.fixture
def held(harness: Harness) -> tuple[Harness, HeldClock]:
    # A 1-second round: the hosts' real timestamps stay within the allowed skew of the held clock.
    harness.round_length_s = 1.0
    harness.settings = RoundSettings(quorum=2, extend_s=5.0, max_extensions=1, max_update_norm=100.0)
    harness.schedule(3)  # three signed in: two submissions are a quorum, not "everyone"
    return harness, HeldClock()


def test_a_submission_at_the_deadline_is_accepted_one_ms_later_is_late(held: tuple[Harness, HeldClock]) -> None:
    h, clock = held
    server = start_with_clock(h, clock)
    on_time, late = h.hosts[0], h.hosts[1]
    with server.client() as client:
        info = client.open_round()
        assert info.deadline_unix_ms == clock.ms + 1000
        clock.ms = info.deadline_unix_ms
        receipt = client.submit(info, on_time.address, h.payload(small_update(h, 1)), on_time.key)
        assert receipt.accepted and receipt.received_unix_ms == info.deadline_unix_ms
        clock.ms = info.deadline_unix_ms + 1
        with pytest.raises(SubmitRejected) as refused:
            client.submit(info, late.address, h.payload(small_update(h, 2)), late.key)
    assert refused.value.reason == "LATE"
    assert f"closed for submissions at {clock_text(info.deadline_unix_ms)}" in refused.value.message
    server.run(server.engine.checks.drain(h.epoch, 1))  # its checks follow the receipt
    assert [s.host for s in server.engine.store.submissions(h.epoch, 1)] == [on_time.address]


def wait_row(server: ServerThread, epoch: int, done: Callable[[RoundRow], bool]) -> RoundRow:
    stop = time.monotonic() + 30
    while time.monotonic() < stop:
        row = server.engine.store.get_round(epoch, 1)
        if row is not None and done(row):
            return row
        time.sleep(0.05)
    raise AssertionError(f"round {epoch}/1 did not change: {server.engine.store.get_round(epoch, 1)}")


def submit_all(server: ServerThread, hosts: list[Host], payloads: list[bytes]) -> int:
    with server.client() as client:
        info = client.open_round()
        for host, payload in zip(hosts, payloads, strict=True):
            assert client.submit(info, host.address, payload, host.key).accepted
    return info.deadline_unix_ms


def test_exactly_quorum_at_the_deadline_closes_only_once_it_has_passed(held: tuple[Harness, HeldClock]) -> None:
    h, clock = held
    pair = h.hosts[:2]
    payloads = [h.payload(h.honest_update(host, 1)) for host in pair]  # scored above zero: aggregated
    server = start_with_clock(h, clock)
    deadline = submit_all(server, pair, payloads)
    clock.ms = deadline
    server.run(server.engine.tick())  # a tick at the deadline itself (the server's own ones see it too)
    row = server.engine.store.get_round(h.epoch, 1)
    assert (row.state, row.extensions, row.deadline_ms) == ("open", 0, deadline)  # not past it yet

    clock.ms = deadline + 1  # the server's own ticks (every 0.2 s) act on it from here
    row = wait_row(server, h.epoch, lambda r: r.state in ("finalized", "skipped") or r.extensions > 0)
    assert (row.state, row.extensions) == ("finalized", 0)  # closed with 2 = quorum, not extended
    on_chain = h.world.client(0).round_result(h.epoch, 1)
    assert on_chain.checkpoint_sha256 == row.checkpoint_sha256 != h.init_sha  # the model moved
    assert on_chain.n_contributors == 2 and on_chain.total_reward > 0


def test_one_below_quorum_at_the_deadline_is_extended_once_it_has_passed(held: tuple[Harness, HeldClock]) -> None:
    h, clock = held
    server = start_with_clock(h, clock)
    deadline = submit_all(server, h.hosts[:1], [h.payload(small_update(h, 3))])
    clock.ms = deadline
    server.run(server.engine.tick())
    assert server.engine.store.get_round(h.epoch, 1).extensions == 0

    clock.ms = deadline + 1
    row = wait_row(server, h.epoch, lambda r: r.extensions > 0)
    assert (row.state, row.extensions, row.deadline_ms) == ("open", 1, deadline + 1 + 5000)
