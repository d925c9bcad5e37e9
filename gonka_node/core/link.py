"""Shaped links: a host's upload and download paced like a home connection, on loopback.

`TokenBucket` is the whole model of a link direction: bytes pass at `rate` bytes per second, a burst of
`burst` bytes may go at once, and each transfer waits `latency_s` before its first byte. Its arithmetic
(`reserve`) takes the time as an argument, so the benchmark (scripts/bench_wan.py) runs the very same
limiter on a simulated clock, while a host's gRPC client sleeps on it (`pace`; `pace_async` for asyncio
code). Every transfer that reserves its bytes goes through the bucket in order, as on one wire.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MBIT = 1_000_000 / 8  # bytes per second in one Mbit/s (decimal, as ISPs sell links)


class LinkError(ValueError):
    """A link given as text that is not DOWN/UP in Mbit/s (with an optional @LATENCYms)."""


@dataclass(frozen=True)
class LinkSpec:
    down_mbps: float
    up_mbps: float
    latency_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """`"100/10"` (Mbit/s down/up) or `"100/10@20"` (and 20 ms before each transfer's first byte)."""
        rates, _, latency = text.partition("@")
        down, sep, up = rates.partition("/")
        try:
            spec = cls(float(down), float(up), float(latency) if latency else 0.0)
        except ValueError:
            raise LinkError(f"link {text!r}: give DOWN/UP in Mbit/s, e.g. 100/10 or 100/10@20 (ms)") from None
        if not sep or min(spec.down_mbps, spec.up_mbps) <= 0 or spec.latency_ms < 0:
            raise LinkError(f"link {text!r}: give positive DOWN/UP rates in Mbit/s, e.g. 100/10")
        return spec

    def text(self) -> str:
        rates = f"{self.down_mbps:g}/{self.up_mbps:g}"
        return rates + (f"@{self.latency_ms:g}" if self.latency_ms else "")

    def buckets(self, clock: Callable[[], float] = time.monotonic) -> Link:
        latency = self.latency_ms / 1000
        return Link(TokenBucket(self.down_mbps * MBIT, latency_s=latency, clock=clock),
                    TokenBucket(self.up_mbps * MBIT, latency_s=latency, clock=clock))


class TokenBucket:
    """One direction of a link. `burst` defaults to 10 ms of traffic (a modem's queue, not a free
    megabyte)."""

    def __init__(self, rate: float, burst: float | None = None, latency_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if rate <= 0:
            raise ValueError(f"TokenBucket: rate must be > 0 bytes/s, got {rate}")
        self.rate, self.latency_s, self.clock, self.sleep = rate, latency_s, clock, sleep
        self.burst = rate / 100 if burst is None else burst
        self._free_at = -float("inf")  # when the bytes reserved so far have all passed
        self._lock = threading.Lock()

    def reserve(self, n: int, now: float, first: bool = False) -> float:
        """Reserve `n` bytes at time `now`; returns when they have passed (the caller waits until then).
        `first`: the transfer's first bytes, which also wait the link's latency."""
        with self._lock:
            start = max(now + (self.latency_s if first else 0.0), self._free_at - self.burst / self.rate)
            self._free_at = max(start, self._free_at) + n / self.rate
            return max(now, self._free_at - self.burst / self.rate)

    def pace(self, n: int, first: bool = False) -> None:
        """Block until `n` more bytes may have passed (call per chunk, before sending or after receiving)."""
        now = self.clock()
        self.sleep(max(0.0, self.reserve(n, now, first) - now))

    async def pace_async(self, n: int, first: bool = False) -> None:
        now = self.clock()
        await asyncio.sleep(max(0.0, self.reserve(n, now, first) - now))


@dataclass(frozen=True)
class Link:
    down: TokenBucket
    up: TokenBucket
