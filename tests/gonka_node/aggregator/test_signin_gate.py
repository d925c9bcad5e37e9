"""A round does not close early while hosts may still sign in (the registry would refuse it anyway)."""

from __future__ import annotations

import hashlib
import time

import pytest
from agg_harness import GNK, Harness, Host, ServerThread
from nacl.signing import SigningKey
from test_round import wait_state


def serve_with_signin_open(h: Harness, monkeypatch: pytest.MonkeyPatch) -> ServerThread:
    """Schedule the epoch (two hosts signed in) leaving the sign-in window open; the started server."""
    with monkeypatch.context() as m:
        m.setattr(h.world.backend, "increase_time", lambda seconds: None)
        h.schedule(2)
    return h.start_server()


def test_everyone_submitted_waits_for_the_signin_window(harness: Harness, monkeypatch) -> None:
    h, backend = harness, harness.world.backend
    server = serve_with_signin_open(h, monkeypatch)
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


def test_a_host_signing_in_late_is_waited_for(harness: Harness, monkeypatch) -> None:
    """Two hosts sign in and submit while the window is open; a third signs in just before it closes.
    The round must not close as "everyone has submitted" on a host list read while hosts were still
    joining: it waits for the third host."""
    h, backend = harness, harness.world.backend
    server = serve_with_signin_open(h, monkeypatch)
    late = Host(3, h.world.accounts[3], SigningKey(hashlib.sha256(b"host-3").digest()))
    with server.client() as client:
        info = client.open_round()
        for host in h.hosts:
            client.submit(info, host.address, h.payload(h.honest_update(host, 1)), host.key)
        time.sleep(1.0)  # ticks see the two submissions while the window is open
        late.slot = h.world.client(3).join(h.epoch, 10 * GNK, bytes(late.key.verify_key))
        backend.increase_time(31)  # the window closes with three hosts signed in
        time.sleep(2.0)  # many ticks: two of three have submitted
        assert server.engine.store.get_round(h.epoch, 1).state == "open"
        client.submit(info, late.address, h.payload(h.honest_update(late, 1)), late.key)
    assert wait_state(server, h.epoch, 1, ("finalized",)) == "finalized"
    assert len(server.engine.store.submissions(h.epoch, 1)) == 3
