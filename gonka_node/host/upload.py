"""One round's payload uploading in a thread while the host trains the next round (overlapped rounds).

The upload waits for its round to open at the aggregator (a host with `overlap = "delayed"` trains a
round before the previous one has closed), checks that the aggregator names the base it trained from,
and submits. The host joins it after its next round's training, so at most one upload is in flight and
the daemon's own thread records the outcome (no shared state is written from here). In a top-k epoch
the thread also answers the round's challenge (docs/PROTOCOL.md "Challenge and opening"): it comes
while the round closes, when the daemon is training the next round, and is due before the round can
close and the next one open, which is what this thread waits for to fetch the round's update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from gonka_node.host.follow import NextModel
from gonka_node.host.writer import WriteError, Written
from proto.gonka.v1 import aggregator_pb2 as pb
from training.diloco import SpeculativeStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UploadResult:
    accepted: bool
    reason: str  # "" when accepted at once; the refusal otherwise
    seconds: float  # from the first payload byte to the receipt
    update: bytes | None = None  # the round's aggregated update, fetched as soon as the round closed
    ahead: NextModel | None = None  # the model after the round, computed from that update in this thread


OpenRound = Callable[[], "pb.RoundInfo | None"]
# (info, payload, tokens, cancelled): `cancelled()` says the upload was cancelled (stop waiting)
Submit = Callable[[pb.RoundInfo, bytes, int, Callable[[], bool]], tuple[bool, str]]
Prefetch = Callable[[], bytes]  # the round's aggregated update; raises grpc.RpcError when there is none
# the part of the round's outer step that needs no update (`follow.speculate`), run in its own thread
# while the payload uploads, from when the daemon holds the base; given `cancelled`
Speculate = Callable[[Callable[[], bool]], "SpeculativeStep | None"]
# the model after the round, from its update's bytes and what `Speculate` computed (None: nothing);
# given `cancelled`
Prepare = Callable[[bytes, "SpeculativeStep | None", Callable[[], bool]], "NextModel | None"]
# asks whether the round's submission is challenged (GetSubmission) and opens it if so; True once
# settled (opened, refused, or no challenge will come), False: ask again at the next poll
Answer = Callable[[pb.RoundInfo], bool]


class SubmitOutcome:
    """Whether the aggregator took an upload's payload, once it answered: what the next round's challenge
    answer needs of the upload before it, without holding the upload (and the models it computed)."""

    def __init__(self) -> None:
        self._answered = threading.Event()  # the aggregator answered the submit, or the upload gave up
        self._accepted = False

    def set(self, accepted: bool) -> None:
        self._accepted = accepted
        self._answered.set()

    def settle(self) -> None:
        """The upload is over: whoever waits for an answer has it (not accepted, unless `set` said so)."""
        self._answered.set()

    @property
    def taken(self) -> bool:
        """Accepted as far as known now (no wait)."""
        return self._accepted

    def accepted(self) -> bool:
        """Waits for the answer (not the download that follows it)."""
        self._answered.wait()
        return self._accepted


class PendingUpload:
    def __init__(
        self, round_: int, base_sha256: bytes, payload: bytes | Callable[[], bytes], tokens: int,
        open_round: OpenRound, submit: Submit, poll_s: float, prefetch: Prefetch | None = None,
        prepare: Prepare | None = None, answer: Answer | None = None, speculate: Speculate | None = None,
        kept: Written | None = None, take_after: bool = False,
    ) -> None:
        """`kept`: the round's save before its upload (`HostStore.save_sent`, written behind by the
        daemon's writer): nothing is sent before it is on disk, and nothing if it failed. `payload`: the
        bytes, or what gives them once the round is sealed (host/sealing.py; read only after `kept`).
        `take_after`: with a step taken ahead handed over (`release_base`), also take the next step's +0
        part on its +0 model while the upload is in flight (`SpeculativeStep.take_after`: an eager host's
        next round starts from it, fixed once this round's update is there)."""
        self.round, self.base_sha256, self.tokens = round_, base_sha256, tokens
        self._payload = payload
        self._open_round, self._submit, self._poll_s, self._prefetch = open_round, submit, poll_s, prefetch
        self._prepare, self._answer, self._speculate, self._kept = prepare, answer, speculate, kept
        self._take_after = take_after
        self._speculation: SpeculativeStep | None = None
        self._speculating: threading.Thread | None = None
        self._cancelled = threading.Event()
        self._over = threading.Event()  # the upload is over: a next step taken ahead has no use any more
        self._base_ready = threading.Event()
        self._base_held = False
        self.outcome = SubmitOutcome()
        self.recorded = False  # the daemon recorded the outcome (`HostNode._settle`, once)
        self._result = UploadResult(False, "the upload did not run", 0.0)
        self._thread = threading.Thread(target=self._run, name=f"upload-round-{round_}", daemon=True)

    @property
    def payload(self) -> bytes:
        """The round's payload (a round sealed behind: once its seal is done, which this waits for)."""
        if callable(self._payload):
            self._payload = self._payload()
        return self._payload

    def start(self) -> PendingUpload:
        self._thread.start()
        return self

    def release_base(self, held: bool, speculated: SpeculativeStep | None = None) -> None:
        """The daemon holds (`held`) the model after round − 1 and will not change it until it joins this
        upload: the thread may compute the next model from it. Called once per upload, held or not.
        `speculated`: this round's step from that model, already taken ahead of the update (the thread
        then takes none of its own)."""
        self._base_held = held
        if held and speculated is not None:
            self._speculation = speculated
            if self._take_after and self._prepare is not None:
                self._speculating = threading.Thread(
                    target=self._run_after, args=(speculated,), name=f"after-round-{self.round}", daemon=True
                )
                self._speculating.start()
        elif held and self._speculate is not None and self._prepare is not None:
            self._speculating = threading.Thread(
                target=self._run_speculation, name=f"speculate-round-{self.round}", daemon=True
            )
            self._speculating.start()
        self._base_ready.set()

    def cancel(self) -> None:
        """Stop waiting for the round to open (the epoch ended, or the round closed without it)."""
        self._cancelled.set()

    def accepted(self) -> bool:
        """Whether the aggregator took the payload (DUPLICATE included), once it answered: what an eager
        host's next round may forecast with (training/overlap.py). Waits for the answer, not the download."""
        return self.outcome.accepted()

    def wait(self) -> UploadResult:
        """The outcome, once the upload's thread and the speculation (which reads the held model) are done.
        The upload lets go of what it computed then: the daemon takes it from the result."""
        self._thread.join()
        if self._speculating is not None:
            self._speculating.join()
        self._speculation = None
        return self._result

    def _run_speculation(self) -> None:
        assert self._speculate is not None
        try:
            self._speculation = self._speculate(self._cancelled.is_set)
        except Exception:  # the step is then taken whole from the update, as without speculation
            log.exception("round %d: the outer step ahead of the update failed", self.round)

    def _run_after(self, speculated: SpeculativeStep) -> None:
        try:
            speculated.take_after(lambda: self._cancelled.is_set() or self._over.is_set())
        except Exception:  # the next step is then taken whole once the model after this round exists
            log.exception("round %d: the next round's step ahead of this round's update failed", self.round)

    def _run(self) -> None:
        try:
            self._result = self._upload()
        except Exception as exc:  # reported by the daemon's thread, never lost silently; a payload the
            # aggregator took stays accepted when what follows (the challenge, the download) failed
            self._result = UploadResult(self.outcome.taken, f"upload failed: {type(exc).__name__}: {exc}", 0.0)
        finally:
            self._over.set()  # the model after the round was computed (or will not be): stop what it needed
            self.outcome.settle()

    def _upload(self) -> UploadResult:
        try:
            while self._kept is not None and not self._kept.wait(self._poll_s):
                if self._cancelled.is_set():
                    return UploadResult(False, f"round {self.round}: cancelled before the round was saved", 0.0)
        except WriteError as exc:  # a crash after the aggregator took it could not recover it: not sent
            return UploadResult(False, f"round {self.round} was not sent: its save before the upload failed ({exc})",
                                0.0)
        while not self._cancelled.is_set():
            info = self._open_round()
            if info is None or info.round < self.round:
                self._cancelled.wait(self._poll_s)
                continue
            if info.round > self.round:
                return UploadResult(False, f"LATE: round {self.round} closed before this upload reached it", 0.0)
            if bytes(info.base_checkpoint_sha256) != self.base_sha256:
                return UploadResult(
                    False, f"STALE_BASE: the aggregator's base {bytes(info.base_checkpoint_sha256).hex()[:16]}… "
                    f"is not the model this round trained from ({self.base_sha256.hex()[:16]}…)", 0.0,
                )
            started = time.monotonic()
            accepted, reason = self._submit(info, self.payload, self.tokens, self._cancelled.is_set)
            seconds = time.monotonic() - started
            self.outcome.set(accepted)
            update = self._fetch_update(info if accepted else None)
            return UploadResult(accepted, reason, seconds, update, self._step_ahead(update))
        return UploadResult(False, f"LATE: round {self.round} never opened to this upload", 0.0)

    def _step_ahead(self, update: bytes | None) -> NextModel | None:
        """The outer step and hash of the next model, here rather than on the training path (they take
        as long as minutes of a CPU for a 1B model). The daemon checks the hash against the chain."""
        if update is None or self._prepare is None:
            return None
        while not self._base_ready.wait(self._poll_s):
            if self._cancelled.is_set():
                return None
        if not self._base_held:
            return None
        if self._speculating is not None:
            self._speculating.join()
        speculated, self._speculation = self._speculation, None
        try:
            return self._prepare(update, speculated, self._cancelled.is_set)
        except Exception:  # the upload and its update stand; the daemon takes the step itself (follows)
            log.exception("round %d: the next model could not be computed ahead from the update", self.round)
            return None

    def _fetch_update(self, submitted: pb.RoundInfo | None) -> bytes | None:
        """The round's aggregated update, downloaded once the next round opens (this one has closed),
        so the download too runs behind the next round's compute; meanwhile the challenge of the round
        (`submitted`: its info, when the aggregator took the payload) is answered. None: no update (a
        skipped round, an outage, the epoch over): the daemon fetches or pulls what it needs itself, and
        checks it either way."""
        settled = submitted is None or self._answer is None
        while not self._cancelled.is_set():
            if not settled:
                assert submitted is not None and self._answer is not None
                settled = self._answer(submitted)
            if self._prefetch is None:
                if settled:
                    return None
                self._cancelled.wait(self._poll_s)
                continue
            info = self._open_round()
            if info is None or info.round <= self.round:
                self._cancelled.wait(self._poll_s)
                continue
            try:
                return self._prefetch()
            except grpc.RpcError:
                return None
        return None
