"""A restarted host's uploads: the rounds it kept before sending (`HostStore.save_sent`) that the
aggregator holds are recorded, not trained again, and an overlapped top-k host whose next round is not
held resumes from the state that round trained from. A mixin of `HostNode` (gonka_node/host/node.py),
which owns the attributes declared here; also what decides whether a round may be trained again from
further back (`_rolls_back`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from gonka_node.core.recipe import Recipe
from gonka_node.host.aggregator_calls import AggregatorCalls
from gonka_node.host.challenge import opens_kept_state, opens_residual
from gonka_node.host.rig_round import RigError, Rounds
from gonka_node.host.settings import HostError
from gonka_node.host.store import HostStore, Progress
from proto.gonka.v1 import aggregator_pb2 as pb


class UploadRecovery(AggregatorCalls):
    store: HostStore
    rounds: Rounds
    recipe: Recipe
    _state_file: Path | None
    _before_round: dict[int, Mapping[str, Any]]

    def _record_accepted(self, round_: int, payload: bytes, progress: Progress) -> None:
        progress.submitted[str(round_)] = hashlib.sha256(payload).hexdigest()
        progress.bytes_sent += len(payload)
        progress.residual_roots[str(round_)] = self.residual_roots[round_].hex()

    def _recover_uploads(self, progress: Progress) -> bool:
        """Adopt, in order, the rounds after the last recorded one that were kept and that the aggregator
        holds (an overlapping host may have two uploads unrecorded). An overlapped top-k host whose next
        round after the recorded one is not held (its upload was cut, refused, or failed its checks)
        resumes from the state that round trained from: the snapshot, saved once the round before it
        was final, may carry that round's residual, which the aggregator's e_{r−1} does not (the next
        opening would not match it). Only that round's: the snapshot carries no later one, and after a
        round adopted here the state is the one it left. Returns whether it resumed so (the snapshot
        is then saved again: a crash while that round is kept anew must not find the old state)."""
        recorded = max([progress.round_done, *(int(k) for k in progress.submitted)])
        kept = [r for r in self.store.sent_rounds() if r > recorded]
        resumed = False
        for r in range(recorded + 1, max(kept, default=recorded) + 1):
            if not self._recover_upload(r, progress) and r == recorded + 1 and self._rolls_back:
                resumed = self._resume_before(r)
        return resumed

    def _resume_before(self, round_: int) -> bool:
        """Take the worker state `round_` trained from, as kept with it, if it was (`HostStore.save_sent`)."""
        state = self.store.load_sent_before(round_)
        if state is None:
            return False
        try:
            self.rounds.load_state_dict(state)
        except RigError as exc:
            raise HostError(f"{self.store.root}: {exc}") from exc
        self._state_file = self.store.before_path(round_)
        self.events.note(f"round {round_}: the aggregator does not hold the payload this host kept; resuming "
                         "from the state the round trained from")
        return True

    def _recover_upload(self, round_: int, progress: Progress) -> bool:
        """Whether this host's payload of `round_` as kept before its upload (`HostStore.save_sent`) is the
        one the aggregator holds: the daemon died after the upload and before recording it. Then the
        round is recorded and the worker state it left restored, not trained again: a second training
        would send (and keep, over the only copy) another payload than the one round + 1's eager base is
        built from, and on a GPU leave another residual than the one whose root the aggregator holds
        (the upload answers DUPLICATE), which the round's opening could then not open."""
        kept = self.store.load_sent(round_)
        if kept is None:
            return False
        try:
            held = self._patiently(f"round {round_}'s submission",
                                   lambda: self.aggregator.submission(self.settings.epoch, round_, self.host_bytes))
        except grpc.RpcError:  # none held (NOT_FOUND): train it again
            return False
        if bytes(held.payload_sha256) != hashlib.sha256(kept.payload).digest():
            return False
        if held.state == pb.SubmissionStatus.PENDING and (self._challengeable or self.recipe.overlap == "eager"):
            # What follows it depends on its verdict: the residual the next round trains on (top-k) or
            # the payload its eager base is forecast with count only if it passes the checks.
            verdict = self._verdict(held, round_)
            if verdict is None:  # no longer held
                return False
            held = verdict
        if held.state == pb.SubmissionStatus.FAILED:
            return False
        if kept.has_state:
            if self._challengeable:  # should its checks fail yet, the residual goes back to this
                self._before_round[round_] = self.rounds.snapshot()
            try:
                self.rounds.load_state_dict(self.store.load_sent_state(round_))
            except RigError as exc:
                raise HostError(f"{self.store.root}: {exc}") from exc
            self._state_file = self.store.sent_state_path(round_)
        self.residual_roots[round_] = kept.residual_root
        self._record_accepted(round_, kept.payload, progress)
        self.events.note(f"round {round_}: the aggregator holds the payload this host kept (sent before a restart); "
                         "resuming from the state it left instead of training it again")
        return True

    @functools.cached_property
    def _challengeable(self) -> bool:
        return opens_residual(self.recipe)

    @functools.cached_property
    def _rolls_back(self) -> bool:
        """Whether an overlapped host trains a round again from the state before a refused round: only a
        challenged one must (its opening is checked against the aggregator's e_{r−1}), and only a top-k
        epoch with `round_state = "fresh"` (replayable) is ever challenged."""
        return self._opens_kept_state and self.recipe.round_state == "fresh"

    @functools.cached_property
    def _opens_kept_state(self) -> bool:
        return opens_kept_state(self.recipe)
