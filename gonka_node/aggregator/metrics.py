"""What an aggregator reports to Prometheus: rounds, submissions by outcome, bytes in, close latency,
replay results.

The engine and the servicer call one `RoundMetrics` object, a no-op by default; `PrometheusMetrics`
counts on its own registry (several aggregators can share a process in tests) and `serve(port)` exposes
it on 127.0.0.1 (`[aggregator] metrics_port`). Names:

| metric | kind | labels |
|---|---|---|
| `gonka_aggregator_rounds_total` | counter | `state`: finalized, skipped |
| `gonka_aggregator_round` | gauge | the latest round closed |
| `gonka_aggregator_submissions_total` | counter | `outcome`: accepted (receipted), or the rejection reason (LATE, COPY, …; a decode-time reason when a receipted payload fails its checks) |
| `gonka_aggregator_payload_bytes_total` | counter | payload bytes of accepted submissions |
| `gonka_aggregator_update_bytes_total` | counter | aggregated-update bytes served (`GetRoundUpdate`: hosts' downloads) |
| `gonka_aggregator_close_seconds` | histogram | from a round's close to its result recorded (chain included) |
| `gonka_aggregator_replays_total` | counter | `result`: match, mismatch, no_opening (a challenged top-k host that did not open) |
"""

from __future__ import annotations

from gonka_node.aggregator.replay import MISMATCH, NO_OPENING, PASSED
from gonka_node.aggregator.store import ContributionRow, RoundRow

CLOSE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class RoundMetrics:
    """The events an aggregator reports; this base does nothing with them."""

    def submission(self, outcome: str, payload_bytes: int = 0) -> None:
        pass

    def round_closed(self, row: RoundRow, seconds: float, contributions: list[ContributionRow]) -> None:
        pass

    def update_served(self, update_bytes: int) -> None:
        pass

    @property
    def wants_contributions(self) -> bool:
        """Whether `round_closed` looks at the contributions (the engine reads them from disk only then)."""
        return False


class PrometheusMetrics(RoundMetrics):
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.rounds = Counter("gonka_aggregator_rounds", "rounds closed, by how they ended", ["state"],
                              registry=self.registry)
        self.round = Gauge("gonka_aggregator_round", "the latest round closed", registry=self.registry)
        self.submissions = Counter("gonka_aggregator_submissions", "uploads by outcome", ["outcome"],
                                   registry=self.registry)
        self.payload_bytes = Counter("gonka_aggregator_payload_bytes", "payload bytes of accepted submissions",
                                     registry=self.registry)
        self.close_seconds = Histogram("gonka_aggregator_close_seconds", "from a round's close to its result "
                                       "recorded, the chain transaction included", buckets=CLOSE_BUCKETS,
                                       registry=self.registry)
        self.replays = Counter("gonka_aggregator_replays", "replayed host-rounds by result", ["result"],
                               registry=self.registry)
        self.update_bytes = Counter("gonka_aggregator_update_bytes", "aggregated-update bytes served to hosts",
                                    registry=self.registry)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose /metrics on addr:port (0: any free port); returns the port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)

    @property
    def wants_contributions(self) -> bool:
        return True

    def submission(self, outcome: str, payload_bytes: int = 0) -> None:
        self.submissions.labels(outcome=outcome).inc()
        self.payload_bytes.inc(payload_bytes)

    def update_served(self, update_bytes: int) -> None:
        self.update_bytes.inc(update_bytes)

    def round_closed(self, row: RoundRow, seconds: float, contributions: list[ContributionRow]) -> None:
        self.rounds.labels(state=row.state).inc()
        self.round.set(row.round)
        self.close_seconds.observe(seconds)
        for c in contributions:
            if any(r.startswith(MISMATCH) for r in c.reasons):
                self.replays.labels(result="mismatch").inc()
            elif any(r.startswith(PASSED) for r in c.reasons):
                self.replays.labels(result="match").inc()
            elif any(r.startswith(NO_OPENING) for r in c.reasons):
                self.replays.labels(result="no_opening").inc()
