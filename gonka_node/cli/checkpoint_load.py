"""A checkpoint file opened for `checkpoint export|generate` and the model server: its tensors
hash-checked (against the chain with --epoch/--round), its model config from every source that names
one (the chain's recipe, the file's metadata, --recipe, --preset; they must agree), the tokenizer its
ids are in, and the `Llama` that holds it; `terminal_safe` for what a model writes to a terminal.
"""

from __future__ import annotations

import argparse
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gonka_node.cli import CliError
from gonka_node.cli.chain import open_client
from gonka_node.cli.checkpoint_chain import (
    chain_checkpoint,
    checked_recipe,
    epoch_model,
    epoch_recipe,
    recipe_model,
)

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer


@dataclass(frozen=True)
class Verified:
    tensors: dict[str, Any]
    config: Any  # training.model.ModelConfig
    sha256: str
    source: dict[str, str]  # provenance for the model card
    recipe: Any = None  # the epoch's Recipe (on chain, else --recipe), when there is one
    recipe_source: str = ""


def load_verified(args: argparse.Namespace) -> Verified:
    """The checkpoint's tensors, hash-checked (against the chain with --epoch/--round) and its config."""
    from training.checkpoint import CheckpointError, load_checkpoint

    if (args.epoch is None) != (args.round is None):
        raise CliError("--epoch and --round go together (to verify the file against the chain)")
    want = client = None
    shards = 1
    if args.epoch is not None:
        client = open_client(args)
        want = chain_checkpoint(client, args.epoch, args.round)
        recipe, _ = epoch_recipe(client, args.epoch, args.recipe)
        shards = recipe.shards if recipe is not None and want.round > 0 else 1
    try:
        # A sharded epoch's chain records the Merkle root over its fragments (checked after the load).
        expected = want.sha256.hex() if want is not None and shards == 1 else None
        checkpoint = load_checkpoint(args.checkpoint, expected_sha256=expected)
    except CheckpointError as exc:
        raise CliError(f"--checkpoint: {exc}") from None
    if want is not None and shards > 1:
        from gonka_node.core.fragments import model_root

        got = model_root(checkpoint.tensors, shards)
        if got != want.sha256:
            raise CliError(f"--checkpoint: {args.checkpoint}'s Merkle root over {shards} fragments is {got.hex()}, "
                           f"the chain records {want.sha256.hex()} for epoch {want.epoch} round {want.round}")
    source = {"file": args.checkpoint.name}
    if want is not None:
        source |= {"epoch": str(want.epoch), "round": str(want.round), "chain id": str(want.chain_id),
                   "registry": want.registry}
    config = _model_config(args, checkpoint.metadata, client)
    recipe, where = _known_recipe(args, client)
    return Verified(checkpoint.tensors, config, checkpoint.sha256, source, recipe, where)


def _known_recipe(args: argparse.Namespace, client: Any) -> tuple[Any, str]:
    """The epoch's recipe: on chain (with --epoch), else --recipe (checked against the chain then)."""
    if client is not None:
        return epoch_recipe(client, args.epoch, args.recipe)
    if args.recipe is not None:
        return checked_recipe(args.recipe, None, None), f"--recipe {args.recipe}"
    return None, ""


def _model_config(args: argparse.Namespace, metadata: dict[str, str], client: Any) -> Any:
    from training.hf_export import MODEL_CONFIG_KEY, ExportError, config_from_metadata
    from training.model import ModelConfig

    found = []
    if client is not None:  # the chain's word first: the metadata is checked against it, never trusted
        model, where = epoch_model(client, args.epoch, None)
        if model is not None:
            found.append((where, model))
    try:
        recorded = config_from_metadata(metadata)
    except ExportError as exc:
        raise CliError(f"{args.checkpoint}: {exc}") from None
    if recorded is not None:
        found.append((f"{args.checkpoint} metadata {MODEL_CONFIG_KEY!r}", recorded))
    if args.recipe is not None:
        found.append((f"--recipe {args.recipe}", recipe_model(args.recipe, args.epoch, client)))
    if args.preset is not None:
        try:
            found.append((f"--preset {args.preset}", ModelConfig.preset(args.preset)))
        except ValueError as exc:
            raise CliError(f"--preset: {exc}") from None
    if not found:
        raise CliError(
            f"{args.checkpoint} records no model config (metadata key {MODEL_CONFIG_KEY!r}): "
            "pass --recipe FILE or --preset NAME"
        )
    (first, config), *others = found
    for name, other in others:
        if other != config:
            raise CliError(f"{name} describes a different model than {first}: {other} vs {config}")
    return config


def recipe_tokenizer(recipe: Any, where: str, tokenizer_file: Path | None, model: Any = None) -> Tokenizer:
    """The tokenizer the checkpoint's ids are in: the recipe's (bytes, or its tokenizer.json: the file
    `tokenizer_file`, else the one stored with the recipe's dataset, refused unless its sha256 is the
    recipe's); with no recipe, `tokenizer_file` as it is, else bytes. Checked to fit `model`'s vocabulary."""
    from gonka_node.core.recipe import RecipeError
    from training.tokenizer import Bytes, HFTokenizer, TokenizerError

    named = None if recipe is None else recipe.tokenizer
    if named == "" and tokenizer_file is not None:
        raise CliError(f"--tokenizer {tokenizer_file}: {where} names the byte tokenizer; leave --tokenizer out")
    tokenizer: Tokenizer
    try:
        if tokenizer_file is not None:
            tokenizer = HFTokenizer.from_file(tokenizer_file, named or None)
        elif named:
            tokenizer = recipe.load_tokenizer()
        else:
            tokenizer = Bytes()
    except TokenizerError as exc:
        raise CliError(f"--tokenizer: {exc}") from None
    except RecipeError as exc:
        raise CliError(f"{where}: {exc}; give the epoch's tokenizer.json with --tokenizer FILE") from None
    if model is not None and tokenizer.vocab_size > model.vocab_size:
        raise CliError(f"the tokenizer has {tokenizer.vocab_size:,} tokens, more than the model's vocab_size "
                       f"{model.vocab_size:,}: not this model's tokenizer")
    return tokenizer


def terminal_safe(text: str) -> str:
    """Control characters other than newline and tab become U+FFFD: model output must not be able to
    send escape sequences to the user's terminal."""
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def load_model(tensors: dict[str, Any], config: Any, device: str) -> Any:
    """A `Llama` holding `tensors` (names and shapes checked against `config`)."""
    from training.hf_export import EMBED, LM_HEAD, ExportError, check_tensors
    from training.model import Llama

    try:
        check_tensors(tensors, config)
    except ExportError as exc:
        raise CliError(f"--checkpoint: {exc}") from None
    # Default init first (cheap next to reading the file); every tensor is overwritten below.
    model = Llama(config, device=device)
    if config.tie_embeddings:
        tensors = {LM_HEAD: tensors[EMBED], **tensors}  # an HF-style file may leave the tied head out
    model.load_state_dict(tensors)
    return model.eval()
