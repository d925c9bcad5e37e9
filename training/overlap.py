"""Which global model a round trains from: the overlap rule every host, aggregator and replay shares.

`"off"`: round r trains from the global model after round r − 1 (plain DiLoCo: a host waits for the
round to close and the new model to arrive before it trains again).

`"delayed"` (one-round-delayed outer updates): round r trains from the global model after round r − 2,
while the outer step that closes round r still applies to the global model after round r − 1. A host
can therefore start round r + 1 (from round r − 1's model, final by then) the moment it has trained
round r, and upload round r while it trains: communication hides behind a whole round of compute. The
pseudo-gradient is one outer step stale; the loss cost is measured in docs/benchmarks.md.

Either way the base of a round is fixed by the round number alone, so a round stays a pure function of
public inputs (that base's checkpoint, whose hash is on chain; the host's windows; the round) and the
replay check recomputes it exactly.
"""

from __future__ import annotations

OVERLAP_MODES = ("off", "delayed")


def check_overlap(mode: str) -> str:
    if mode not in OVERLAP_MODES:
        raise ValueError(f"overlap: must be one of {', '.join(OVERLAP_MODES)}, got {mode!r}")
    return mode


def base_round(round_: int, mode: str, first_round: int = 1) -> int:
    """The round whose resulting global model round `round_` trains from (`first_round − 1`: the
    epoch's initial model)."""
    lag = 2 if check_overlap(mode) == "delayed" else 1
    return max(first_round - 1, round_ - lag)
