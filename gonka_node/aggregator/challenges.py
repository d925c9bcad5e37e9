"""Which top-k submissions of a round are challenged to open their residual, on which chunks, until when.

A round of an epoch whose codec `opens_residual` (sparse top-k: the payload is mostly the host's private
error-feedback residual, so the replay cannot compare its decode) challenges every host the replay picks
(`chosen_for_replay`) once the round's seed is complete: the host opens e_{r−1} and e_r on the chunks
`core.opening.challenge` draws from the seed, and has until `seed_complete_ms + opening_timeout_s` to
do so (docs/PROTOCOL.md "Challenge and opening"). Everything here is a function of what the store keeps
(the seed, when it was first seen complete, the signed roots), so a restarted aggregator serves the same
challenges and resumes the close's wait where it was.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.replay import chosen_for_replay
from gonka_node.aggregator.store import CHECKED, RoundRow, Store, SubmissionRow
from gonka_node.core.opening import challenge
from training.residual_commit import ChunkLayout, zero_root


@dataclass(frozen=True)
class Challenge:
    """One host's challenge in one round: the seed it derives from, the chunks, the deadline (unix ms)."""

    round_seed: bytes
    chunks: tuple[int, ...]
    deadline_ms: int


def challenges_round(ctx: EpochContext) -> bool:
    """Whether the epoch's replays open residuals: a replayed (p > 0) unsharded epoch whose codec's payload
    is mostly the host's residual. int8/fp32 epochs keep the dense replay of the decoded update."""
    return ctx.replay is not None and ctx.replay_probability > 0 and ctx.shard is None and ctx.codec.opens_residual


def picked(ctx: EpochContext, row: RoundRow, hosts: Iterable[bytes]) -> set[bytes]:
    """The hosts of `hosts` challenged in `row` (empty before its seed is complete)."""
    if row.round_seed is None or not challenges_round(ctx):
        return set()
    return chosen_for_replay(ctx.replay_probability, row.round_seed, row.round, hosts)


def deadline_ms(row: RoundRow, timeout_s: float) -> int:
    assert row.seed_complete_ms is not None
    return row.seed_complete_ms + int(timeout_s * 1000)


@functools.lru_cache(maxsize=256)  # a host polls GetSubmission; a sample sorts n_chunks hashes (~0.3 s at 1.2B)
def _sample(seed: bytes, round_: int, host: bytes, layout: ChunkLayout, fraction: float, min_elements: int
            ) -> tuple[int, ...]:
    return challenge(seed, round_, host, layout, fraction, min_elements)


def sample(ctx: EpochContext, layout: ChunkLayout, row: RoundRow, host: bytes) -> tuple[int, ...]:
    """The chunks `host` must open in `row` (its seed complete)."""
    assert row.round_seed is not None
    return _sample(row.round_seed, row.round, bytes(host), layout, ctx.residual_sample, ctx.residual_sample_min)


def challenge_of(ctx: EpochContext, layout: ChunkLayout, row: RoundRow, sub: SubmissionRow, timeout_s: float
                 ) -> Challenge | None:
    """The challenge of a stored submission (None: not challenged — not checked, not picked, or its round
    not yet at that point)."""
    if sub.check_state != CHECKED or sub.host not in picked(ctx, row, [sub.host]):
        return None
    assert row.round_seed is not None
    return Challenge(row.round_seed, sample(ctx, layout, row, sub.host), deadline_ms(row, timeout_s))


@functools.lru_cache(maxsize=8)
def _zero_root(layout: ChunkLayout) -> bytes:
    return zero_root(layout)


def previous_root(store: Store, layout: ChunkLayout, epoch: int, round_: int, host: bytes) -> bytes:
    """The root e_{r−1} must open against: the one the host signed in its last earlier checked submission
    of the epoch, or the zero residual's root when it has none (a host's residual before its first round)."""
    earlier = store.previous_submission(epoch, round_, host)
    return earlier.residual_root if earlier is not None else _zero_root(layout)


def max_body_bytes(layout: ChunkLayout, chunks: tuple[int, ...]) -> int:
    """The most bytes a well-formed opening of `chunks` can take (a `ResidualOpening`): per chunk both
    residuals' fp32 bytes and paths of at most the tree's depth, with protobuf's tags and length prefixes
    bounded from above (11 bytes: a tag and a 10-byte varint)."""
    depth = max(0, (layout.n_chunks - 1).bit_length())
    per_path = depth * (1 + 1 + 32)
    return sum(11 + 11 + 2 * (11 + 4 * layout.chunk_len(i) + per_path) for i in chunks)
