"""What the chain vouches for about a checkpoint: the sha256 it records for (epoch, round), and the
epoch's recipe and model config (the recipe published on chain, or a recipe file checked against the
epoch's model_spec_hash). `checkpoint` verbs and the model server's pull (gonka_node/serve/follow.py)
both ask here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError

ROUND_LATEST = "latest"


@dataclass(frozen=True)
class ChainCheckpoint:
    """The checkpoint sha256 the chain records for (epoch, round), and where that came from."""

    epoch: int
    round: int
    sha256: bytes
    chain_id: int
    registry: str


def check_epoch(client: Any, epoch: int) -> None:
    count = client.epoch_count()
    if not 1 <= epoch <= count:
        raise CliError(f"--epoch {epoch}: no such epoch on chain {client.chain_id} (it has epochs 1..{count})")


def _parse_round(text: str) -> int | None:
    if text == ROUND_LATEST:
        return None
    try:
        value = int(text)
    except ValueError:
        raise CliError(f"--round {text!r}: give a round number or 'latest'") from None
    if value < 0:
        raise CliError(f"--round {value}: must be >= 0")
    return value


def chain_checkpoint(client: Any, epoch: int, round_text: str) -> ChainCheckpoint:
    """The on-chain hash of a finalized round (round 0: the epoch's initial checkpoint)."""
    check_epoch(client, epoch)
    latest = client.latest_round(epoch)
    round_ = _parse_round(round_text)
    round_ = latest if round_ is None else round_
    if round_ > latest:
        raise CliError(
            f"--round {round_}: epoch {epoch} has no finalized round {round_} yet (latest finalized: {latest})"
        )
    if round_ == 0:
        sha = client.get_epoch(epoch).spec.init_checkpoint_hash
    else:
        sha = client.round_result(epoch, round_).checkpoint_sha256
    return ChainCheckpoint(epoch, round_, bytes(sha), client.chain_id, client.registry.address)


def epoch_model(client: Any, epoch: int, recipe_file: Path | None) -> tuple[Any, str]:
    """The epoch's ModelConfig from a source the chain vouches for (the recipe published on chain, else
    `recipe_file` checked against the epoch's model_spec_hash) and where it came from; (None, "") if none."""
    recipe, where = epoch_recipe(client, epoch, recipe_file)
    return (None, "") if recipe is None else (recipe.model, where)


def epoch_recipe(client: Any, epoch: int, recipe_file: Path | None) -> tuple[Any, str]:
    """The epoch's `Recipe` as `epoch_model` finds it, and where it came from; (None, "") if none."""
    import json

    from gonka_node.core.recipe import Recipe, RecipeError

    published = client.published_recipe(epoch)
    if published is not None:
        where = f"epoch {epoch}'s recipe on chain"
        try:
            return Recipe.from_dict(json.loads(published), where=where), where
        except (RecipeError, ValueError) as exc:
            raise CliError(f"{where} cannot be read by this node: {exc}") from None
    if recipe_file is not None:
        return checked_recipe(recipe_file, epoch, client), f"--recipe {recipe_file}"
    return None, ""


def recipe_model(path: Path, epoch: int | None, client: Any) -> Any:
    return checked_recipe(path, epoch, client).model


def checked_recipe(path: Path, epoch: int | None, client: Any) -> Any:
    """The recipe in `path`, checked against epoch `epoch`'s model_spec_hash when a chain is given."""
    from gonka_node.core.recipe import Recipe, RecipeError

    try:
        recipe = Recipe.load(path)
    except RecipeError as exc:
        raise CliError(str(exc)) from None
    if client is not None and epoch is not None:
        spec_hash = client.get_epoch(epoch).spec.model_spec_hash
        if spec_hash != recipe.sha256():
            raise CliError(
                f"--recipe {path}: hashes to {recipe.sha256().hex()}, epoch {epoch}'s "
                f"model_spec_hash on chain is {spec_hash.hex()}: not this epoch's recipe"
            )
    return recipe
