"""An eager host's forecast of each round's base (training/overlap.py), and the codec a round's
update and payloads are read with (a mixin of `HostNode`, gonka_node/host/node.py, which owns the
attributes declared here): from the adopted model's step taken ahead, finished with the host's own
payload's entries, which the encoder kept (no decode of the bytes it just wrote), else decoded.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple

from torch import Tensor

from gonka_node.host.follow import GlobalModel, NextModel, dense_update, step_ahead
from gonka_node.host.saves import HostSaves
from gonka_node.host.sealing import Beside, SealedRound
from gonka_node.host.settings import HostError
from gonka_node.host.store import Progress
from gonka_node.host.upload import PendingUpload
from training.codecs import Codec, Spec, get_codec, round_seed
from training.diloco import OuterOptimizer, SpeculativeStep, Update
from training.overlap import eager_base
from training.worker import Rebase, Shifted, WorkerRound

log = logging.getLogger(__name__)


class Forecast(NamedTuple):
    """An eager host's base for a round: its payload of the round before (None: none the aggregator
    holds) and the outer step with it as the average (training/overlap.py)."""

    own: bytes | None
    base: dict[str, Tensor]


class LatePlan(NamedTuple):
    """An eager round with a late forecast (`Forecasts._late_forecast`): where it starts, the moves it
    makes, the payload it forecast with (once the move is made), and what its first step calls."""

    start: Mapping[str, Tensor] | None  # None: the held model (not eager)
    moves: list[Rebase]
    forecast_with: list[bytes | None]
    begin: Callable[[], None] = lambda: None
    cancel: Callable[[], None] = lambda: None  # the round is over: a forecast it did not reach is not taken


class Forecasts(HostSaves):
    n_rounds: int
    _next_step: tuple[int, SpeculativeStep] | None
    # the epoch's first round: round 2's +0 step of the initial model, taken beside it (`_late_forecast`)
    _zero_ahead: Beside[bool] | None = None
    # an eager host's last round trained (a sparse codec: with its payload's entries as the encoder kept
    # them), until the next round's forecast reads those instead of decoding the payload again
    _own: WorkerRound | SealedRound | None

    def _decode_update(self, round_: int, data: bytes) -> Mapping[str, Tensor]:
        """A compressed broadcast (or payload), decoded as the aggregator decoded it to take the outer step
        (the global model is defined by these tensors: gonka_node/aggregator/broadcast.py)."""
        return self._round_codec(round_).decode(data, self._spec_for(round_))

    def _update_of(self, round_: int, data: bytes) -> Mapping[str, Tensor]:
        """Round `round_`'s downloaded update as tensors, checked to hold the round's tensors (a streamed
        round's fragment: an outer step on other tensors would need the checkpoint pulled instead)."""
        if self.recipe.broadcast == "codec":
            return self._decode_update(round_, data)
        update, want = dense_update(round_, data), self._spec_for(round_)
        if set(update) != set(want):
            raise ValueError(f"round {round_}'s update holds {len(update)} tensors, not the round's {len(want)}")
        return update

    def _spec_for(self, round_: int) -> Spec:
        """The tensors round `round_`'s payloads and update hold: the model's, or a streamed round's fragment."""
        stream = self.rounds.stream
        return self._spec if stream is None else stream.fragment_of(round_).spec(self._spec)

    def _round_codec(self, round_: int) -> Codec:
        return get_codec(self.recipe.codec).for_round(round_seed(self.recipe.epoch_seed, round_))

    def _forecast(self, r: int, gm: GlobalModel, pending: PendingUpload | None, progress: Progress) -> Forecast:
        own = self._sent_payload(r - 1, pending, progress)
        return Forecast(own, self._eager_base(r, gm, own))

    def _own_payload(self, r: int, pending: PendingUpload | None, progress: Progress) -> Callable[[], bytes | None] | None:
        """What reads round r − 1's payload of this host for round r's late forecast (`_late_forecast`):
        the one uploading (once sealed), or the one kept on disk; None: there is none."""
        if pending is not None and pending.round == r - 1:
            return lambda: self._sent_payload(r - 1, pending, progress)
        kept = self._sent_payload(r - 1, pending, progress)
        return None if kept is None else lambda: kept

    def _eager_base(self, r: int, gm: GlobalModel, own: bytes | None) -> dict[str, Tensor]:
        """`eager_base` of the held model (after r − 2), its outer momentum and `own` (round r − 1's
        payload, decoded as the aggregator decodes it)."""
        outer = self._momentum(r, gm)
        ready = self._next_step
        if own is not None and ready is not None and ready[0] == gm.round_done and ready[1].steps_from(gm.params) \
                and not ready[1].forecasted:
            # The dense part of the step was taken ahead, off this path: only the payload's entries are left.
            return ready[1].forecast(self._own_entries(r - 1, own))
        decoded = None if own is None else {n: t.float() for n, t in self._decode_update(r - 1, own).items()}
        return eager_base(gm.params, outer, decoded)

    def _late_forecast(
        self, r: int, gm: GlobalModel, own: Callable[[], bytes | None] | None, release: Callable[[], None],
    ) -> LatePlan:
        """An eager round r with the recipe's `forecast_step` (training/overlap.py). `own()` gives round
        r − 1's payload of this host (a round sealed behind: once sealed; None: none the aggregator holds);
        `own` None: no such round (the round starts from its forecast, with no payload: the held model,
        and makes no move). `release()` lets the upload thread have the held model's step taken ahead,
        once the forecast, which may be written over it, is taken. The forecast is taken beside the
        round's first steps (`Beside`: it waits for the seal), so the move costs the path only its add."""
        if own is None:
            base = self._eager_base(r, gm, None)
            release()
            if self._speculates and gm.round_done == r - 1 and gm.outer is not None and r < self.n_rounds:
                # the epoch's first round: the next one starts from the held model's +0 step too, taken beside
                # this one, not on its path
                ahead = SpeculativeStep(gm.outer, gm.params)
                self._next_step, self._zero_ahead = (gm.round_done, ahead), Beside(f"zero-step-{r + 1}", ahead.run)
                self._zero_ahead.begin()
            return LatePlan(base, [], [])
        zero = self._zero_step(r, gm)

        def forecast() -> tuple[bytes | None, Mapping[str, Tensor] | Shifted]:
            payload = own()
            base = self._eager_base(r, gm, payload)  # over `zero`'s own tensors when it is the step ahead
            return payload, Shifted(base, zero.forecast_shift()) if zero.forecasted else base

        beside = Beside(f"forecast-round-{r}", forecast)
        forecast_with: list[bytes | None] = []

        def target() -> Mapping[str, Tensor] | Shifted:
            payload, moved = beside.result()
            forecast_with.append(payload)
            release()
            return moved

        return LatePlan(zero.params, [Rebase(self.recipe.forecast_step, target)], forecast_with, beside.begin,
                        beside.cancel)

    def _zero_step(self, r: int, gm: GlobalModel) -> SpeculativeStep:
        """The held model's outer step with an all +0 update (`SpeculativeStep.run`): the one taken ahead
        by the upload thread when there is one (the forecast is then written over it), else taken now (and,
        with a sparse broadcast, handed on as if taken ahead: the upload thread finishes it, not again)."""
        if self._zero_ahead is not None:  # the one taken beside the round before: done first
            zero_ahead, self._zero_ahead = self._zero_ahead, None
            try:
                zero_ahead.result()
            except Exception:  # taken here instead (a half-run step cannot be run again: its buffers moved)
                log.exception("round %d: the +0 step taken beside the round before failed", r)
                self._next_step = None
        ready = self._next_step
        if ready is not None and ready[0] == gm.round_done and ready[1].steps_from(gm.params) \
                and not ready[1].forecasted:
            step = ready[1]
        else:
            step = SpeculativeStep(self._momentum(r, gm), gm.params)
            if self._speculates:
                self._next_step = (gm.round_done, step)
        if not step.done:
            step.run()
        return step

    @staticmethod
    def _momentum(r: int, gm: GlobalModel) -> OuterOptimizer:
        if gm.outer is None:
            raise HostError(
                f"round {r}: the eager base needs the outer momentum after round {gm.round_done}, which this "
                "host lost when it pulled a checkpoint; start it again with an empty state_dir (its config) to "
                "follow the epoch's updates from the initial model"
            )
        return gm.outer

    def _own_entries(self, round_: int, own: bytes) -> dict[str, tuple[Tensor, Tensor]]:
        """`own`'s entries (`Codec.decode_sparse`): as the encoder kept them when `own` is the payload this
        host trained last (the very bytes: `Codec.encode_kept` is the decode bit for bit), else decoded."""
        mine, self._own = self._own, None  # once: a model-sized list of entries, not kept past its forecast
        if mine is not None and mine.round == round_ and mine.payload is own and mine.sparse is not None:
            return mine.sparse
        return self._round_codec(round_).decode_sparse(own, self._spec)

    def _releaser(self, gm: GlobalModel, pending: PendingUpload | None) -> Callable[[], None]:
        """Lets `pending`'s thread compute the next model from the held one (`release_base`), once however
        often called: the held model stays as it is until that upload is joined."""
        released = pending is None

        def release() -> None:
            nonlocal released
            if not released:
                assert pending is not None
                released, held = True, gm.round_done == pending.round - 1
                pending.release_base(held, self._take_next_step(gm) if held else None)

        return release

    def _step_ahead(
        self, gm: GlobalModel, round_: int, data: bytes, speculated: SpeculativeStep | None,
        cancelled: Callable[[], bool],
    ) -> NextModel | None:
        if speculated is not None:  # a sparse codec's broadcast (`_speculates`): its entries, no dense tensor
            update: Update = self._round_codec(round_).decode_sparse(data, self._spec)
        else:
            update = self._update_of(round_, data)
        # An eager host forecasts the next round's base from the next step, right when the round after
        # this one starts: taken here, it is ready then (the daemon joins this thread before that round);
        # its dense part was taken on `speculated`'s +0 model while the upload was in flight (`take_after`),
        # only the entries this update and the forecast changed are left. A delayed host's next upload
        # thread takes it while it uploads, holding one model less meanwhile.
        chain = self._speculates and self.recipe.overlap == "eager"
        return step_ahead(gm, round_, update, speculated, speculate_next=chain, cancelled=cancelled)

    def _take_next_step(self, gm: GlobalModel) -> SpeculativeStep | None:
        """The held model's next step taken ahead of its update, for the upload thread to finish (once)."""
        ready, self._next_step = self._next_step, None
        return ready[1] if ready is not None and ready[0] == gm.round_done and ready[1].steps_from(gm.params) \
            else None

    def _sent_payload(self, round_: int, pending: PendingUpload | None, progress: Progress) -> bytes | None:
        """This host's payload of `round_` that the aggregator holds (None: none): the one uploading now
        (its answer is checked once the next round trained), else the one kept on disk, when the
        aggregator took it (recorded, or listed in the round's result: a crash came before the record)."""
        if pending is not None and pending.round == round_:
            return pending.payload
        if round_ < 1:
            return None
        self.writer.flush()  # a round kept behind is read from disk only once it is there
        kept = self.store.load_payload(round_)
        recorded = progress.submitted.get(str(round_))
        if recorded is not None:
            if kept is None or hashlib.sha256(kept).hexdigest() != recorded:
                raise HostError(
                    f"round {round_ + 1}: the eager base needs round {round_}'s payload as submitted "
                    f"(sha256 {recorded[:16]}…), which {self.store.root}/sent does not hold"
                )
            return kept
        return kept if kept is not None and self._contribution(round_) is not None else None

    @functools.cached_property
    def _speculates(self) -> bool:
        """Whether the upload thread takes the outer step ahead of the round's update: worth it when the
        update is a sparse codec's broadcast (3 % of the entries for top-k), so that little is left to do
        once it arrives; a dense update would be recomputed whole."""
        # never in a streamed epoch: the step taken ahead would move every tensor, not the round's fragment
        return self.recipe.broadcast == "codec" and get_codec(self.recipe.codec).sparse \
            and self.recipe.stream_fragments == 1
