"""No stream holds the aggregator, and copies are judged by header order (a real server on 127.0.0.1:0).

A stream gets `stream_idle_s` for its header and for each next chunk, and `stream_setup_s + bytes /
min rate` in total; one stream per host at a time; a payload digest is owned by the host whose signed
header named it first, even while that host's upload is still streaming.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from agg_harness import Harness, Host, ServerThread
from test_rejections import envelope, good_payload, stream
from test_round import wait_state

from gonka_node.core.client import SubmitRejected
from proto.gonka.v1 import aggregator_pb2 as pb


class Upload(threading.Thread):
    """A Submit stream sent from its own thread and channel; `requests` may block to hold it open."""

    def __init__(self, server: ServerThread, requests: Iterator[pb.SubmitRequest]) -> None:
        super().__init__(daemon=True)
        self.server, self.requests = server, requests
        self.receipt: pb.Receipt | None = None
        self.refused: SubmitRejected | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        with self.server.client(60) as client:
            try:
                self.receipt = client.submit_raw(self.requests)
            except SubmitRejected as exc:
                self.refused = exc
            self.ended_at = time.monotonic()

    def outcome(self, timeout: float = 30.0) -> str:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        return "ACCEPTED" if self.receipt is not None else self.refused.reason  # type: ignore[union-attr]


def held(first: list[pb.SubmitRequest], rest: list[pb.SubmitRequest], gate: threading.Event) -> Iterator[pb.SubmitRequest]:
    yield from first
    gate.wait(60)
    yield from rest


def limited(h: Harness, **limits: float) -> ServerThread:
    h.settings = dataclasses.replace(h.settings, **limits)
    h.schedule(3)
    return h.start_server()


def perturbed(h: Harness, payload: bytes, scale: float) -> bytes:
    update = h.codec.decode(payload, h.spec)
    gen = torch.Generator().manual_seed(9)
    return h.payload({n: t + scale * torch.randn(t.shape, generator=gen) for n, t in update.items()})


def test_a_stream_that_goes_quiet_after_its_header_is_ended(harness: Harness) -> None:
    h = harness
    server = limited(h, stream_idle_s=0.5)
    host, payload = h.hosts[0], good_payload(h)
    with server.client() as client:
        info = client.open_round()
    requests = list(stream(envelope(info, host, payload), host.key, payload))
    started = time.monotonic()
    up = Upload(server, held(requests[:1], requests[1:], threading.Event()))
    up.start()
    assert up.outcome() == "STREAM_TIMEOUT"
    assert up.ended_at - started < 10  # ended by the aggregator's 0.5 s idle limit, not the 60 s hold
    assert "nothing received for 0.5 s" in up.refused.message  # type: ignore[union-attr]
    assert server.engine.store.submissions(h.epoch, 1) == []
    assert not list(server.engine.store.incoming.iterdir())  # the half-received file is gone


def test_a_connection_that_never_sends_a_header_is_ended(harness: Harness) -> None:
    server = limited(harness, stream_idle_s=0.5)
    up = Upload(server, held([], [], threading.Event()))
    up.start()
    assert up.outcome() == "STREAM_TIMEOUT"


def test_an_upload_below_the_minimum_rate_is_ended(harness: Harness) -> None:
    """64 KiB/s minimum after 0.2 s of setup; the payload trickles at ~20 KB/s (4 KB every 0.2 s), each
    chunk well within the idle limit: the total deadline ends it."""
    h = harness
    server = limited(h, stream_idle_s=5.0, stream_setup_s=0.2, min_upload_kib_per_s=64.0)
    host, payload = h.hosts[0], good_payload(h)
    assert len(payload) > 100_000  # at 20 KB/s this takes > 5 s, the deadline is < 2 s + 0.2 s
    with server.client() as client:
        info = client.open_round()

    def trickle() -> Iterator[pb.SubmitRequest]:
        for i, req in enumerate(stream(envelope(info, host, payload), host.key, payload, chunk=4096)):
            if i > 1:
                time.sleep(0.2)
            yield req

    started = time.monotonic()
    up = Upload(server, trickle())
    up.start()
    assert up.outcome(60) == "STREAM_TIMEOUT"
    assert up.ended_at - started < 0.2 + len(payload) / 65536 + 15  # the trickle alone would take > 5 s more
    assert "did not finish in time (the minimum rate is 64 KiB/s" in up.refused.message  # type: ignore[union-attr]
    assert server.engine.store.submissions(h.epoch, 1) == []


def streaming(server: ServerThread, host: Host, timeout_s: float = 30.0) -> None:
    """Wait until `host`'s upload is authenticated and streaming (the aggregator holds it in flight)."""
    until = time.monotonic() + timeout_s
    while host.address not in server.engine._in_flight:
        assert time.monotonic() < until, "the upload never started streaming"
        time.sleep(0.02)


def test_one_stream_per_host_at_a_time(harness: Harness) -> None:
    h = harness
    server = limited(h)
    host, payload = h.hosts[0], good_payload(h)
    with server.client() as client:
        info = client.open_round()
        gate = threading.Event()
        requests = list(stream(envelope(info, host, payload), host.key, payload))
        first = Upload(server, held(requests[:2], requests[2:], gate))
        first.start()
        streaming(server, host)  # the first stream is authenticated and streaming
        with pytest.raises(SubmitRejected) as second:
            client.submit_raw(stream(envelope(info, host, payload), host.key, payload))
        assert second.value.reason == "DUPLICATE" and "upload streaming" in second.value.message
        gate.set()
    assert first.outcome() == "ACCEPTED"


def test_an_exact_copy_of_an_upload_still_streaming_is_refused_as_copy(harness: Harness) -> None:
    """The victim's header names the digest first; the copier's stream would complete first, but is
    refused at authentication, and the victim's upload is then accepted."""
    h = harness
    server = limited(h)
    victim, copier, payload = h.hosts[0], h.hosts[1], good_payload(h)
    with server.client() as client:
        info = client.open_round()
        gate = threading.Event()
        requests = list(stream(envelope(info, victim, payload), victim.key, payload))
        slow = Upload(server, held(requests[:2], requests[2:], gate))
        slow.start()
        streaming(server, victim)
        with pytest.raises(SubmitRejected) as copy:
            client.submit_raw(stream(envelope(info, copier, payload), copier.key, payload))
        assert copy.value.reason == "COPY" and "whose header came first" in copy.value.message
        gate.set()
    assert slow.outcome() == "ACCEPTED"
    server.run(server.engine.checks.drain(h.epoch, 1))  # its checks follow the receipt
    stored = server.engine.store.submissions(h.epoch, 1)
    assert [s.host for s in stored] == [victim.address]


def test_a_perturbed_copy_that_finishes_first_is_the_one_excluded(harness: Harness) -> None:
    """The front-runner sends a near-copy (cosine > 0.99) after the victim's header but completes first:
    at close the near-copy is excluded, not the victim whose header arrived first."""
    h = harness
    server = limited(h)
    victim, copier, third = h.hosts
    honest = h.payload(h.honest_update(victim, 1))
    copy = perturbed(h, honest, 1e-6)
    with server.client() as client:
        info = client.open_round()
        gate = threading.Event()
        requests = list(stream(envelope(info, victim, honest), victim.key, honest))
        slow = Upload(server, held(requests[:2], requests[2:], gate))
        slow.start()
        streaming(server, victim)
        client.submit_raw(stream(envelope(info, copier, copy), copier.key, copy))  # completes first
        gate.set()
        assert slow.outcome() == "ACCEPTED"
        other = h.payload(h.honest_update(third, 1))
        client.submit_raw(stream(envelope(info, third, other), third.key, other))
    assert wait_state(server, h.epoch, 1, ("finalized", "skipped")) == "finalized"
    by_host = {c.host: c for c in server.engine.store.contributions(h.epoch, 1)}
    assert by_host[victim.address].aggregated
    assert not by_host[copier.address].aggregated
    assert any(f"with 0x{victim.address.hex()}, whose header arrived earlier" in r
               for r in by_host[copier.address].reasons)
