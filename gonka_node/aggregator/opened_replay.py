"""The replay verdict of a challenged top-k host, judged on its opened residual.

An honest top-k payload is C(d·e_{r−1} + Δ_r), mostly the host's private residual, so its decode cannot
be compared with the replay. Error feedback gives Δ_r = decode(P_r) + e_r − d·e_{r−1} (up to fp32
rounding); on the opened chunks the close rebuilds that claimed Δ̂ and compares it with the replay there,
by the same bars as a dense replay (`verdict`). Before that, the opening must be the one the host was
challenged for and verify against the roots it signed (`verify_opening`), and each residual must fit the
payload that left it (`payload_misfit`: the payload must be the top-k compression of decode + residual):
e_r against P_r (the host cannot send one thing and park the difference in its residual), e_{r−1} against the host's previous stored payload when the aggregator still
holds it (without it, e_{r−1} is checked against its signed root only, and the reason says so).

Every failure here is a signed opening that does not answer its challenge, so it is reported with the
replay's MISMATCH prefix and the opening's digest: slashable evidence (gonka_node/slashing.py). A host
that opened nothing by the deadline is excluded and unpaid with `no opening: …`, and not slashed: an
outage looks the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from gonka_node.aggregator.engine_types import EpochContext, clock_text
from gonka_node.aggregator.replay import MISMATCH, NO_OPENING, replay_update, verdict
from gonka_node.aggregator.store import OpeningRow, SubmissionRow
from gonka_node.core.config import AggregationSettings
from gonka_node.core.opening import OpeningError, decode_body
from training.codec_base import CodecError
from training.codecs_sparse import TopKCodec
from training.residual_commit import (
    ChunkLayout,
    Opening,
    claimed_delta,
    compare,
    gather_chunks,
    payload_misfit,
    verify_opening,
)
from training.worker import Rebase


@dataclass(frozen=True)
class Opened:
    """What the verdict of one challenged host reads (gathered by the engine when the close computes)."""

    chunks: tuple[int, ...]
    deadline_ms: int
    opening: OpeningRow | None  # None: nothing stored by the deadline
    previous: SubmissionRow | None  # the host's last earlier checked submission of the epoch (None: none)


@dataclass(frozen=True)
class Judged:
    """The round's payload of the host and what the replay compares it with."""

    round: int
    slot: int
    payload: Path
    decoded: Mapping[str, Tensor]
    base: Mapping[str, Tensor]
    rebases: Sequence[Rebase] = ()  # where an eager round moved on the way (training/overlap.py)


class OpeningFailed(Exception):
    """The opening does not answer its challenge (the message says how); slashable."""


def opened_verdict(ctx: EpochContext, layout: ChunkLayout, aggregation: AggregationSettings, judged: Judged,
                   opened: Opened) -> tuple[bool, str]:
    """(passed, the reason line kept with the contribution) of a challenged host."""
    if opened.opening is None:
        return False, (f"{NO_OPENING}: the residual was not opened by {clock_text(opened.deadline_ms)} "
                       f"({len(opened.chunks)} chunks challenged): excluded and unpaid, not slashed")
    digest = opened.opening.body_sha256.hex()
    try:
        previous, current, unchecked = _checked_opening(ctx, layout, judged, opened)
    except OpeningFailed as exc:
        return False, f"{MISMATCH}: {exc} (opening sha256 {digest})"
    assert ctx.replay is not None  # a challenged round replays (challenges.challenges_round)
    replay = replay_update(ctx.replay, judged.round, judged.slot, judged.base, judged.rebases)
    claimed = claimed_delta(gather_chunks(judged.decoded, layout, opened.chunks), previous.values(),
                            current.values(), ctx.ef_decay)
    cos, ratio = compare(claimed, gather_chunks(replay, layout, opened.chunks))
    passed, why = verdict(judged.round, judged.slot, cos, ratio, aggregation.replay_min_cosine,
                          aggregation.replay_norm_tolerance)
    return passed, f"{why} (on {len(opened.chunks)} opened residual chunks, opening sha256 {digest}{unchecked})"


def _checked_opening(ctx: EpochContext, layout: ChunkLayout, judged: Judged, opened: Opened
                     ) -> tuple[Opening, Opening, str]:
    """(e_{r−1}'s opening, e_r's opening, a note when e_{r−1}'s bound could not be checked); raises
    OpeningFailed."""
    row = opened.opening
    assert row is not None
    try:
        previous, current = decode_body(Path(row.path).read_bytes(), opened.chunks)
    except OpeningError as exc:
        raise OpeningFailed(str(exc)) from None
    if not verify_opening(row.previous_root, previous, layout, opened.chunks):
        raise OpeningFailed("e_{r-1}'s opened chunks do not verify against the root the host signed")
    if not verify_opening(row.residual_root, current, layout, opened.chunks):
        raise OpeningFailed("e_r's opened chunks do not verify against the root signed with this round's payload")
    _within(ctx, layout, judged.payload, judged.round, current, opened.chunks, "e_r", "this round's payload")
    return previous, current, _previous_bound(ctx, layout, opened, previous)


def _previous_bound(ctx: EpochContext, layout: ChunkLayout, opened: Opened, previous: Opening) -> str:
    """Check e_{r−1} against the payload that left it; the note to add when that payload is gone."""
    earlier = opened.previous
    if earlier is None:  # e_{r−1} verified against the zero root: it is zero
        return ""
    if not Path(earlier.path).exists():
        return f"; round {earlier.round}'s payload is no longer held: e_{{r-1}} checked against its root only"
    _within(ctx, layout, Path(earlier.path), earlier.round, previous, opened.chunks, "e_{r-1}",
            f"the host's round-{earlier.round} payload")
    return ""


def _within(ctx: EpochContext, layout: ChunkLayout, payload: Path, round_: int, opening: Opening,
            chunks: tuple[int, ...], what: str, whose: str) -> None:
    codec = ctx.codec_for(round_)
    assert isinstance(codec, TopKCodec)  # challenges.challenges_round: the codec opens its residual
    try:
        why = payload_misfit(codec, payload.read_bytes(), ctx.spec, layout, chunks, opening.values())
    except CodecError as exc:  # a stored, checked payload: not expected, but not the host's fault to hide
        raise OpeningFailed(f"{whose} cannot be checked against {what}: {exc}") from None
    if why is not None:
        raise OpeningFailed(f"{whose} is not the top-k compression of its decode plus {what}: {why}")
