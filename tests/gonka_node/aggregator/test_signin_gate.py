"""A round does not close early while hosts may still sign in (the registry would refuse it anyway)."""

from __future__ import annotations

import time

from agg_harness import Harness
from test_round import wait_state


def test_everyone_submitted_waits_for_the_signin_window(harness: Harness, monkeypatch) -> None:
    h = harness
    backend = h.world.backend
    with monkeypatch.context() as m:
        m.setattr(backend, "increase_time", lambda seconds: None)  # leave the sign-in window open
        h.schedule(2)
    server = h.start_server()
    with server.client() as client:
        info = client.open_round()
        for host in h.hosts:
            client.submit(info, host.address, h.payload(h.honest_update(host, 1)), host.key)
    time.sleep(2.0)  # many ticks: every signed-in host has submitted, yet the window is open
    assert server.engine.store.get_round(h.epoch, 1).state == "open"
    assert h.world.client(0).latest_round(h.epoch) == 0
    backend.increase_time(31)  # the window closes: the next ticks close and finalize the round
    assert wait_state(server, h.epoch, 1, ("finalized",)) == "finalized"
    assert h.world.client(0).latest_round(h.epoch) == 1
