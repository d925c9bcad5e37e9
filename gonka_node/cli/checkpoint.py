"""`gonka-node checkpoint list|pull|export|generate`: the client side of trained checkpoints.

`list` reads epochs and round results from the chain. `pull` streams a checkpoint from an
aggregator's Checkpoints service (TLS, trusting only the certificate the aggregator announced on chain,
or the file `--tls-cert` names; gonka_node/core/discovery.py) into a temporary file next to the target, checks the transfer
(length and file sha256 announced by the stream) and then the canonical tensor sha256 against the
hash the chain records for that round; only a verified file is renamed into place, anything else is
deleted. `export --format hf` writes a Hugging Face Llama folder and `generate` samples text; both
verify the file's canonical sha256 first (against the chain when `--epoch/--round` are given).

The model config comes from the epoch's recipe when it is published on chain (`Registry.publish_recipe`
checks it hashes to the epoch's model_spec_hash), from the checkpoint's metadata (`model_config`) when
its writer stored it, from `--recipe FILE` (checked against the epoch's model spec hash when `--epoch` is
given) or `--preset NAME`; two sources that disagree are an error, and the tensors are checked against it.

The chain's checkpoint hash covers tensors only, so a pulled file's metadata is not vouched for by it:
`pull` compares the file's `model_config` with the epoch's recipe (on chain, or `--recipe`) and deletes a
file whose metadata says otherwise; where no recipe can be had, it strips that metadata instead of
keeping an unverified claim.

This module holds the verbs; what they build on lives beside it, one job each: `checkpoint_chain.py`
(what the chain vouches for: a round's hash, the epoch's recipe), `checkpoint_pull.py` (the verified
transfer), `checkpoint_fragments.py` (a sharded round, every fragment merged), `checkpoint_one_fragment.py`
(`--fragment K`: one fragment checked alone by its Merkle proof) and `checkpoint_load.py` (a local file
verified and loaded, its config and tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gonka_node.cli import CliError
from gonka_node.cli.chain import add_connection_args, chain_errors, open_client
from gonka_node.cli.checkpoint_chain import ChainCheckpoint, chain_checkpoint, check_epoch, epoch_recipe
from gonka_node.cli.checkpoint_load import load_model, load_verified, recipe_tokenizer, terminal_safe
from gonka_node.cli.checkpoint_pull import DEFAULT_MAX_BYTES, MESSAGE_LIMIT, check_aggregator, pull_checkpoint
from gonka_node.cli.verbs import add_group, add_verb
from gonka_node.core.tls import TlsError, pinned_channel

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    from gonka_node.cli.names import PRESET_NAMES as PRESETS

    actions = add_group(subparsers, "checkpoint", help="list, pull, export and sample trained checkpoints")

    listing = add_verb(
        actions, "list", help="epochs and rounds with their on-chain sha256, and where to pull them", amounts=True,
        examples=["gonka-node checkpoint list --deployment deployment.json", "gonka-node checkpoint list --epoch 1"],
        next="gonka-node checkpoint pull --epoch E --round latest",
    )
    add_connection_args(listing, need_key=False)
    listing.add_argument("--epoch", type=int, help="only this epoch")
    listing.set_defaults(func=chain_errors(_list))

    pull = add_verb(
        actions, "pull", help="download a checkpoint from an aggregator, verified against the chain",
        examples=["gonka-node checkpoint pull --epoch 1 --round latest --out model.safetensors",
                  "gonka-node checkpoint pull --epoch 1 --round 3 --aggregator HOST:PORT --tls-cert cert.pem",
                  "gonka-node checkpoint pull --epoch 2 --round latest --fragment 1"],
        next="gonka-node checkpoint export --checkpoint FILE --out hf-model (or generate --checkpoint FILE)",
    )
    add_connection_args(pull, need_key=False)
    pull.add_argument("--aggregator", metavar="HOST:PORT",
                      help="aggregator gRPC address (default: the first one the epoch's aggregators announced on chain)")
    pull.add_argument(
        "--tls-cert", type=Path, metavar="FILE",
        help="trust this certificate file (an aggregator's <data_dir>/tls/cert.pem) instead of the one the "
        "aggregator announced on chain",
    )
    pull.add_argument("--epoch", type=int, required=True, help="epoch number")
    pull.add_argument("--round", required=True, help="round number (0: the initial checkpoint) or 'latest'")
    pull.add_argument("--out", type=Path, help="file to write (default: epoch-E-round-R.safetensors)")
    pull.add_argument("--force", action="store_true", help="replace an existing --out file")
    pull.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole download")
    pull.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="largest file accepted")
    pull.add_argument("--recipe", type=Path,
                      help="the epoch's recipe file, to verify the file's model config when the chain has none")
    pull.add_argument("--fragment", type=int, metavar="K",
                      help="a sharded epoch (recipe shards S > 1): only fragment K (0 to S-1), from shard K, checked "
                      "alone against the chain's root by its Merkle proof (default: every fragment, merged)")
    pull.set_defaults(func=chain_errors(_pull))

    export = add_verb(
        actions, "export", help="write a Hugging Face Llama folder (transformers, AutoTokenizer and "
        "pipeline load it)",
        examples=["gonka-node checkpoint export --checkpoint epoch-1-round-3.safetensors --out hf-model",
                  "gonka-node checkpoint export --checkpoint FILE --epoch 1 --round 3 --out hf-model"],
        next="python -c \"from transformers import pipeline; print(pipeline('text-generation', "
        "model='hf-model')('def '))\"",
    )
    _add_checkpoint_args(export, PRESETS)
    export.add_argument("--format", choices=("hf",), default="hf", help="output format (default hf)")
    export.add_argument("--out", type=Path, required=True, help="output folder (must not exist or be empty)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="cast the weights")
    export.add_argument("--tokenizer", type=Path, metavar="FILE",
                        help="the epoch's tokenizer.json, shipped with the model and checked against the recipe's "
                        "sha256 (default: the recipe's, from its dataset; none for the byte tokenizer)")
    export.set_defaults(func=chain_errors(_export))

    generate = add_verb(
        actions, "generate", help="sample text from a checkpoint",
        examples=["gonka-node checkpoint generate --checkpoint model.safetensors --prompt \"def \" --greedy"],
        next="gonka-node checkpoint export --checkpoint FILE --out hf-model to use it with transformers",
    )
    _add_checkpoint_args(generate, PRESETS)
    generate.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    generate.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    generate.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    generate.add_argument("--greedy", action="store_true", help="always take the most likely token")
    generate.add_argument("--tokenizer", type=Path, metavar="FILE",
                          help="the epoch's tokenizer.json, checked against the recipe's sha256 (default: the "
                          "recipe's, from its dataset; bytes when the recipe names none)")
    generate.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    generate.set_defaults(func=chain_errors(_generate))


def _add_checkpoint_args(parser: argparse.ArgumentParser, presets: Any) -> None:
    add_connection_args(parser, need_key=False)
    parser.add_argument("--checkpoint", type=Path, required=True, help="checkpoint file (safetensors)")
    parser.add_argument("--epoch", type=int, help="with --round: verify the file against the chain")
    parser.add_argument("--round", help="round number (0: initial) or 'latest'; needs --epoch")
    parser.add_argument("--preset", choices=sorted(presets),
                        help="model preset, when the checkpoint records no model config")
    parser.add_argument("--recipe", type=Path, help="epoch recipe file, when the checkpoint records no config")


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gonka_node.cli.fmt import amount

    client = open_client(args)
    epochs = [args.epoch] if args.epoch is not None else list(range(1, client.epoch_count() + 1))
    if args.epoch is not None:
        check_epoch(client, args.epoch)
    table = Table(title=f"checkpoints on chain {client.chain_id}")
    table.add_column("epoch", justify="right")
    table.add_column("round", justify="right")
    table.add_column("checkpoint sha256", no_wrap=True, min_width=64)  # copied from here: never cut it
    table.add_column("contributors", justify="right")
    table.add_column("total reward", justify="right", no_wrap=True)
    for epoch in epochs:
        info = client.get_epoch(epoch)
        table.add_row(str(epoch), "0 (initial)", info.spec.init_checkpoint_hash.hex(), "-", "-")
        for round_ in range(1, info.latest_round + 1):
            result = client.round_result(epoch, round_)
            table.add_row(
                str(epoch), str(round_), result.checkpoint_sha256.hex(),
                str(result.n_contributors), amount(result.total_reward, args),
            )
    # Hashes must print whole even into a pipe (where rich assumes 80 columns).
    console = Console(file=sys.stdout, width=max(Console(file=sys.stdout).width, 120))
    console.print(table)
    print("\n".join(_sources(epochs, client)))
    if epochs:
        print(f"next: gonka-node checkpoint pull --epoch {epochs[-1]} --round latest")
    return 0


def _sources(epochs: list[int], client: Any) -> list[str]:
    """Where each epoch's checkpoints can be pulled: the endpoints its aggregators announced on chain (one
    line each, never cut: they are copied from here)."""
    lines = ["where to pull (announced on chain; `checkpoint pull` finds them itself):"]
    for epoch in epochs:
        announced = client.aggregator_endpoints(epoch)
        if not announced:
            lines.append(f"  epoch {epoch}: no aggregator has announced an endpoint yet")
        for a in announced:
            lines.append(f"  epoch {epoch}: {a.endpoint} (aggregator {a.address}, TLS certificate sha256 "
                         f"{a.tls_cert_sha256.hex()})")
    return lines


def _pull(args: argparse.Namespace) -> int:
    from gonka_node.core.discovery import resolve_aggregator

    client = open_client(args)
    want = chain_checkpoint(client, args.epoch, args.round)
    if args.fragment is not None:
        return _pull_one_fragment(args, client, want)
    out = args.out or Path(f"epoch-{want.epoch}-round-{want.round}.safetensors")
    if out.exists() and not args.force:
        raise CliError(f"--out {out}: file exists; pass --force to replace it")
    recipe, where = epoch_recipe(client, args.epoch, args.recipe)
    model = None if recipe is None else recipe.model
    if recipe is not None and recipe.shards > 1 and want.round > 0:
        return _pull_fragments(args, client, recipe.shards, want, out, model, where)
    try:
        found = resolve_aggregator(client, args.epoch, args.aggregator, args.tls_cert)
    except TlsError as exc:
        raise CliError(f"--tls-cert {exc}" if args.tls_cert else str(exc)) from None
    target, pin = found.target, found.tls_cert_pem
    check_aggregator(target, pin, min(args.timeout, 10.0))
    with pinned_channel(
        target, pin, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)]
    ) as channel:
        size, note = pull_checkpoint(channel, want, out, timeout_s=args.timeout, max_bytes=args.max_bytes,
                                     model=model, model_source=where)
    _pulled(want, f"{target} (certificate from {found.source})", out, size, "sha256", note)
    return 0


def _pull_fragments(args: argparse.Namespace, client: Any, shards: int, want: ChainCheckpoint, out: Path, model: Any,
                    where: str) -> int:
    """A sharded epoch's round: every shard announced on chain, merged, checked by its Merkle root."""
    from gonka_node.cli.checkpoint_fragments import pull_fragments

    if args.aggregator or args.tls_cert:
        raise CliError(f"epoch {want.epoch} is sharded over {shards} aggregators: its checkpoints are pulled from "
                       "every shard announced on chain, so leave out --aggregator and --tls-cert")
    size, note = pull_fragments(client, shards, want, out, timeout_s=args.timeout, max_bytes=args.max_bytes,
                                model=model, model_source=where)
    _pulled(want, f"the epoch's {shards} shards (certificates from the chain)", out, size,
            f"Merkle root over {shards} fragments", note)
    return 0


def _pull_one_fragment(args: argparse.Namespace, client: Any, want: ChainCheckpoint) -> int:
    """Fragment K of a sharded epoch's round, from shard K, checked alone by its Merkle proof."""
    from gonka_node.cli.checkpoint_one_fragment import check_fragment_index, pull_one_fragment

    if args.aggregator or args.tls_cert:
        raise CliError("--fragment K is pulled from shard K as announced on chain: leave out --aggregator and --tls-cert")
    recipe, where = epoch_recipe(client, args.epoch, args.recipe)
    if recipe is None:
        raise CliError(f"--fragment: epoch {want.epoch} has no recipe on chain to say how many shards it has; give "
                       "the epoch's recipe (--recipe FILE)")
    check_fragment_index(args.fragment, recipe.shards, want)
    out = args.out or Path(f"epoch-{want.epoch}-round-{want.round}.fragment-{args.fragment}-of-{recipe.shards}.safetensors")
    if out.exists() and not args.force:
        raise CliError(f"--out {out}: file exists; pass --force to replace it")
    size, proof, note = pull_one_fragment(client, recipe.shards, args.fragment, want, out, timeout_s=args.timeout,
                                          max_bytes=args.max_bytes, model=recipe.model, model_source=where)
    print(
        f"pulled fragment {proof.index} of {proof.count} of epoch {want.epoch} round {want.round} from shard "
        f"{proof.index} (certificate from the chain) to {out} ({size:,} bytes)\n"
        f"fragment sha256 {proof.fragment_sha256.hex()} with {len(proof.siblings)} sibling hash(es) leads to the "
        f"Merkle root {want.sha256.hex()} on chain {want.chain_id} registry {want.registry}\n{note}"
    )
    return 0


def _pulled(want: ChainCheckpoint, source: str, out: Path, size: int, what: str, note: str) -> None:
    print(
        f"pulled epoch {want.epoch} round {want.round} from {source} to {out} ({size:,} bytes)\n"
        f"{what} {want.sha256.hex()} matches chain {want.chain_id} registry {want.registry}\n{note}"
    )


def _export(args: argparse.Namespace) -> int:
    from training.hf_export import EXPORT_DTYPES, ExportError, export_hf
    from training.tokenizer import HFTokenizer

    loaded = load_verified(args)
    dtype = EXPORT_DTYPES[args.dtype] if args.dtype else None
    tokenizer = recipe_tokenizer(loaded.recipe, loaded.recipe_source, args.tokenizer, loaded.config)
    tokenizer_json = tokenizer.raw if isinstance(tokenizer, HFTokenizer) else None
    try:
        out = export_hf(
            loaded.tensors, loaded.config, args.out, source_sha256=loaded.sha256, source=loaded.source,
            dtype=dtype, tokenizer_json=tokenizer_json,
        )
    except ExportError as exc:
        raise CliError(f"--checkpoint {args.checkpoint}: {exc}") from None
    print(f"exported {args.checkpoint} (sha256 {loaded.sha256}) as a Hugging Face Llama folder: {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from training.generate import SamplingConfig, generate_ids

    try:
        sampling = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    loaded = load_verified(args)
    tokenizer = recipe_tokenizer(loaded.recipe, loaded.recipe_source, args.tokenizer, loaded.config)
    _check_prompt(args.prompt, tokenizer)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(loaded.tensors, loaded.config, device)
    ids = generate_ids(model, args.prompt, sampling, tokenizer)
    print(args.prompt + terminal_safe(tokenizer.decode(ids)))
    return 0


def _check_prompt(prompt: str, tokenizer: Tokenizer) -> None:
    """What the server answers 400 for: a prompt holding the end-of-text token, or text the tokenizer
    does not take back unchanged."""
    tokens = tokenizer.encode(prompt)
    if tokenizer.eot_id in tokens:
        raise CliError(f"--prompt holds the end-of-text token (id {tokenizer.eot_id}), the document separator "
                       "the model was trained with; remove it")
    if tokenizer.decode(tokens) != prompt:
        raise CliError("--prompt holds text the epoch's tokenizer cannot represent (it does not decode back to "
                       "itself); remove or replace those characters")
