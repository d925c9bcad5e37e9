"""What a host reports while it works: progress bars, log lines, Prometheus metrics.

The node calls one `HostEvents` object; the CLI composes the ones it wants, so the loop knows nothing
of rich or Prometheus. `HostEvents` itself does nothing: exactly one sink, `LogEvents`, writes log lines,
so a composition of sinks logs each event once (bars and metrics used to inherit the log lines, and a
host printed each one two or three times).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from chain.units import format_gnk

log = logging.getLogger("gonka_node.host")


class HostEvents:
    """What a host reports; every method does nothing here (sinks override what they show)."""

    def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
        pass

    def round_trained(self, round_: int, loss: float, tokens: int, seconds: float, payload_bytes: int) -> None:
        pass

    def submitted(self, round_: int, accepted: bool, reason: str, seconds: float) -> None:
        pass

    def round_applied(self, round_: int, how: str, sha256: bytes, reward: int, latency_s: float) -> None:
        pass

    def downloaded(self, round_: int, nbytes: int) -> None:
        """Bytes of a round's aggregated update (or checkpoint) downloaded to follow the global model."""

    def utilisation(self, round_: int, busy_s: float, wall_s: float) -> None:
        """A round's seconds in inner steps against the wall seconds since the previous round's
        training ended (what a host computes of the time it is up)."""

    def note(self, message: str) -> None:
        pass


class LogEvents(HostEvents):
    """Structured log lines: one per event."""

    def round_trained(self, round_: int, loss: float, tokens: int, seconds: float, payload_bytes: int) -> None:
        log.info(
            "round %d: trained %d tokens in %.1f s, last loss %.4f, payload %d bytes",
            round_, tokens, seconds, loss, payload_bytes,
        )

    def submitted(self, round_: int, accepted: bool, reason: str, seconds: float) -> None:
        if accepted and reason:
            log.info("round %d: submission accepted earlier (aggregator answered %s)", round_, reason)
        elif accepted:
            log.info("round %d: submission accepted (%.2f s upload)", round_, seconds)
        else:
            log.warning("round %d: submission not accepted: %s", round_, reason)

    def round_applied(self, round_: int, how: str, sha256: bytes, reward: int, latency_s: float) -> None:
        log.info(
            "round %d: global model %s… (%s), reward %s, %.1f s after submitting",
            round_, sha256.hex()[:16], how, format_gnk(reward), latency_s,
        )

    def utilisation(self, round_: int, busy_s: float, wall_s: float) -> None:
        log.info("round %d: utilisation %.3f (%.1f s of inner steps in %.1f s)", round_,
                 busy_s / wall_s if wall_s > 0 else 0.0, busy_s, wall_s)

    def note(self, message: str) -> None:
        log.info("%s", message)


class MultiEvents(HostEvents):
    def __init__(self, sinks: Sequence[HostEvents]) -> None:
        self.sinks = list(sinks)

    def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
        for s in self.sinks:
            s.inner_step(round_, step, total, loss)

    def round_trained(self, round_: int, loss: float, tokens: int, seconds: float, payload_bytes: int) -> None:
        for s in self.sinks:
            s.round_trained(round_, loss, tokens, seconds, payload_bytes)

    def submitted(self, round_: int, accepted: bool, reason: str, seconds: float) -> None:
        for s in self.sinks:
            s.submitted(round_, accepted, reason, seconds)

    def round_applied(self, round_: int, how: str, sha256: bytes, reward: int, latency_s: float) -> None:
        for s in self.sinks:
            s.round_applied(round_, how, sha256, reward, latency_s)

    def downloaded(self, round_: int, nbytes: int) -> None:
        for s in self.sinks:
            s.downloaded(round_, nbytes)

    def utilisation(self, round_: int, busy_s: float, wall_s: float) -> None:
        for s in self.sinks:
            s.utilisation(round_, busy_s, wall_s)

    def note(self, message: str) -> None:
        for s in self.sinks:
            s.note(message)


class MetricsEvents(HostEvents):
    """Prometheus metrics on an own registry (several nodes can share a process in tests)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.loss = Gauge("gonka_host_inner_loss", "last inner-step training loss", registry=self.registry)
        self.tokens_per_s = Gauge("gonka_host_tokens_per_second", "inner-loop throughput", registry=self.registry)
        self.bytes_sent = Counter("gonka_host_payload_bytes", "payload bytes submitted", registry=self.registry)
        self.bytes_received = Counter(
            "gonka_host_download_bytes", "aggregated-update and checkpoint bytes downloaded", registry=self.registry
        )
        self.round_latency = Gauge(
            "gonka_host_round_latency_seconds", "submission to applied global model", registry=self.registry
        )
        self.rewards = Counter("gonka_host_rewards_ngonka", "rewards earned", registry=self.registry)
        self.rounds = Counter("gonka_host_rounds", "rounds applied", registry=self.registry)
        self.round = Gauge("gonka_host_round", "last round applied to the held global model", registry=self.registry)
        self.submissions = Counter(
            "gonka_host_submissions", "uploads by outcome", ["result"], registry=self.registry
        )
        self.utilisation_ratio = Gauge(
            "gonka_host_utilisation", "last round's share of wall time in inner steps", registry=self.registry
        )
        self.inner_seconds = Counter(
            "gonka_host_inner_seconds", "wall seconds spent in inner steps", registry=self.registry
        )
        self.wall_seconds = Counter(
            "gonka_host_wall_seconds", "wall seconds the rounds took, inner steps included", registry=self.registry
        )

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)

    def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
        self.loss.set(loss)

    def round_trained(self, round_: int, loss: float, tokens: int, seconds: float, payload_bytes: int) -> None:
        self.tokens_per_s.set(tokens / seconds if seconds > 0 else 0.0)
        self.bytes_sent.inc(payload_bytes)

    def submitted(self, round_: int, accepted: bool, reason: str, seconds: float) -> None:
        self.submissions.labels(result="accepted" if accepted else "refused").inc()

    def round_applied(self, round_: int, how: str, sha256: bytes, reward: int, latency_s: float) -> None:
        self.rounds.inc()
        self.round.set(round_)
        self.rewards.inc(reward)
        self.round_latency.set(latency_s)

    def utilisation(self, round_: int, busy_s: float, wall_s: float) -> None:
        self.utilisation_ratio.set(busy_s / wall_s if wall_s > 0 else 0.0)
        self.inner_seconds.inc(busy_s)
        self.wall_seconds.inc(wall_s)

    def downloaded(self, round_: int, nbytes: int) -> None:
        self.bytes_received.inc(nbytes)
