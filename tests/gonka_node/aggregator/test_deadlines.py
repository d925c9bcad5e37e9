"""Deadlines: below quorum a round is extended, then skipped on chain with the base hash unchanged."""

from __future__ import annotations

import logging

from agg_harness import Harness
from test_round import wait_open, wait_state

from gonka_node.core.config import RoundSettings


def test_below_quorum_the_round_is_extended_then_skipped(harness: Harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gonka_node.aggregator")
    h = harness
    # Real time: the one upload must land within the round (10 s: on a loaded machine 1 s was missed).
    h.round_length_s = 10.0
    h.settings = RoundSettings(quorum=2, extend_s=0.5, max_extensions=1, max_update_norm=100.0)
    h.schedule(3)
    lone = h.hosts[0]
    payload = h.payload(h.honest_update(lone, 1))  # before the round's clock runs
    server = h.start_server()
    with server.client() as client:
        info = client.open_round()
        assert client.submit(info, lone.address, payload, lone.key).accepted
        assert wait_state(server, h.epoch, 1, ("skipped",), timeout=60) == "skipped"
        result = client.round_result(h.epoch, 1)
        nxt = wait_open(client, 2)
    row = server.engine.store.get_round(h.epoch, 1)
    assert row.extensions == 1  # extended once, then skipped
    on_chain = h.world.client(0).round_result(h.epoch, 1)
    assert on_chain.finalized and on_chain.checkpoint_sha256 == h.init_sha  # the model did not move
    assert on_chain.total_reward == 0 and result.total_reward == 0
    assert result.state == "skipped"
    assert (nxt.round, nxt.base_checkpoint_sha256) == (2, h.init_sha)  # the next round starts from it
    assert "below quorum" in caplog.text
