"""What every shard checks of the verifier's verdict against the S signed reports it names, before
applying it (docs/PROTOCOL.md "Sharded aggregators", "What each shard checks").

The reports fix, per host, which shards accepted its fragment and each fragment's per-tensor squared
norms; from them alone follow each aggregated host's whole-update clip norm and the clip τ (the
verifier's own sums, `shard._whole_norm`, in the same sorted order). These are deterministic fp64 sums
over the same inputs, so the verdict must carry exactly them: no tolerance. The rewards follow from the
host set and the epoch's pool (`rewards_contradiction`). What the reports do not decide (which hosts
the whole-model checks, replay and scoring exclude) is the verifier's to say.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gonka_node.aggregator.close import equal_shares, reward_tree
from gonka_node.aggregator.shard import SHARDABLE_RULES, FragmentReport, Verdict, _by_host, _whole_norm

if TYPE_CHECKING:
    from gonka_node.aggregator.engine_types import EpochContext


def contradiction(verdict: Verdict, reports: Sequence[FragmentReport]) -> str | None:
    """Why `verdict` does not follow from `reports` (the S reports it names, by index), or None."""
    aggregated = list(verdict.aggregated)
    if aggregated != sorted(set(aggregated)):
        return "its aggregated hosts are not in increasing address order, each once"
    for check in (_unaccepted, _skipped, _clip_norms, _tau):
        why = check(verdict, reports)
        if why:
            return why
    return None


def _unaccepted(verdict: Verdict, reports: Sequence[FragmentReport]) -> str | None:
    for host in verdict.aggregated:
        missing = [r.index for r in reports if host not in _by_host(r)]
        if missing:
            return f"it aggregates 0x{host.hex()}, whose fragment shard(s) {missing} did not accept"
    return None


def _skipped(verdict: Verdict, reports: Sequence[FragmentReport]) -> str | None:
    skipped = [r.index for r in reports if r.skip]
    if verdict.aggregated and skipped:
        return f"it aggregates {len(verdict.aggregated)} host(s) though shard {skipped[0]} reported a skip"
    return None


def _clip_norms(verdict: Verdict, reports: Sequence[FragmentReport]) -> str | None:
    if set(verdict.clip_norms) != set(verdict.aggregated):
        return "its clip norms name other hosts than the ones it aggregates"
    for host in verdict.aggregated:
        want, got = _whole_norm(reports, host, clip=True), verdict.clip_norms[host]
        if not _same(got, want):
            return f"0x{host.hex()}'s clip norm is {got!r}; the reports' fragment norms sum to {want!r}"
    return None


def _tau(verdict: Verdict, reports: Sequence[FragmentReport]) -> str | None:
    if verdict.rule not in SHARDABLE_RULES:
        return f"rule {verdict.rule!r} cannot run sharded"
    want = expected_tau(verdict.rule, reports, verdict.aggregated)
    if verdict.tau is not None and not isinstance(verdict.tau, float):
        return f"τ is {verdict.tau!r}, not a number"
    if verdict.tau is None or want is None:
        return None if verdict.tau is want else f"τ is {verdict.tau!r}; under {verdict.rule!r} it is {want!r}"
    return None if _same(verdict.tau, want) else f"τ is {verdict.tau!r}; the reports' norms give {want!r}"


def expected_tau(rule: str, reports: Sequence[FragmentReport], aggregated: Sequence[bytes]) -> float | None:
    """The clip norm the verifier must use: `clip_median`'s median of the aggregated hosts' whole norms
    (summed as the ingest check sums them, as `shard._verdict` takes it); None under `mean`."""
    if rule == "mean" or not aggregated:
        return None
    return float(statistics.median(_whole_norm(reports, h, clip=False) for h in aggregated))


def rewards_contradiction(verdict: Verdict, ctx: EpochContext) -> str | None:
    """Why the verdict's rewards are not the round pool's equal shares among the hosts it aggregates
    (`close.equal_shares`, as the verifier pays them) under their Merkle root, or None."""
    rewards = equal_shares(ctx.reward_per_round, verdict.aggregated)
    tree = reward_tree(ctx, verdict.epoch, verdict.round, rewards)
    root = tree.root if tree is not None else bytes(32)
    if (verdict.rewards_root, verdict.total_reward) != (root, sum(rewards.values())):
        return "its rewards root or total is not the pool's equal shares among the hosts it aggregates"
    if {r.host for r in verdict.rows if r.aggregated} != set(verdict.aggregated):
        return "its rows mark other hosts aggregated than it aggregates"
    if any(r.reward != rewards.get(r.host, 0) for r in verdict.rows):
        return "its rows pay other amounts than the equal shares"
    return None


def _same(a: float, b: float) -> bool:
    """Equal as the same fp64 computation gives them (a NaN norm equals a NaN norm)."""
    return a == b or (math.isnan(a) and math.isnan(b))
