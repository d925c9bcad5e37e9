"""What closing a round computes, from files on disk only: the checks, scores, the robust aggregate,
the outer step, the new checkpoint and the rewards. Deterministic given the round's seed: a crash
here is recovered by running it again. Peak memory: the base model, the new model, the aggregate, a
scoring model and one decoded update — independent of the number of hosts (updates are decoded from
disk one at a time; the similarity checks read 16 KB sketches).

The caller gathers a round's inputs in one `ClosingInputs`; a close is then a `Closing` record passed
through `CHECKS` in order, each returning the hosts it excludes and why; then the survivors are scored (a gate: the score must be positive) and the round's reward is
split equally among those that pass (`equal_shares`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from eth_utils import to_checksum_address
from safetensors.torch import load_file, save_file
from torch import Tensor

from chain.merkle import RewardTree
from gonka_node.aggregator import robust
from gonka_node.aggregator.broadcast import Broadcast, prepare_broadcast, residual_path
from gonka_node.aggregator.challenges import challenges_round
from gonka_node.aggregator.checks import (
    Labelled,
    find_copies,
    find_dissenters,
    find_mixtures,
    find_resubmissions,
    mixture_residuals,
)
from gonka_node.aggregator.eager import EagerBases
from gonka_node.aggregator.opened_replay import Judged, Opened, opened_verdict
from gonka_node.aggregator.outer_state import read_outer_state
from gonka_node.aggregator.replay import chosen_for_replay, replay_comparison, verdict
from gonka_node.aggregator.scoring import Scorer
from gonka_node.aggregator.store import ContributionRow, RoundRow, Store, SubmissionRow
from gonka_node.aggregator.validate import count_sketch, decode_update
from gonka_node.core.config import AggregationSettings
from training.codecs import round_seed
from training.diloco import OuterOptimizer
from training.durable import atomic_write, durable_replace
from training.hf_export import MODEL_CONFIG_KEY
from training.inner import evaluate
from training.model import Llama
from training.residual_commit import commitment_layout
from training.streaming import step_fragment

if TYPE_CHECKING:
    from gonka_node.aggregator.engine_types import CheckpointIO, EpochContext

log = logging.getLogger(__name__)
PUBLIC_ROUNDS = 16  # earlier aggregates in the mixture check's public span
MIN_SCORE_STEP = 0.05  # the smallest fraction of an update a held-out score applies (score_step)
NOT_SAMPLED = "not sampled for the whole-model checks: scores 1"  # a sharded verifier's unpicked host


@dataclass(frozen=True)
class RoundOutcome:
    checkpoint_sha256: bytes
    rewards_root: bytes
    total_reward: int
    rule: str
    contributions: list[ContributionRow]
    aggregated: int
    heldout: tuple[float, float] | None = None  # held-out loss before and after the outer step


@dataclass
class Closing:
    """One close in progress: its inputs, and the reasons and exclusions found so far."""

    ctx: EpochContext
    round_row: RoundRow
    seed: bytes  # the round's commit–reveal seed (chain): decides the replay pick
    submissions: list[SubmissionRow]
    earlier: list[SubmissionRow]  # every submission of the epoch's earlier rounds
    slots: Mapping[bytes, int]
    base: Mapping[str, Tensor]
    public: list[Labelled]  # sketches of what everyone holds: the base model, earlier aggregates
    decode: Callable[[SubmissionRow], dict[str, Tensor]]
    aggregation: AggregationSettings
    reasons: dict[bytes, list[str]] = field(default_factory=dict)
    excluded: set[bytes] = field(default_factory=set)
    replayed: set[bytes] = field(default_factory=set)  # hosts whose round the replay reproduced
    vetoed: set[bytes] = field(default_factory=set)  # hosts fitting held-out data better than their windows
    eager: EagerBases | None = None  # overlap = "eager": each host's own training base (aggregator/eager.py)
    opened: Mapping[bytes, Opened] = field(default_factory=dict)  # top-k: each challenged host's opening

    def __post_init__(self) -> None:
        self.reasons = {s.host: [] for s in self.submissions}

    def live(self) -> list[SubmissionRow]:
        return [s for s in self.submissions if s.host not in self.excluded]

    def exclude(self, found: Mapping[bytes, str]) -> None:
        for host, why in found.items():
            if host not in self.excluded:
                self.reasons[host].append(why)
                self.excluded.add(host)


Check = Callable[[Closing], Mapping[bytes, str]]  # {host: why it is excluded}


def copies(c: Closing) -> Mapping[bytes, str]:
    return find_copies(c.submissions, c.aggregation.copy_cosine)


def resubmissions(c: Closing) -> Mapping[bytes, str]:
    return find_resubmissions(c.live(), c.earlier, c.aggregation.copy_cosine)


def departed(c: Closing) -> Mapping[bytes, str]:
    why = "host is no longer signed in to the epoch (left or slashed)"
    return {s.host: why for s in c.submissions if s.host not in c.slots}


def mixtures(c: Closing) -> Mapping[bytes, str]:
    residuals = mixture_residuals(c.submissions, c.public)
    found = find_mixtures(c.submissions, c.public, c.aggregation.mix_residual, residuals)
    for host, (whole, _) in residuals.items():
        if host not in found and host not in c.excluded:  # how far above the bar: the honest margin
            c.reasons[host].append(f"mix check: sketch residual {whole:.4f} (bar {c.aggregation.mix_residual:g})")
    return {h: why for h, why in found.items() if h not in c.excluded and h not in c.replayed}


def replays(c: Closing) -> Mapping[bytes, str]:
    """Recompute the picked hosts' rounds (gonka_node/aggregator/replay.py); exclude mismatches. In a
    top-k epoch the update compared is the one a host's opened residual claims (aggregator/opened_replay.py)."""
    p = c.ctx.replay_probability
    if c.ctx.replay is None or p <= 0:
        return {}
    row, found = c.round_row, {}
    layout = commitment_layout(c.ctx.spec, c.ctx.codec) if challenges_round(c.ctx) else None
    live = c.live()
    for s in live:
        if s.host not in chosen_for_replay(p, c.seed, row.round, [s.host]):
            continue
        slot = c.slots[s.host]
        # built for picked hosts only; an eager round's late forecast or merge moves it on the way (`rebases`)
        base, rebases = (c.base, []) if c.eager is None else c.eager.base_for(c.base, s.host)
        if layout is not None:
            opened = c.opened.get(s.host, Opened((), 0, None, None))
            judged = Judged(row.round, slot, Path(s.path), c.decode(s), base, rebases)
            passed, why = opened_verdict(c.ctx, layout, c.aggregation, judged, opened)
            del base, rebases, judged
        else:
            cos, ratio = replay_comparison(c.ctx.replay, row.round, slot, base, c.decode(s), rebases)
            del base, rebases
            passed, why = verdict(
                row.round, slot, cos, ratio, c.aggregation.replay_min_cosine, c.aggregation.replay_norm_tolerance
            )
        if passed:
            c.reasons[s.host].append(why)
            c.replayed.add(s.host)
        else:
            log.warning("round %d: host 0x%s excluded: %s", row.round, s.host.hex(), why)
            found[s.host] = why
    return found


def dissent(c: Closing) -> Mapping[bytes, str]:
    found = find_dissenters(c.submissions, c.excluded, c.aggregation.consensus_fraction)
    return {h: why for h, why in found.items() if h not in c.replayed}


# In this order: each later check sees only what the earlier ones left. A replay mismatch is proof
# (slashable) while mixtures, dissent and the score are statistics, so a picked host is judged by its
# replay first (a mix or a reused aggregate that is picked is slashed, not merely excluded), and a host
# whose replay passed is not excluded by a statistic afterwards: it did exactly the training the recipe
# prescribes. The dissent reference is a median over updates already known to be the hosts' own work.
CHECKS: tuple[Check, ...] = (copies, resubmissions, departed, replays, mixtures, dissent)


@dataclass(frozen=True, kw_only=True)
class ClosingInputs:
    """Everything one close reads, gathered by the caller (`RoundEngine`) before anything is computed."""

    ctx: EpochContext
    round_row: RoundRow
    seed: bytes  # the round's commit–reveal seed (chain): decides the replay pick
    submissions: list[SubmissionRow]
    slots: Mapping[bytes, int]  # the epoch's members now: a host missing here has left or was slashed
    base_path: Path  # the round's training base
    step_base: tuple[Path, bytes] | None = None  # the model the outer step applies to, if not the base
    prev_residual: Path | None = None  # the compressed broadcast's residual after the previous round
    earlier: list[SubmissionRow] = field(default_factory=list)  # every submission of earlier rounds
    prev_outer_state: Path | None  # the outer momentum after the previous round (None: fresh)
    eager: EagerBases | None = None  # overlap = "eager": what each host's training base is made of
    opened: Mapping[bytes, Opened] = field(default_factory=dict)  # top-k: each challenged host's opening
    # the members' node keys: a sharded verifier checks each shard's payload blob against the host's signature
    node_keys: Mapping[bytes, bytes] = field(default_factory=dict)
    store: Store
    checkpoints: CheckpointIO
    aggregation: AggregationSettings


def compute_outcome(inputs: ClosingInputs) -> RoundOutcome:
    i = inputs
    ctx, round_row, submissions, store, aggregation = i.ctx, i.round_row, i.submissions, i.store, i.aggregation
    checkpoints, step_base = i.checkpoints, i.step_base
    epoch, round_ = round_row.epoch, round_row.round
    base = checkpoints.load(i.base_path, round_row.base_sha256)

    spec, offsets = ctx.spec_for(round_), ctx.offsets_for(round_)  # a streamed round's: its fragment

    def decode(sub: SubmissionRow) -> dict[str, Tensor]:
        update = decode_update(ctx.codec_for(round_), Path(sub.path).read_bytes(), spec)
        return {name: t.float() for name, t in update.items()}

    public = public_tensors(store, epoch, round_, base, offsets)
    c = Closing(ctx, round_row, i.seed, submissions, i.earlier, i.slots, base, public, decode, aggregation,
                eager=i.eager, opened=i.opened)
    for check in CHECKS:
        c.exclude(check(c))
    consensus_checked = len(c.live()) >= 4 and aggregation.consensus_fraction > 0  # dissent could run
    scores = _scores(c)
    c.exclude(gate(c, scores, consensus_checked))
    eligible = c.live()
    rule = aggregation.rule_for(epoch)
    if not eligible:
        rows = [ContributionRow(s.host, scores[s.host], 0, False, c.reasons[s.host]) for s in submissions]
        return RoundOutcome(round_row.base_sha256, bytes(32), 0, rule, rows, 0)

    def source() -> Iterator[tuple[str, Mapping[str, Tensor]]]:
        for sub in eligible:  # store order: increasing host address, the averaging order
            yield sub.host.hex(), decode(sub)

    agg = robust.aggregate(
        rule, source, {s.host.hex(): s.norm for s in eligible}, spec, aggregation.centered_clip_iters
    )
    # The outer step applies to the latest global model, which is the round's training base unless the
    # recipe overlaps rounds (then the base is one round older: training/overlap.py).
    step_from = base if step_base is None else checkpoints.load(*step_base)
    params = {name: t.float().clone() for name, t in step_from.items()}
    del base, step_from
    # With broadcast "codec" the model is defined by the decoded broadcast (aggregator/broadcast.py).
    sent = prepare_broadcast(ctx.broadcast, agg.update, ctx.codec_name, round_seed(ctx.epoch_seed, round_),
                             i.prev_residual, part=ctx.stream is not None)
    update = sent.update
    outer = OuterOptimizer(ctx.outer_lr, ctx.outer_momentum)
    if i.prev_outer_state is not None:
        outer.restore(*read_outer_state(i.prev_outer_state))
    if ctx.stream is None:
        outer.step(params, update)
    else:  # the fragment alone, each tensor with its own momentum (training/streaming.py)
        step_fragment(outer, params, update)
    meta = {
        "epoch": str(epoch),
        "round": str(round_),
        "base_sha256": round_row.base_sha256.hex(),
        "rule": rule,
    }
    if ctx.model_config is not None:
        meta[MODEL_CONFIG_KEY] = ctx.model_config
    sha = checkpoints.save(store.checkpoint_path(epoch, round_), params, meta)
    save_broadcast(store.update_path(epoch, round_), sent, meta)
    sketch = count_sketch(update, offsets=offsets).numpy().tobytes()
    atomic_write(_sketch_path(store, epoch, round_), lambda tmp: tmp.write_bytes(sketch))
    _save_durably(store.outer_state_path(epoch, round_), outer.buffers, {"steps": str(outer.steps)})  # no copy
    heldout = heldout_losses(c, params, step_base)
    rewards = equal_shares(ctx.reward_per_round, [s.host for s in eligible])
    rows = [
        ContributionRow(
            s.host, scores[s.host], rewards.get(s.host, 0), s.host not in c.excluded, c.reasons[s.host]
        )
        for s in submissions
    ]
    tree = reward_tree(ctx, epoch, round_, rewards)
    root = tree.root if tree is not None else bytes(32)
    return RoundOutcome(sha, root, sum(rewards.values()), rule, rows, len(eligible), heldout)


def heldout_losses(
    c: Closing, params: Mapping[str, Tensor], step_base: tuple[Path, bytes] | None = None
) -> tuple[float, float] | None:
    """The round's held-out loss (mean cross-entropy per token) of its base model and of its new
    checkpoint, on the held-out windows the round was scored on: what clients chart as the loss curve.
    Two forward passes over those windows, against the scoring's one per update. None when the epoch
    is not scored (no model or data to measure with)."""
    if c.ctx.model_factory is None or c.ctx.scoring is None:
        return None
    batch = c.ctx.scoring.heldout(c.round_row.round, c.round_row.base_sha256)
    model = c.ctx.model_factory()
    before = c.base if step_base is None else _load_plain(step_base[0])  # the model the step started from
    return _loss(model, before, batch), _loss(model, params, batch)


def _load_plain(path: Path) -> dict[str, Tensor]:
    return {name: t.float() for name, t in load_file(str(path)).items()}


@torch.no_grad()
def _loss(model: Llama, params: Mapping[str, Tensor], batch: tuple[Tensor, Tensor]) -> float:
    for name, p in model.named_parameters():
        p.copy_(params[name])
    return evaluate(model, [batch], autocast="off")


def public_tensors(
    store: Store, epoch: int, round_: int, base: Mapping[str, Tensor], offsets: Mapping[str, int] | None = None
) -> list[Labelled]:
    """Sketches of what every host holds without training: the round's base model, and the aggregated
    updates of the epoch's latest PUBLIC_ROUNDS finalized rounds (older ones are as stale as any old
    work, and the resubmission check compares with all earlier submissions). `offsets`: the round's
    updates hold these tensors alone (a streamed round's fragment), so the base is sketched as they are."""
    held = base if offsets is None else {n: base[n] for n in offsets}
    out: list[Labelled] = [("the base model", count_sketch({n: t.float() for n, t in held.items()}, offsets=offsets))]
    for r in range(round_ - 1, max(0, round_ - 1 - PUBLIC_ROUNDS), -1):
        path = _sketch_path(store, epoch, r)
        if path.exists():
            out.append((f"round {r}'s aggregate", torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)))
    return out


def _sketch_path(store: Store, epoch: int, round_: int) -> Path:
    return store.update_path(epoch, round_).with_suffix(".sketch")


def _scores(c: Closing, only: Collection[bytes] | None = None) -> dict[bytes, float]:
    """Each live update's score, taken on the update as the aggregate will use it: clipped to the round's
    median update norm (clip_median), so sending 3·Δ scores no better than Δ (and pay does not follow the
    score anyway: `equal_shares`). The held-out rule takes it at the update's share of the outer step
    (`score_step`): whether it points downhill on unseen text, not whether one host's local model, a
    full step away, overshoots (honest fresh-round updates often do alone, and help in the average). A
    host whose round the replay reproduced is not vetoed for fitting held-out data better than its
    assignment: the replay proved what it trained on. `only`: score just these hosts (a sharded
    verifier's sampled ones: shard.py); any other live host scores 1, its reasons say why."""
    if c.ctx.model_factory is None or c.ctx.scoring is None:
        for s in c.submissions:
            c.reasons[s.host].append("scoring disabled for this epoch: every valid update scores 1")
        return {s.host: 1.0 for s in c.submissions}
    live = c.live()
    out: dict[bytes, float] = {s.host: 0.0 for s in c.submissions}
    if not live:
        return out
    heldout = c.ctx.scoring.heldout(c.round_row.round, c.round_row.base_sha256)
    scorer = Scorer(c.ctx.model_factory(), c.base, heldout, c.aggregation.score_rule)
    tau = float(statistics.median(s.norm for s in live))
    step = score_step(c.ctx.outer_lr, len(live)) if c.aggregation.score_rule == "heldout_gain" else 1.0
    for s in live:
        if only is not None and s.host not in only:
            out[s.host] = 1.0
            c.reasons[s.host].append(NOT_SAMPLED)
            continue
        assigned = c.ctx.scoring.assigned(c.round_row.round, c.slots[s.host])
        clip = min(1.0, tau / s.norm) if s.norm > 0 else 0.0
        factor = torch.tensor(clip * step, dtype=torch.float32)
        delta = {n: t * factor for n, t in c.decode(s).items()}
        result = scorer.score(delta, assigned, veto=s.host not in c.replayed)
        c.reasons[s.host].extend(result.reasons())
        out[s.host] = result.score
        if result.vetoed:
            c.vetoed.add(s.host)
    return out


def gate(c: Closing, scores: Mapping[bytes, float], consensus_checked: bool) -> dict[bytes, str]:
    """Who the score excludes. Never a host whose replay passed. A veto (fits held-out data
    significantly better than its own assignment) always. A score at or below `min_score` only where the
    dissent check could not run (fewer than four hosts): with four or more, an update that agrees with
    the round's consensus stays in even when its own held-out sample says it alone points uphill, which
    honest fresh-round updates measurably do (1 of 24 host-rounds, 8 hosts, devnet model) and which the
    average of honest updates absorbs."""
    out = {}
    for s in c.live():
        if s.host in c.replayed:
            continue
        if s.host in c.vetoed:
            out[s.host] = "vetoed: fits held-out data better than its assignment; not aggregated"
        elif scores[s.host] <= c.aggregation.min_score and not consensus_checked:
            out[s.host] = f"score {scores[s.host]:+.5f} at or below {c.aggregation.min_score}: not aggregated"
    return out


def score_step(outer_lr: float, n_live: int) -> float:
    """The fraction of an update a held-out score applies: its share of the outer step (outer lr / hosts),
    at least MIN_SCORE_STEP so that the loss difference stays far above fp32 rounding with many hosts."""
    return min(1.0, max(MIN_SCORE_STEP, outer_lr / max(1, n_live)))


def equal_shares(pool: int, hosts: Sequence[bytes]) -> dict[bytes, int]:
    """The round's pool in equal integer shares among the hosts that passed every check (floor; the
    dust stays unpaid). Every host trains the same recipe on the same number of tokens, so honest
    updates are worth the same in expectation; paying by score would pay luck (which windows a host
    drew), and whatever inflates a score (a longer update, training on the held-out split the score
    reads) would pay more. The score is a gate, not a weight."""
    if pool <= 0 or not hosts:
        return {}
    share = pool // len(hosts)
    return {h: share for h in hosts} if share > 0 else {}


def reward_tree(ctx: EpochContext, epoch: int, round_: int, rewards: Mapping[bytes, int]) -> RewardTree | None:
    """The round's reward Merkle tree over the hosts paid (amount > 0): its root is what finalizing sends
    to the chain, its proofs what hosts claim with. None when nobody is paid (the root is then zero)."""
    paid = [(to_checksum_address(h), a) for h, a in rewards.items() if a > 0]
    if not paid:
        return None
    return RewardTree(ctx.chain_id, to_checksum_address(ctx.registry), epoch, round_, paid)


def save_broadcast(update_file: Path, sent: Broadcast, meta: dict[str, str]) -> None:
    """The round's update file (fp32 safetensors, or the codec payload and its residual beside it)."""
    if sent.payload is None:
        _save_durably(update_file, sent.update, meta)
        return
    payload, residual = sent.payload, sent.residual
    assert residual is not None
    atomic_write(update_file, lambda tmp: tmp.write_bytes(payload))
    _save_durably(residual_path(update_file), residual, meta)


def _save_durably(path: Path, tensors: Mapping[str, Tensor], metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, str(tmp), metadata=metadata)
    durable_replace(tmp, path)


