"""Each host's training base of a round under the recipe's `overlap = "eager"` (training/overlap.py),
recomputed by the aggregator for the replay check from what it already holds.

A host trains round r from `eager_base(G(r−2), momentum(r−2), D_h(r−1))`: the round's base checkpoint
(its hash is in every envelope of the round), the outer momentum this aggregator saved when it closed
the last round up to r − 2 (`Store.outer_state_path`), and the payload host h submitted, signed and
had accepted in round r − 1 (its stored submission file), decoded with round r − 1's codec; no payload
stored for h in round r − 1: the base checkpoint itself. Nothing a host keeps privately enters.

What must be kept, and for how long: round r − 1's accepted payload files and the outer momentum after
round r − 2 until round r has closed (the store keeps every round's files for the epoch today). Memory
of a close: the momentum (one model) once any host is picked, and one forecast (one model) at a time,
built only for the hosts the replay picked (`EagerBases.base_for`), so a sampled replay (p < 1) pays
for its sampled hosts only.

With the recipe's `forecast_step` the round starts from the same outer step with an all-zero update and
moves onto the forecast after that step; with `merge_step` it moves onto G(r−1), the checkpoint the
close's outer step applies to, after that one (`training.overlap.eager_rebases`). Each target is built
when the replay reaches its step; the start stays held through the replay, so at a move a replay holds
the momentum, the start, the target and the replay's own model (G(r−1) is loaded once per close).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from gonka_node.aggregator.outer_state import read_outer_state
from gonka_node.aggregator.validate import Codec, decode_update
from training.diloco import OuterOptimizer
from training.overlap import eager_base, eager_rebases
from training.worker import Rebase


@dataclass
class EagerBases:
    """The inputs of round r's eager bases; `base_for(anchor, host)` builds one host's."""

    codec: Codec  # round r − 1's: how the hosts' payloads of that round decode
    spec: Mapping[str, tuple[int, ...]]
    outer_lr: float
    outer_momentum: float
    outer_state: Path | None  # the momentum after the last finalized round up to r − 2 (None: fresh)
    previous: Mapping[bytes, Path]  # host -> its accepted payload file of round r − 1
    forecast_step: int = 0  # the recipe's (0: from the forecast throughout)
    merge_step: int = 0  # the recipe's (0: never)
    after_previous: Callable[[], Mapping[str, Tensor]] | None = None  # G(r−1), loaded when a merge needs it
    _outer: OuterOptimizer | None = field(default=None, init=False, repr=False)
    _previous: Mapping[str, Tensor] | None = field(default=None, init=False, repr=False)

    def base_for(self, anchor: Mapping[str, Tensor], host: bytes) -> tuple[Mapping[str, Tensor], list[Rebase]]:
        """Host `host`'s base: the outer step on a copy of `anchor` (the round's base checkpoint) with its
        own decoded payload of round r − 1 (none stored: `anchor`, copied), and the moves the round makes
        on the way (the recipe's `forecast_step`, `merge_step`)."""
        path = self.previous.get(host)

        def forecast() -> dict[str, Tensor]:  # the own payload decoded only here: not held past the forecast
            own = None if path is None else {
                n: t.float() for n, t in decode_update(self.codec, path.read_bytes(), self.spec).items()}
            return eager_base(anchor, self.momentum(), own)

        def momentum_part() -> dict[str, Tensor]:
            return eager_base(anchor, self.momentum(), {n: torch.zeros(s) for n, s in self.spec.items()})

        def previous() -> Mapping[str, Tensor]:
            if self.after_previous is None:
                raise ValueError("merge_step: the replay was given no model after round r − 1 to merge")
            if self._previous is None:  # once per close, however many hosts the replay picked
                self._previous = self.after_previous()
            return self._previous

        return eager_rebases(forecast, momentum_part, previous, self.forecast_step if path is not None else 0,
                             self.merge_step)

    def momentum(self) -> OuterOptimizer:
        """The outer optimizer after round r − 2, read once per close (`eager_base` leaves it alone)."""
        if self._outer is None:
            self._outer = OuterOptimizer(self.outer_lr, self.outer_momentum)
            if self.outer_state is not None:
                self._outer.restore(*read_outer_state(self.outer_state))
        return self._outer

