"""A top-k host's part in the challenge of its rounds (docs/PROTOCOL.md "Challenge and opening").

Apart from the daemon's loop (`node.HostNode`) because it is one concern with its own inputs: after an
accepted upload the host asks `GetSubmission` whether the replay challenged the round, opens the chunks
it was asked for (`opening.build_opening`) and sends them; a round whose payload FAILED its checks is
undone here too, since that decides the e_{r−1} the next opening must match. `Challenges` holds only
what that takes (the aggregator, the chain, the signing key, the kept-state store, the worker, the
model's shapes); the daemon owns one and calls it from its own thread (overlap "off") or hands
`answerer` to a round's upload thread (overlapped rounds).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import grpc
from nacl.signing import SigningKey
from torch import Tensor

from chain.client import ChainClient
from gonka_node.core.client import AggregatorClient, SubmitRejected
from gonka_node.core.recipe import Recipe
from gonka_node.host.events import HostEvents
from gonka_node.host.opening import ChallengeRefused, build_opening, sample_settings, signed_roots
from gonka_node.host.rig_round import Rounds
from gonka_node.host.settings import RETRYABLE, HostSettings
from gonka_node.host.store import HostStore, Progress
from gonka_node.host.upload import PendingUpload
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import common_pb2 as common
from training.codecs import get_codec
from training.residual_commit import commitment_layout

# the chunk of an opening's body when the round's limit is not known (a host restarted before this
# version recorded it): well under any aggregator's `max_chunk_bytes`
OPENING_CHUNK = 64 << 10


def opens_residual(recipe: Recipe) -> bool:
    """Whether the epoch's rounds can be challenged (its codec opens the residual: top-k)."""
    return get_codec(recipe.codec).opens_residual


def opens_kept_state(recipe: Recipe) -> bool:
    """Whether a challenge opens the state kept with its round rather than the worker's: an overlapped
    host has trained (compressed) the next round by then."""
    return opens_residual(recipe) and recipe.overlap != "off"


@dataclass
class Challenges:
    """Answers the challenges of this host's rounds. `before_round` and `residual_roots` are the daemon's
    own dicts (shared, not copied): round → the worker state before it (a rollback point, kept until the
    round's checks are known), and round → the root of the residual its training left."""

    aggregator: AggregatorClient
    chain: ChainClient
    settings: HostSettings
    recipe: Recipe
    host: bytes  # this host's address, as the aggregator keys its submissions
    key: SigningKey  # the node key: an opening is signed like a payload
    store: HostStore  # the state kept with each round (an overlapped host opens it)
    rounds: Rounds
    spec: Mapping[str, tuple[int, ...]]  # the model's shapes: the commitment's chunk layout
    events: HostEvents
    sleep: Callable[[float], None]
    open_round: Callable[[], pb.RoundInfo | None]  # the daemon's GetOpenRound (None: none open now)
    before_round: dict[int, Mapping[str, Any]]
    residual_roots: dict[int, bytes]

    def __post_init__(self) -> None:
        self.challengeable = opens_residual(self.recipe)
        self.kept_state = opens_kept_state(self.recipe)

    def await_verdict(self, info: pb.RoundInfo, progress: Progress) -> None:
        """Wait until the chain finalizes a round this host submitted to; in a top-k epoch ask meanwhile
        whether the replay challenged the round (GetSubmission) and answer once (an overlapped host asks
        from the round's upload thread instead: `answerer`)."""
        if not self.challengeable:
            return self._wait_finalized(info.round)
        answered = False
        while self.chain.latest_round(self.settings.epoch) < info.round:
            answered = answered or self.answer(info, progress)
            self.sleep(self.settings.poll_s)
        if not answered:  # final before this host heard the checks' verdict: it still decides e_{r−1}
            self._check_failed(info, progress)
        self.before_round.pop(info.round, None)
        return None

    def _wait_finalized(self, round_: int) -> None:
        while self.chain.latest_round(self.settings.epoch) < round_:
            self.sleep(self.settings.poll_s)

    def _check_failed(self, info: pb.RoundInfo, progress: Progress) -> None:
        try:
            status = self.aggregator.submission(info.epoch, info.round, self.host)
        except grpc.RpcError:  # unknown: the residual stays (a mismatch later costs an opening, not stake)
            return
        if status.state == pb.SubmissionStatus.FAILED:
            self._forget_failed(info.round, progress, status)

    def _forget_failed(self, round_: int, progress: Progress, status: pb.SubmissionStatus) -> None:
        """Round `round_`'s payload got a receipt, then failed its checks: it is no submission (the
        aggregator's e_{r−1} is the residual after the host's last *checked* one), so the round leaves no
        trace, as a refused one: the worker state goes back to before it and its root is forgotten."""
        before = self.before_round.pop(round_, None)
        if before is not None:
            self.rounds.load_state_dict(before)
        progress.submitted.pop(str(round_), None)
        progress.residual_roots.pop(str(round_), None)
        self.events.note(f"round {round_}: its payload failed the aggregator's checks "
                         f"({common.RejectReason.Name(status.reason).removeprefix('REJECT_')}: {status.message}); "
                         "the round is undone" + ("" if before is not None else " (no state before it was kept)"))

    def await_closing(self, round_: int, progress: Progress) -> None:
        """`await_verdict` for a round this host submitted to that is no longer open and not yet final
        (the host restarted meanwhile: it may be challenged now). What the opening's header binds is
        the chain's (its id, the registry); the chunk limit is the one of the last round this host
        opened (`Progress.max_chunk_bytes`)."""
        info = self._info_of(round_, progress)
        if str(round_) in progress.submitted and info is not None:
            self.await_verdict(info, progress)

    def _info_of(self, round_: int, progress: Progress) -> pb.RoundInfo | None:
        """What an opening of `round_` binds, from the chain (None: no deployment known)."""
        deployment = self.chain.deployment
        if deployment is None:
            return None
        return pb.RoundInfo(chain_id=self.chain.chain_id, registry=bytes.fromhex(deployment.registry.removeprefix("0x")),
                            epoch=self.settings.epoch, round=round_,
                            limits=pb.Limits(max_chunk_bytes=progress.max_chunk_bytes))

    def _opened_residuals(self, round_: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """e_{r−1} and e_r of `round_`: the worker's own (it has trained nothing since), or, overlapped,
        those of the state kept with the round, memory-mapped: no second copy is held for the round's
        length, and only the opened chunks are read."""
        if not self.kept_state:
            return self.rounds.residuals()
        try:
            return self.rounds.residuals_of(self.store.load_sent_state(round_, mmap=True))
        except (OSError, RuntimeError, KeyError) as exc:  # RigError is a RuntimeError
            raise ChallengeRefused(f"round {round_}: the state kept with the round is unreadable "
                                   f"({type(exc).__name__}: {exc}); not opened") from exc

    def answerer(
        self, r: int, earlier: PendingUpload | None, progress: Progress
    ) -> Callable[[pb.RoundInfo], bool] | None:
        """What round r's upload thread calls until round r's challenge is settled (None: the codec opens
        nothing). It reads a copy of the progress taken here, on the daemon's thread, plus round r's own
        root and, once the aggregator took it, `earlier`'s (the upload still in flight, recorded only
        after round r + 1 trains): e_{r−1}'s root is the one of the host's last accepted round. The roots
        are read when the answer is asked for: an overlapped host hashes a round's root where it saves the
        round, beside the next round (`HostSaves._keep_behind`), and the upload, after which the answer
        is asked for, waits for that save (and `earlier`'s was asked for before it)."""
        if not self.challengeable:
            return None
        known = replace(progress, submitted=dict(progress.submitted), residual_roots=dict(progress.residual_roots))
        # What of `earlier` the answer needs, not `earlier` itself: an upload holds what it computed (the
        # next model, its step taken ahead) and its own answer, so holding it would keep every round's.
        before = None if earlier is None else (
            earlier.round, hashlib.sha256(earlier.payload).hexdigest(), earlier.outcome,
        )

        def answer(info: pb.RoundInfo) -> bool:
            if r in self.residual_roots:  # else recorded before a restart: the progress has it
                known.residual_roots[str(r)] = self.residual_roots[r].hex()
            if before is not None and before[2].accepted():
                known.submitted.setdefault(str(before[0]), before[1])
                known.residual_roots[str(before[0])] = self.residual_roots[before[0]].hex()
            return self.answer(info, known)

        return answer

    def answer_restarted(self, progress: Progress, latest: int) -> threading.Event | None:
        """An overlapped top-k host restarted after its newest round's upload, before that round was
        final: the challenge its upload thread would have answered, asked for from a thread until settled
        or the next round opens, while training goes on (`await_closing` for overlap "off"). The event
        stops it; None: nothing to ask."""
        newest = max((int(k) for k in progress.submitted), default=0)
        info = self._info_of(newest, progress)
        if not self.kept_state or newest <= latest or info is None:
            return None
        answer = self.answerer(newest, None, progress)
        assert answer is not None  # kept_state: the codec opens its residual
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set() and not answer(info):
                now = self.open_round()
                if now is not None and now.round > newest:  # round `newest` closed: no challenge is due
                    return
                stop.wait(self.settings.poll_s)

        threading.Thread(target=ask, name=f"challenge-round-{newest}", daemon=True).start()
        return stop

    def answer(self, info: pb.RoundInfo, progress: Progress) -> bool:
        """Whether the round's challenge is settled: answered, refused, or none will come (the
        submission failed its checks, or is opened already). False: ask again."""
        try:
            status = self.aggregator.submission(info.epoch, info.round, self.host)
        except grpc.RpcError:  # unreachable for now: ask again at the next poll
            return False
        if status.state in (pb.SubmissionStatus.PENDING, pb.SubmissionStatus.CHECKED):
            return False
        if status.state == pb.SubmissionStatus.FAILED:
            self._forget_failed(info.round, progress, status)
        if status.state != pb.SubmissionStatus.CHALLENGED:
            return True
        layout = commitment_layout(self.spec, get_codec(self.recipe.codec))
        try:
            roots = signed_roots(progress, info.round, layout)
            header, body = build_opening(status, info, self.host, self.key, layout, sample_settings(self.recipe),
                                         roots, self._opened_residuals(info.round))
        except ChallengeRefused as exc:
            self.events.note(str(exc))
            return True
        self._send_opening(info, header, body, len(status.challenged_chunks), status.opening_deadline_unix_ms)
        return True

    def _send_opening(
        self, info: pb.RoundInfo, header: pb.OpeningHeader, body: bytes, chunks: int, deadline_ms: int
    ) -> None:
        """Upload the opening over the host's link; an outage is retried while the deadline allows, a
        refusal is logged (one line) and final."""
        delay, retry = self.settings.backoff_s, False
        while True:
            try:
                receipt = self.aggregator.open_residual(header, body, info.limits.max_chunk_bytes or OPENING_CHUNK)
            except SubmitRejected as exc:
                outage = exc.code in RETRYABLE or exc.reason == "UNAVAILABLE"
                if outage and time.time() + delay < deadline_ms / 1000:
                    self.sleep(delay)
                    delay, retry = min(delay * 2, 30.0), True
                    continue
                if retry and exc.reason == "NOT_CHALLENGED" and self._opened(info):
                    self.events.note(f"round {info.round}: challenged; opened {chunks} chunks of its residual "
                                     f"({len(body)} bytes, stored by an earlier attempt)")
                    return
                self._opening_refused(info.round, exc.reason or exc.code.name, exc.message)
                return
            if not receipt.accepted:
                self._opening_refused(info.round, common.RejectReason.Name(receipt.reason).removeprefix("REJECT_"),
                                      receipt.message)
                return
            self.events.note(f"round {info.round}: challenged; opened {chunks} chunks of its residual "
                             f"({len(body)} bytes)")
            return

    def _opening_refused(self, round_: int, reason: str, message: str) -> None:
        self.events.note(f"round {round_}: the opening of its residual was refused: {reason}: {message}")

    def _opened(self, info: pb.RoundInfo) -> bool:
        """Whether the aggregator stored this host's opening of the round (an attempt whose answer was lost)."""
        try:
            return self.aggregator.submission(info.epoch, info.round, self.host).state == \
                pb.SubmissionStatus.OPENED
        except grpc.RpcError:
            return False
