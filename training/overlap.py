"""Which global model a round trains from: the overlap rule every host, aggregator and replay shares.

`"off"`: round r trains from the global model after round r − 1 (plain DiLoCo: a host waits for the
round to close and the new model to arrive before it trains again).

`"delayed"` (one-round-delayed outer updates): round r trains from the global model after round r − 2,
while the outer step that closes round r still applies to the global model after round r − 1. A host
can therefore start round r + 1 (from round r − 1's model, final by then) the moment it has trained
round r, and upload round r while it trains: communication hides behind a whole round of compute. The
pseudo-gradient is one outer step stale; the loss cost is measured in docs/benchmarks.md.

`"eager"` (after the eager updates of Kale et al. 2025): the same schedule and the same global model as
`"delayed"`, but a host does not train round r from round r − 2's model itself: it trains from its
*forecast* of round r − 1's model, the outer step that will close round r − 1 taken now on round r − 2's
model (with that model's outer momentum), with the host's own fresh pseudo-gradient of round r − 1 (its
submitted payload, decoded) standing in for the round's average, which is still being aggregated:

    base(r) = OuterStep(G(r−2), momentum(r−2), D_own(r−1))        (round 1: the initial model)

Kale et al. apply the local outer gradient at once and the other workers' a step late; here the global
model is the chain of outer steps over the public aggregates, so the forecast has to stand in for the
whole next step, and the host's own pseudo-gradient is its best estimate of the others' (measured
against their stale aggregate as the stand-in, which does worse: docs/benchmarks.md). The
pseudo-gradient is then measured from (nearly) the model the outer step lands on, which is what the
stale base of `"delayed"` got wrong. Only the training base changes: the global model is still the
chain of outer steps over the public aggregates, bit for bit. The forecast is a pure function of public
inputs (round r − 2's checkpoint and outer momentum, which the aggregator holds, and the host's own
decoded payload of round r − 1, which it received), so the replay check recomputes it exactly.

In every mode the base of a round is fixed by the round number and public data alone, so a round stays
a pure function of public inputs (that base, the host's windows, the round) and the replay check
recomputes it exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from training.diloco import OuterOptimizer

OVERLAP_MODES = ("off", "delayed", "eager")


def check_overlap(mode: str) -> str:
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap: must be one of {', '.join(OVERLAP_MODES)}, got {mode!r}")
    return mode


def base_round(round_: int, mode: str, first_round: int = 1) -> int:
    """The round whose resulting global model round `round_` trains from (`first_round − 1`: the
    epoch's initial model). For `"eager"` the round whose model the host's forecast starts from."""
    lag = 1 if check_overlap(mode) == "off" else 2
    return max(first_round - 1, round_ - lag)


def next_overlapped_round(trained: int, latest: int, held: int) -> int:
    """The next round an overlapping host trains: after the last it trained and the last the chain
    closed, and one whose base (round − 2) is not behind the held model, which only moves forward (a
    restarted host that caught up to the chain's latest model skips a round rather than pull an older
    checkpoint)."""
    r = max(trained, latest) + 1
    while base_round(r, "delayed") < held:
        r += 1
    return r


def eager_base(
    anchor: Mapping[str, Tensor], outer: OuterOptimizer, own: Mapping[str, Tensor] | None
) -> dict[str, Tensor]:
    """The host's forecast of the next global model: `outer`'s step (on a copy: `outer` is not changed)
    on a copy of `anchor`, with the host's own decoded pseudo-gradient `own` as the average (None: the
    host sent nothing the round before, e.g. the epoch's first round; the forecast is then `anchor`)."""
    params = {name: t.detach().float().clone() for name, t in anchor.items()}
    if own is None:
        return params
    forecast = OuterOptimizer(outer.lr, outer.momentum, outer.nesterov)
    forecast.restore(outer.steps, outer.buffers)
    forecast.step(params, own)
    return params
