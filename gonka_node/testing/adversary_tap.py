"""The adversary kit's network tap: what an eavesdropper on plaintext gRPC sees of hosts' uploads.

Every Submit stream a `TappedClient` sends is *published* once its last byte is on the wire — while the
stream may still be open (a slow link's tail, `hold_s`) — and *finished* when the call ends, with the
aggregator's answer (a plaintext channel shows the status too). Sightings are keyed by the client's
owner and the round its header names, so a copier, mixer, grinder or front-runner can wait for exactly
what it needs. Honest code never sees the tap: `TappedClient` is an `AggregatorClient`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gonka_node.core.client import AggregatorClient, SubmitRejected
from proto.gonka.v1 import aggregator_pb2 as pb

T = TypeVar("T")


@dataclass
class Sighting:
    """One upload as the tap saw it; `done_s` is None while the stream is still open."""

    owner: bytes  # the host whose client sent it (its header may claim another)
    requests: list[pb.SubmitRequest]
    published_s: float  # wall time (time.time()) when its last chunk went out
    done_s: float | None = None
    accepted: bool = False
    reason: str = ""  # RejectReason name (or gRPC status name) when refused

    @property
    def header(self) -> pb.SubmitHeader:
        return self.requests[0].header

    @property
    def payload(self) -> bytes:
        return b"".join(r.chunk for r in self.requests[1:])

    @property
    def digest(self) -> bytes:
        return bytes(self.header.payload_sha256)


class Tap:
    """Every tapped upload, per (owner, round), in the order seen. Thread-safe; waits are event-driven."""

    def __init__(self) -> None:
        self._seen: dict[tuple[bytes, int], list[Sighting]] = {}
        self._changed = threading.Condition()

    def publish(self, owner: bytes, requests: list[pb.SubmitRequest]) -> Sighting:
        sighting = Sighting(owner, requests, time.time())
        with self._changed:
            self._seen.setdefault((owner, requests[0].header.round), []).append(sighting)
            self._changed.notify_all()
        return sighting

    def finish(self, sighting: Sighting, accepted: bool, reason: str) -> None:
        with self._changed:
            sighting.done_s, sighting.accepted, sighting.reason = time.time(), accepted, reason
            self._changed.notify_all()

    def sightings(self, owner: bytes, round_: int) -> list[Sighting]:
        with self._changed:
            return list(self._seen.get((owner, round_), []))

    def completed(self, round_: int) -> dict[bytes, Sighting]:
        """owner → its first upload of `round_` that has ended (the accepted one if any)."""
        out: dict[bytes, Sighting] = {}
        with self._changed:
            for (owner, r), seen in self._seen.items():
                ended = [s for s in seen if s.done_s is not None]
                if r == round_ and ended:
                    out[owner] = next((s for s in ended if s.accepted), ended[0])
        return out

    def accepted_digests(self, round_: int) -> dict[bytes, bytes]:
        """host → payload digest of every upload of `round_` the aggregator accepted (as far as seen)."""
        return {o: s.digest for o, s in self.completed(round_).items() if s.accepted}

    def wait_for(self, found: Callable[[], T | None], what: str, timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (value := found()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the tap saw no {what} within {timeout_s:.0f} s")
                self._changed.wait(min(left, 1.0))
        return value

    def wait_published(self, host: bytes, round_: int, timeout_s: float = 600.0) -> Sighting:
        """`host`'s first upload of `round_` as soon as its last byte is out (its stream may be open)."""
        return self.wait_for(lambda: next(iter(self.sightings(host, round_)), None),
                             f"upload of 0x{host.hex()} in round {round_}", timeout_s)

    def wait_done(self, host: bytes, round_: int, timeout_s: float = 600.0) -> Sighting:
        """`host`'s upload of `round_` once its call has ended (accepted or not)."""
        return self.wait_for(lambda: self.completed(round_).get(host),
                             f"finished upload of 0x{host.hex()} in round {round_}", timeout_s)

    def wait(self, host: bytes, round_: int, timeout_s: float = 600.0) -> list[pb.SubmitRequest]:
        """The request stream of `host`'s finished upload of `round_` (what copiers and replayers resend)."""
        return self.wait_done(host, round_, timeout_s).requests

    def wait_accepted(self, hosts: Sequence[bytes], round_: int, n: int, timeout_s: float = 600.0) -> list[Sighting]:
        """The first `n` accepted uploads of `round_` among `hosts`, in the order they finished."""

        def found() -> list[Sighting] | None:
            done = [s for h, s in self.completed(round_).items() if h in hosts and s.accepted]
            return sorted(done, key=lambda s: s.done_s or 0.0)[:n] if len(done) >= n else None

        return self.wait_for(found, f"{n} accepted uploads in round {round_}", timeout_s)

    @staticmethod
    def payload(requests: list[pb.SubmitRequest]) -> bytes:
        return b"".join(r.chunk for r in requests[1:])


class _Upload:
    """One tapped call: publishes its sighting exactly once, from the stream or after a refusal."""

    def __init__(self, tap: Tap, owner: bytes, requests: list[pb.SubmitRequest]) -> None:
        self.tap, self.owner, self.requests = tap, owner, requests
        self._lock = threading.Lock()
        self._sighting: Sighting | None = None

    def sighting(self) -> Sighting:
        with self._lock:
            if self._sighting is None:
                self._sighting = self.tap.publish(self.owner, self.requests)
            return self._sighting

    def stream(self, hold_s: float) -> Iterator[pb.SubmitRequest]:
        yield from self.requests
        self.sighting()  # every byte is on the wire: an eavesdropper has the whole payload now
        if hold_s > 0:
            time.sleep(hold_s)  # a slow link's tail: the stream stays open, the upload is not complete


class TappedClient(AggregatorClient):
    """A host's client whose uploads the tap sees (the host itself is unchanged). `hold_s` keeps each
    Submit stream open that long after its last chunk, as a slow link would."""

    def __init__(
        self, target: str, tls_cert_pem: bytes, tap: Tap, timeout_s: float = 120.0, *, owner: bytes,
        hold_s: float = 0.0,
    ) -> None:
        super().__init__(target, tls_cert_pem, timeout_s)
        self.tap, self.owner, self.hold_s = tap, owner, hold_s

    def submit_raw(self, requests: Iterator[pb.SubmitRequest]) -> pb.Receipt:
        seen = list(requests)
        if not seen or seen[0].WhichOneof("part") != "header":
            return super().submit_raw(iter(seen))  # no header: nothing an eavesdropper could reuse
        upload = _Upload(self.tap, self.owner, seen)
        try:
            receipt = super().submit_raw(upload.stream(self.hold_s))
        except SubmitRejected as exc:
            self.tap.finish(upload.sighting(), False, exc.reason or exc.code.name)
            raise
        self.tap.finish(upload.sighting(), True, "")
        return receipt


__all__ = ["Sighting", "Tap", "TappedClient"]
