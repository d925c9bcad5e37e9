"""From a recipe to an epoch: the initial checkpoint, the on-chain `EpochSpec`, the aggregator's context.

Governance (or the devnet) calls `initial_checkpoint` and `epoch_spec`; an aggregator calls
`aggregator_context` after reading the epoch back from the chain, so what it enforces is what the chain
says, not what a local file claims.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chain.types import EpochInfo, EpochSpec
from chain.units import NGONKA_PER_GNK
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.replay import ReplayData
from gonka_node.aggregator.scoring import ScoringData
from gonka_node.aggregator.shard import ShardConfigError, shard_role
from gonka_node.core.recipe import Recipe, RecipeError, check_network_overlap
from training.codecs import get_codec
from training.hf_export import MODEL_CONFIG_KEY
from training.model import build_model
from training.streaming import stream_schedule


@dataclass(frozen=True)
class EpochTerms:
    """The parts of an epoch that are about people and money rather than the model."""

    aggregators: Sequence[str]
    round_length_s: int = 600
    signin_window_s: int = 60
    min_stake: int = NGONKA_PER_GNK  # ngonka; the chain requires min_stake × replay_probability ≥ reward_per_round
    max_hosts: int = 16
    reward_per_round: int = 0  # ngonka
    aggregator_quorum: int = 1
    replay_probability: float = 1.0  # p: each host's round is recomputed with this probability
    challenge_window_s: int = 3600  # stake stays locked this long after the epoch; challenges accepted
    challenge_bond: int = NGONKA_PER_GNK  # ngonka a challenger escrows

    @classmethod
    def staked_for(cls, reward_per_round: int, replay_probability: float, **kw: Any) -> EpochTerms:
        """Terms whose min_stake is the least the stake rule allows: ⌈reward_per_round / p⌉."""
        stake = math.ceil(reward_per_round / replay_probability) if replay_probability > 0 else 0
        return cls(min_stake=stake, reward_per_round=reward_per_round, replay_probability=replay_probability, **kw)


def initial_checkpoint(recipe: Recipe, path: Path) -> bytes:
    """Write the epoch's round-0 model (a pure function of the recipe) and return its canonical sha256."""
    model = build_model(recipe.model, recipe.init_seed)
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    metadata = {"round": "0", "recipe_sha256": recipe.sha256().hex(), MODEL_CONFIG_KEY: _model_json(recipe)}
    return TrainingCheckpoints().save(path, tensors, metadata)


def _model_json(recipe: Recipe) -> str:
    return json.dumps(recipe.model.to_dict(), sort_keys=True)


def epoch_spec(recipe: Recipe, init_sha256: bytes, terms: EpochTerms, model_uri: str) -> EpochSpec:
    check_network_overlap(recipe)
    if not recipe.data_manifest_sha256:
        raise RecipeError("data_manifest_sha256: fill it in (Recipe.with_data_manifest) before scheduling")
    return EpochSpec(
        model_spec_hash=recipe.sha256(),
        model_uri=model_uri,
        data_manifest_hash=bytes.fromhex(recipe.data_manifest_sha256),
        init_checkpoint_hash=init_sha256,
        inner_steps=recipe.inner_steps,
        inner_lr=recipe.inner_lr,
        batch_size=recipe.batch_size,
        outer_lr=recipe.outer_lr,
        outer_momentum=recipe.outer_momentum,
        codec=recipe.codec,
        n_rounds=recipe.n_rounds,
        round_length=terms.round_length_s,
        signin_window=terms.signin_window_s,
        min_stake=terms.min_stake,
        max_hosts=terms.max_hosts,
        aggregators=tuple(terms.aggregators),
        aggregator_quorum=terms.aggregator_quorum,
        reward_per_round=terms.reward_per_round,
        replay_probability=terms.replay_probability,
        challenge_window=terms.challenge_window_s,
        challenge_bond=terms.challenge_bond,
    )


def aggregator_context(
    recipe: Recipe,
    info: EpochInfo,
    *,
    chain_id: int,
    registry: str,
    init_path: Path,
    cache_dir: Path | None = None,
    heldout_windows: int = 8,
    scoring: bool = True,
    beacon: Callable[[], bytes] | None = None,
) -> EpochContext:
    """The aggregator's view of an epoch, checked against the chain's record of it. `beacon` reads the
    assignment's post-sign-in randomness (`signin_beacon`); required when the recipe's assignment_seed
    is "signin-block", so that scoring and replay read the windows the hosts trained on."""
    check_network_overlap(recipe)
    if recipe.assignment_seed == "signin-block" and beacon is None and scoring:
        raise RecipeError("assignment_seed: 'signin-block' needs the chain's sign-in beacon to score hosts")
    spec = info.spec
    recipe.check_against_chain(spec)
    if scoring and spec.replay_probability > 0 and recipe.round_state != "fresh":
        raise RecipeError(
            f"epoch {info.epoch} replays hosts with probability {spec.replay_probability:g}, which needs a recipe "
            "with round_state = 'fresh' (with 'carry' a host's round depends on its private AdamW state)"
        )
    if scoring:
        check_openable(recipe, spec.replay_probability)
    checkpoints = TrainingCheckpoints()
    if not init_path.exists():
        initial_checkpoint(recipe, init_path)
    init = checkpoints.load(init_path, spec.init_checkpoint_hash)
    windows = recipe.windows(cache_dir)
    shapes = {n: tuple(t.shape) for n, t in init.items()}
    return EpochContext(
        chain_id=chain_id,
        registry=bytes.fromhex(registry[2:]),
        epoch=info.epoch,
        codec_name=spec.codec,
        codec=get_codec(spec.codec),
        spec=shapes,
        n_rounds=spec.n_rounds,
        round_length_s=float(spec.round_length),
        outer_lr=spec.outer_lr,
        outer_momentum=spec.outer_momentum,
        reward_per_round=spec.reward_per_round,
        initial_checkpoint=init_path,
        initial_sha256=spec.init_checkpoint_hash,
        epoch_seed=recipe.epoch_seed,
        model_factory=(lambda: build_model(recipe.model, recipe.init_seed)) if scoring else None,
        scoring=ScoringData(
            windows,
            recipe.epoch_seed,
            spec.max_hosts,
            recipe.inner_config().windows_per_round,
            heldout_windows,
            beacon,
        )
        if scoring
        else None,
        model_config=_model_json(recipe),
        replay=ReplayData(
            lambda: build_model(recipe.model, recipe.init_seed),
            recipe.inner_config(),
            windows,
            recipe.epoch_seed,
            spec.max_hosts,
            beacon,
        )
        if scoring and recipe.round_state == "fresh"
        else None,
        replay_probability=spec.replay_probability if scoring else 0.0,
        recipe_json=recipe.canonical_json(),
        overlap=recipe.overlap,
        forecast_step=recipe.forecast_step,
        merge_step=recipe.merge_step,
        broadcast=recipe.broadcast,
        ef_decay=recipe.ef_decay,
        residual_sample=recipe.residual_sample,
        residual_sample_min=recipe.residual_sample_min,
        stream=stream_schedule(recipe, shapes, first_round=1),
    )


def check_openable(recipe: Recipe, p: float) -> None:
    """A replayed (p > 0) epoch whose codec opens residuals (top-k: docs/PROTOCOL.md "Challenge and opening")
    is judged on openings, built only where the aggregator holds their inputs: a sharded epoch's verifier
    would need every shard's openings. Governance refuses such an epoch, and so does an aggregator (its
    dense replay would fail, and slash, every honest top-k host). Overlapped epochs open: a host keeps
    each round's state until the round is final, and answers its challenge while it trains the next."""
    if p <= 0 or not _opens_residual(recipe.codec):
        return
    if recipe.shards > 1:
        raise RecipeError(f"shards: a top-k epoch with replay probability {p:g} needs shards = 1 (a sharded "
                          "verifier cannot check residual openings yet)")


def _opens_residual(codec: str) -> bool:
    try:
        return get_codec(codec).opens_residual
    except ValueError:  # an unknown codec: the spec's own check says so
        return False


def beacon_reader(read: Callable[[int], bytes], epoch: int) -> Callable[[], bytes]:
    """`read` (a `ChainClient.signin_beacon`) for one epoch, asked once it answers: the block is final."""
    found: list[bytes] = []

    def beacon() -> bytes:
        if not found:
            found.append(read(epoch))
        return found[0]

    return beacon


def shard_context(ctx: EpochContext, recipe: Recipe, info: EpochInfo, me: bytes, rule: str) -> EpochContext:
    """`ctx` as shard i of a sharded epoch (recipe.shards > 1; docs/PROTOCOL.md "Sharded aggregators"):
    its spec is its fragment's. Its scoring and replay data stay: every shard computes the replay pick
    (to put the picked hosts' fragment payloads where the verifier reads them) and shard 0, the
    verifier, replays and scores those hosts on their reassembled whole updates. An unsharded recipe
    returns `ctx` unchanged."""
    if recipe.shards == 1:
        return ctx
    aggregators = [bytes.fromhex(a[2:]) for a in info.spec.aggregators]
    if len(aggregators) != recipe.shards or info.spec.aggregator_quorum != recipe.shards:
        raise ShardConfigError(
            f"epoch {info.epoch}: the recipe has {recipe.shards} shards, but the epoch names {len(aggregators)} "
            f"aggregators with quorum {info.spec.aggregator_quorum} (both must equal the shard count)"
        )
    role = shard_role(ctx.spec, aggregators, me, rule)
    assert role is not None
    return dataclasses.replace(ctx, spec=role.spec, shard=role)
