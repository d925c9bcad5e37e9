"""An eager host's forecast of each round's base (training/overlap.py), and the codec a round's
update and payloads are read with (a mixin of `HostNode`, gonka_node/host/node.py, which owns the
attributes declared here): from the adopted model's step taken ahead, finished with the host's own
payload's entries, which the encoder kept (no decode of the bytes it just wrote), else decoded.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import NamedTuple

from torch import Tensor

from gonka_node.host.follow import GlobalModel
from gonka_node.host.saves import HostSaves
from gonka_node.host.settings import HostError
from gonka_node.host.store import Progress
from gonka_node.host.upload import PendingUpload
from training.codecs import Codec, get_codec, round_seed
from training.diloco import SpeculativeStep
from training.overlap import eager_base


class OwnPayload(NamedTuple):
    """The payload of a round this host trained, and its entries as the encoder kept them (a sparse codec,
    an eager host): the next round's forecast reads them instead of decoding the payload again."""

    round: int
    payload: bytes
    entries: dict[str, tuple[Tensor, Tensor]]


class Forecast(NamedTuple):
    """An eager host's base for a round: its payload of the round before (None: none the aggregator
    holds) and the outer step with it as the average (training/overlap.py)."""

    own: bytes | None
    base: dict[str, Tensor]


class Forecasts(HostSaves):
    _next_step: tuple[int, SpeculativeStep] | None
    _own: OwnPayload | None

    def _decode_update(self, round_: int, data: bytes) -> Mapping[str, Tensor]:
        """A compressed broadcast, decoded as the aggregator decoded it to take the outer step (the global
        model is defined by these tensors: gonka_node/aggregator/broadcast.py)."""
        return self._round_codec(round_).decode(data, self._spec)

    def _round_codec(self, round_: int) -> Codec:
        return get_codec(self.recipe.codec).for_round(round_seed(self.recipe.epoch_seed, round_))

    def _forecast(self, r: int, gm: GlobalModel, pending: PendingUpload | None, progress: Progress) -> Forecast:
        own = self._sent_payload(r - 1, pending, progress)
        return Forecast(own, self._eager_base(r, gm, own))

    def _eager_base(self, r: int, gm: GlobalModel, own: bytes | None) -> dict[str, Tensor]:
        """`eager_base` of the held model (after r − 2), its outer momentum and `own` (round r − 1's
        payload, decoded as the aggregator decodes it)."""
        if gm.outer is None:
            raise HostError(
                f"round {r}: the eager base needs the outer momentum after round {gm.round_done}, which this "
                "host lost when it pulled a checkpoint; start it again with an empty state_dir (its config) to "
                "follow the epoch's updates from the initial model"
            )
        ready = self._next_step
        if own is not None and ready is not None and ready[0] == gm.round_done and ready[1].steps_from(gm.params) \
                and not ready[1].forecasted:
            # The dense part of the step was taken ahead, off this path: only the payload's entries are left.
            return ready[1].forecast(self._own_entries(r - 1, own))
        decoded = None if own is None else {n: t.float() for n, t in self._decode_update(r - 1, own).items()}
        return eager_base(gm.params, gm.outer, decoded)

    def _own_entries(self, round_: int, own: bytes) -> dict[str, tuple[Tensor, Tensor]]:
        """`own`'s entries (`Codec.decode_sparse`): as the encoder kept them when `own` is the payload this
        host trained last (the very bytes: `Codec.encode_kept` is the decode bit for bit), else decoded."""
        mine, self._own = self._own, None  # once: a model-sized list of entries, not kept past its forecast
        if mine is not None and mine.round == round_ and mine.payload is own:
            return mine.entries
        return self._round_codec(round_).decode_sparse(own, self._spec)

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
        return self.recipe.broadcast == "codec" and get_codec(self.recipe.codec).sparse
