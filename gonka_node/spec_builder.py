"""An epoch spec from a recipe with every hash filled in, and the checks a spec must pass before a vote.

Governance holds a recipe (model, data, schedule; `gonka-node init epoch` writes a commented one) and
the terms (aggregators, rewards, replay probability, stake). `build_spec` completes the recipe (its data
manifest, computed from the corpus on this machine), computes the three hashes the chain records
(`model_spec_hash` = the recipe's sha256, `data_manifest_hash`, `init_checkpoint_hash` = the canonical
sha256 of the round-0 model, a pure function of the recipe) and returns the `EpochSpec`. `check_spec`
recomputes the same from a recipe and names every field that disagrees, so a spec is validated against
the recipe hosts will train, not only against its own syntax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from chain.types import EpochSpec
from gonka_node.core.recipe import EPOCH_DEFAULTS, Recipe, RecipeError
from gonka_node.epoch_setup import EpochTerms, check_openable, epoch_spec
from training.checkpoint import canonical_sha256
from training.codecs import get_codec
from training.model import build_model


@dataclass(frozen=True)
class BuiltSpec:
    spec: EpochSpec
    recipe: Recipe  # the recipe with its data manifest filled in: what hosts and aggregators load
    init_sha256: bytes


def load_epoch_recipe(path: Path, assignment_seed: str | None = None) -> Recipe:
    """The recipe in `path` for a real epoch: a field the file leaves out takes EPOCH_DEFAULTS (the data
    assignment seeded after sign-in, "signin-block"), and `assignment_seed`, when given, wins over both."""
    recipe = Recipe.load(path, EPOCH_DEFAULTS)
    if assignment_seed is None:
        return recipe
    return dataclasses.replace(recipe, assignment_seed=assignment_seed)


def initial_sha256(recipe: Recipe) -> bytes:
    """The canonical sha256 of the epoch's round-0 model (`epoch_setup.initial_checkpoint` writes it)."""
    model = build_model(recipe.model, recipe.init_seed)
    return bytes.fromhex(canonical_sha256({n: p.detach() for n, p in model.named_parameters()}))


def complete(recipe: Recipe, cache_dir: Path | None = None) -> Recipe:
    """The recipe with its data manifest: computed from the corpus here, or checked against it."""
    if not recipe.data_manifest_sha256:
        return recipe.with_data_manifest(cache_dir)
    recipe.windows(cache_dir)  # raises RecipeError when this machine's corpus is not the recorded one
    return recipe


def build_spec(recipe: Recipe, terms: EpochTerms, model_uri: str, cache_dir: Path | None = None) -> BuiltSpec:
    """The spec for `recipe` under `terms`; raises RecipeError / SpecError naming the field."""
    _check_replayable(recipe, terms.replay_probability)
    _check_codec(recipe.codec)
    full = complete(recipe, cache_dir)
    init = initial_sha256(full)
    return BuiltSpec(epoch_spec(full, init, terms, model_uri), full, init)


def check_spec(spec: EpochSpec, recipe: Recipe | None, cache_dir: Path | None = None) -> list[str]:
    """Every way `spec` is not an epoch of `recipe` (or, without one, cannot be trained), one line each."""
    problems = []
    try:
        _check_codec(spec.codec)
    except RecipeError as exc:
        problems.append(str(exc))
    if recipe is None:
        return problems
    try:
        recipe.check_against_chain(spec)
    except RecipeError as exc:
        problems.append(f"the spec does not describe this recipe: {exc}")
    try:
        _check_replayable(recipe, spec.replay_probability)
        complete(recipe, cache_dir)
    except RecipeError as exc:
        problems.append(str(exc))
    init = initial_sha256(recipe)
    if init != spec.init_checkpoint_hash:
        problems.append(f"init_checkpoint_hash: the spec says {spec.init_checkpoint_hash.hex()}, the recipe's "
                        f"round-0 model hashes to {init.hex()}")
    return problems


def _check_codec(codec: str) -> None:
    try:
        get_codec(codec)
    except ValueError as exc:
        raise RecipeError(f"codec: {exc}") from None


def _check_replayable(recipe: Recipe, p: float) -> None:
    # An aggregator refuses to replay a round that depends on a host's private AdamW state.
    if p > 0 and recipe.round_state != "fresh":
        raise RecipeError(
            f"round_state: replay probability {p:g} needs round_state = \"fresh\" in the recipe (with \"carry\" "
            "a host's round depends on its private optimizer state and cannot be replayed)"
        )
    check_openable(recipe, p)
