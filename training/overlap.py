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

**Late forecast and merge** (eager only; the recipe's `forecast_step` s_f and `merge_step` s_m, 0 = off).
A round may move onto another base partway through (`training.worker.Rebase`: after step s,
θ ← θ + (new base − old base), AdamW's state going on unchanged):

- with s_f, the round starts from the outer step on G(r−2) with an all-zero update, the step's momentum
  part, which the host computes ahead of everything (`SpeculativeStep.run`), and moves onto its forecast
  after s_f steps: the host need not have sealed round r − 1, nor taken the forecast, before it trains;
  both are hidden behind the round's first s_f steps. (Round 1, and any round with no payload of the
  host's the round before, starts from its forecast: the two bases are the same model.)
- with s_m, the round moves onto G(r−1), the model the outer step actually landed on, after s_m steps,
  and its pseudo-gradient is measured from G(r−1): Streaming DiLoCo's merge, applied as the forecast's
  error. The host must hold G(r−1) by step s_m (round r − 1 uploaded, closed and its update downloaded),
  else it waits there.

Both bases are public (G(r−2), its momentum, the host's own payload of r − 1, G(r−1)), so the round is
still a pure function of public inputs, and the replay makes the same moves at the same steps.

In every mode the base of a round is fixed by the round number and public data alone, so a round stays
a pure function of public inputs (that base, the host's windows, the round) and the replay check
recomputes it exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

from training.diloco import OuterOptimizer
from training.worker import Rebase

Params = Mapping[str, Tensor]

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


def eager_rebases(
    forecast: Callable[[], Params], speculation: Callable[[], Params], previous: Callable[[], Params],
    forecast_step: int, merge_step: int,
) -> tuple[Params, list[Rebase]]:
    """An eager round's start and the moves it makes on the way (the recipe's `forecast_step` and
    `merge_step`, 0 = none): `forecast()` is the host's forecast (`eager_base`), `speculation()` the
    outer step on the same model with an all-zero update, `previous()` the model after round r − 1. Each
    is called only when needed: the start now, a move's target when the round gets there."""
    rebases = [Rebase(forecast_step, forecast)] if forecast_step else []
    if merge_step:
        rebases.append(Rebase(merge_step, previous))
    return (speculation() if forecast_step else forecast()), rebases
