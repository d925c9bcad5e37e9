"""What the host daemon asks the aggregator, and how patiently: submitting a round (retries, a lost
receipt's DUPLICATE, the checks' verdict after a receipt), the open round, and a round's update and
result. A mixin of `HostNode` (gonka_node/host/node.py), which owns the attributes declared here; a
subclass may replace `_submit` (the adversary kit and the tests do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from gonka_node.core.client import AggregatorClient, SubmitRejected
from gonka_node.core.keys import NodeKeys
from gonka_node.host.events import HostEvents
from gonka_node.host.settings import RETRYABLE, HostSettings, patiently
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import common_pb2 as common

T = TypeVar("T")


class AggregatorCalls:
    aggregator: AggregatorClient
    settings: HostSettings
    events: HostEvents
    sleep: Callable[[float], None]
    keys: NodeKeys
    host_bytes: bytes
    residual_roots: dict[int, bytes]

    def _verdict(self, held: pb.SubmissionStatus, round_: int) -> pb.SubmissionStatus | None:
        """This host's submission of `round_` (`held`, PENDING) once its checks ran, asked again while a
        backlog delays them (the round's close waits for them too). None: no longer held (NOT_FOUND);
        `held` itself when the aggregator will not say otherwise."""
        epoch = self.settings.epoch
        said = False
        while True:
            try:
                return self._patiently(f"round {round_}'s checks", lambda: self.aggregator.checked(
                    epoch, round_, self.host_bytes, self.settings.poll_s))
            except TimeoutError:
                if not said:
                    self.events.note(f"round {round_}: waiting for the aggregator's checks of the payload it "
                                     "holds (what this host resumes from depends on their verdict)")
                    said = True
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                self.events.note(f"round {round_}: the verdict of its checks is not known ({exc.code().name}); "
                                 "counting the payload the aggregator holds as submitted")
                return held

    def _update_bytes(self, round_: int) -> bytes:
        return self.aggregator.round_update(self.settings.epoch, round_).data

    def _submit(self, info: pb.RoundInfo, payload: bytes, tokens: int) -> tuple[bool, str]:
        delay = self.settings.backoff_s
        for attempt in range(1, self.settings.submit_attempts + 1):
            try:
                self.aggregator.submit(info, self.host_bytes, payload, self.keys.node_key.signing_key, tokens,
                                       residual_root=self.residual_roots[info.round])
                return True, ""
            except SubmitRejected as exc:
                if exc.reason == "DUPLICATE":
                    # An earlier upload of this host landed: its receipt was lost in transit, or this
                    # process restarted after uploading. The aggregator holds it; count it as accepted,
                    # unless it failed its checks (a restarted host whose kept round was not adopted):
                    # then it is no submission, and this round's training is undone like a refusal's.
                    return self._duplicate(info)
                if exc.reason == "LATE":  # DEADLINE_EXCEEDED, yet final: the round closed without us
                    return False, f"LATE: {exc.message}"
                if exc.code not in RETRYABLE and exc.reason != "UNAVAILABLE":
                    return False, f"{exc.reason or exc.code.name}: {exc.message}"
                self.events.note(f"round {info.round}: upload attempt {attempt} failed ({exc}); retrying")
            self.sleep(delay)
            delay = min(delay * 2, 30.0)
        return False, f"gave up after {self.settings.submit_attempts} attempts"

    def _duplicate(self, info: pb.RoundInfo) -> tuple[bool, str]:
        try:
            held = self.aggregator.submission(info.epoch, info.round, self.host_bytes)
        except grpc.RpcError:  # not known now: as before, the aggregator holds a payload of ours
            return True, "DUPLICATE"
        if held.state == pb.SubmissionStatus.FAILED:
            return False, f"DUPLICATE of a payload that failed its checks: {held.message}"
        return True, "DUPLICATE"

    def _submit_checked(
        self, info: pb.RoundInfo, payload: bytes, tokens: int, cancelled: Callable[[], bool]
    ) -> tuple[bool, str]:
        """`_submit`, then the checks' verdict an eager host's next forecast depends on: a receipt says
        "stored, checks pending", and a payload that fails them is no submission, which the aggregator's
        replay of round r + 1 would then rebuild the base without (docs/PROTOCOL.md "Receipt"). After the
        receipt the round is the aggregator's: a verdict that cannot be had (an error, or the upload
        `cancelled` while waiting) counts the payload as accepted, as the aggregator holds it."""
        accepted, reason = self._submit(info, payload, tokens)
        if not accepted:
            return accepted, reason
        while True:
            try:
                status = self.aggregator.checked(info.epoch, info.round, self.host_bytes, self.settings.poll_s)
            except TimeoutError:  # a backlog of checks: the round's close waits for them, so will this
                if cancelled():
                    return True, "stored; the checks' verdict unknown (the upload was cancelled)"
                continue
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # an aggregator that checks before its receipt
                    return accepted, reason
                if exc.code() not in RETRYABLE:  # FAILED may still come, yet only a replay could tell
                    return True, f"stored; the checks' verdict unknown ({exc.code().name})"
                if cancelled():
                    return True, "stored; the checks' verdict unknown (the upload was cancelled)"
                self.sleep(self.settings.poll_s)
                continue
            if status.state != pb.SubmissionStatus.FAILED:
                return True, reason
            return False, f"{common.RejectReason.Name(status.reason).removeprefix('REJECT_')}: {status.message}"

    def _open_round(self) -> pb.RoundInfo | None:
        try:
            return self._retrying(self.aggregator.open_round)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return None  # between rounds: the last one is closing
            if code in RETRYABLE:  # a daemon outlives an aggregator outage: keep polling, say so
                self.events.note(f"aggregator {self.aggregator.target} unreachable ({code.name}); still waiting "
                                 "for a round")
                return None
            raise

    def _retrying(self, call: Callable[[], T]) -> T:
        delay = self.settings.backoff_s
        for attempt in range(self.settings.submit_attempts):
            try:
                return call()
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in RETRYABLE or attempt == self.settings.submit_attempts - 1:
                    raise
                self.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def _patiently(self, what: str, call: Callable[[], T]) -> T:
        return patiently(call, f"aggregator {self.aggregator.target}", what, self.sleep, self.events.note,
                         self.settings.backoff_s)

    def _reward(self, round_: int) -> int:
        mine = self._contribution(round_)
        return int(mine.reward) if mine is not None else 0

    def _contribution(self, round_: int) -> pb.Contribution | None:
        """This host's row in the aggregator's result of `round_` (None: not submitted, or not served)."""
        epoch = self.settings.epoch
        try:
            result = self._patiently(f"round {round_}'s result", lambda: self.aggregator.round_result(epoch, round_))
        except grpc.RpcError:  # not served (e.g. a round this aggregator did not close)
            return None
        return next((c for c in result.contributions if bytes(c.host) == self.host_bytes), None)
