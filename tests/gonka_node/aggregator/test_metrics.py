"""The aggregator's Prometheus metrics, scraped over HTTP from a real round: submissions by outcome,
payload bytes, rounds, close latency; replay results counted from what a closed round recorded."""

from __future__ import annotations

import urllib.request

import pytest
from agg_harness import Harness, Host
from nacl.signing import SigningKey
from prometheus_client.parser import text_string_to_metric_families
from test_round import wait_state

from gonka_node.aggregator.metrics import PrometheusMetrics
from gonka_node.aggregator.replay import MISMATCH, NO_OPENING, PASSED
from gonka_node.aggregator.store import ContributionRow, RoundRow
from gonka_node.core.client import SubmitRejected


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_a_round_as_prometheus_sees_it(harness: Harness) -> None:
    h = harness
    h.schedule(2)
    metrics = PrometheusMetrics()
    port = metrics.serve(0)
    build = h.build_engine

    def with_metrics():  # what `[aggregator] metrics_port` does in gonka-node aggregator
        engine = build()
        engine.metrics = metrics
        return engine

    h.build_engine = with_metrics  # type: ignore[method-assign]
    server = h.start_server()
    stranger = Host(5, h.world.accounts[5], SigningKey(b"\x05" * 32))  # never signed in
    with server.client() as client:
        info = client.open_round()
        first = h.payload(h.honest_update(h.hosts[0], 1))
        client.submit(info, h.hosts[0].address, first, h.hosts[0].key, 1000)
        for who in (h.hosts[0], stranger):  # a second upload, then a host the chain does not know
            with pytest.raises(SubmitRejected):
                client.submit(info, who.address, first, who.key, 1000)
        second = h.payload(h.honest_update(h.hosts[1], 1))
        client.submit(info, h.hosts[1].address, second, h.hosts[1].key, 1000)
        assert wait_state(server, h.epoch, 1, ("finalized",)) == "finalized"
        # The finalize transaction's hash is kept (and logged) rather than "tx ?".
        assert len(server.engine.store.get_round(h.epoch, 1).finalize_tx or b"") == 32
        downloaded = len(client.round_update(h.epoch, 1).data)  # what a host downloads to follow
    got = scrape(port)
    assert downloaded > 0 and got["gonka_aggregator_update_bytes_total"] == downloaded
    assert got["gonka_aggregator_submissions_total{outcome=accepted}"] == 2
    assert got["gonka_aggregator_submissions_total{outcome=DUPLICATE}"] == 1
    assert got["gonka_aggregator_submissions_total{outcome=UNKNOWN_HOST}"] == 1
    assert got["gonka_aggregator_payload_bytes_total"] == len(first) + len(second)
    assert got["gonka_aggregator_rounds_total{state=finalized}"] == 1 and got["gonka_aggregator_round"] == 1
    assert got["gonka_aggregator_close_seconds_count"] == 1 and got["gonka_aggregator_close_seconds_sum"] > 0
    assert "gonka_aggregator_replays_total{result=match}" not in got  # this epoch replays nobody


def test_replay_results_are_counted_from_the_closed_rounds_contributions() -> None:
    metrics = PrometheusMetrics()
    row = RoundRow(epoch=1, round=3, state="finalized", base_sha256=bytes(32), deadline_ms=0, extensions=0,
                   opened_ms=0)
    contributions = [
        ContributionRow(b"\x01" * 20, 0.5, 10, True, [f"{PASSED} cosine +1.0000, norm ratio 1.0000 with …"]),
        ContributionRow(b"\x02" * 20, 0.5, 10, True, [f"{PASSED} cosine +0.9999, norm ratio 1.0001 with …"]),
        ContributionRow(b"\x03" * 20, 0.0, 0, False, [f"{MISMATCH}: cosine +0.1000 with the replay …"]),
        ContributionRow(b"\x04" * 20, 0.4, 10, True, ["not picked for replay this round"]),
    ]
    metrics.round_closed(row, 2.5, contributions)
    metrics.round_closed(RoundRow(1, 4, "skipped", bytes(32), 0, 0, 0), 0.1, [])
    got = {f"{s.name}{s.labels}": s.value for f in metrics.registry.collect() for s in f.samples}
    assert got["gonka_aggregator_replays_total{'result': 'match'}"] == 2
    assert got["gonka_aggregator_replays_total{'result': 'mismatch'}"] == 1
    assert got["gonka_aggregator_rounds_total{'state': 'finalized'}"] == 1
    assert got["gonka_aggregator_rounds_total{'state': 'skipped'}"] == 1
    assert got["gonka_aggregator_round{}"] == 4 and got["gonka_aggregator_close_seconds_sum{}"] == pytest.approx(2.6)


def test_a_challenged_host_that_did_not_open_is_counted_apart() -> None:
    metrics = PrometheusMetrics()
    row = RoundRow(epoch=1, round=2, state="finalized", base_sha256=bytes(32), deadline_ms=0, extensions=0,
                   opened_ms=0)
    metrics.round_closed(row, 1.0, [
        ContributionRow(b"\x01" * 20, 0.0, 0, False, [f"{NO_OPENING}: the residual was not opened by …"]),
        ContributionRow(b"\x02" * 20, 0.0, 0, False, [f"{MISMATCH}: e_r's opened chunks do not verify …"]),
    ])
    got = {f"{s.name}{s.labels}": s.value for f in metrics.registry.collect() for s in f.samples}
    assert got["gonka_aggregator_replays_total{'result': 'no_opening'}"] == 1
    assert got["gonka_aggregator_replays_total{'result': 'mismatch'}"] == 1
    assert "gonka_aggregator_replays_total{'result': 'match'}" not in got
