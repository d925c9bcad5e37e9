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
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from gonka_node.cli import CliError
from gonka_node.cli.chain import add_connection_args, chain_errors, open_client
from gonka_node.cli.verbs import add_group, add_verb
from gonka_node.core.tls import TlsError, check_peer, pinned_channel

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer

# A chunk is at most 1 MiB; the default 4 MiB receive limit leaves room for the protobuf framing.
MESSAGE_LIMIT = 4 << 20
DEFAULT_MAX_BYTES = 64 << 30  # refuse a stream that announces more than this (a 1B fp32 model is ~4 GiB)
ROUND_LATEST = "latest"


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
                  "gonka-node checkpoint pull --epoch 1 --round 3 --aggregator HOST:PORT --tls-cert cert.pem"],
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


# ---------------------------------------------------------------------------------------------- chain


@dataclass(frozen=True)
class ChainCheckpoint:
    """The checkpoint sha256 the chain records for (epoch, round), and where that came from."""

    epoch: int
    round: int
    sha256: bytes
    chain_id: int
    registry: str


def _check_epoch(client: Any, epoch: int) -> None:
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
    _check_epoch(client, epoch)
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


# ---------------------------------------------------------------------------------------------- list


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gonka_node.cli.fmt import amount

    client = open_client(args)
    epochs = [args.epoch] if args.epoch is not None else list(range(1, client.epoch_count() + 1))
    if args.epoch is not None:
        _check_epoch(client, args.epoch)
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


# ---------------------------------------------------------------------------------------------- pull


def _pull(args: argparse.Namespace) -> int:
    from gonka_node.core.discovery import resolve_aggregator

    client = open_client(args)
    want = chain_checkpoint(client, args.epoch, args.round)
    try:
        found = resolve_aggregator(client, args.epoch, args.aggregator, args.tls_cert)
    except TlsError as exc:
        raise CliError(f"--tls-cert {exc}" if args.tls_cert else str(exc)) from None
    target, pin = found.target, found.tls_cert_pem
    out = args.out or Path(f"epoch-{want.epoch}-round-{want.round}.safetensors")
    if out.exists() and not args.force:
        raise CliError(f"--out {out}: file exists; pass --force to replace it")
    model, where = epoch_model(client, args.epoch, args.recipe)
    _check_aggregator(target, pin, min(args.timeout, 10.0))
    with pinned_channel(
        target, pin, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)]
    ) as channel:
        size, note = pull_checkpoint(channel, want, out, timeout_s=args.timeout, max_bytes=args.max_bytes,
                                     model=model, model_source=where)
    print(
        f"pulled epoch {want.epoch} round {want.round} from {target} (certificate from {found.source}) to "
        f"{out} ({size:,} bytes)\n"
        f"sha256 {want.sha256.hex()} matches chain {want.chain_id} registry {want.registry}\n{note}"
    )
    return 0


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
        return _recipe_file(recipe_file, epoch, client), f"--recipe {recipe_file}"
    return None, ""


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


def _check_aggregator(target: str, pin: bytes, timeout_s: float) -> None:
    """Fail with what is wrong (unreachable, no TLS, another certificate) before streaming anything."""
    try:
        check_peer(target, pin, timeout_s)
    except TlsError as exc:
        raise CliError(f"--aggregator: {exc}") from None
    except ValueError as exc:
        raise CliError(f"--aggregator {exc}") from None
    except OSError as exc:
        raise CliError(f"--aggregator {target}: cannot connect ({exc.strerror or exc})") from None


def pull_checkpoint(
    channel: grpc.Channel, want: ChainCheckpoint, out: Path, *, timeout_s: float, max_bytes: int,
    model: Any = None, model_source: str = "",
) -> tuple[int, str]:
    """Stream (epoch, round) into `out`, verified against `want.sha256` and its metadata against `model`
    (the epoch's ModelConfig from `model_source`; None: no source, the metadata is stripped); returns the
    file size and a line saying what became of the metadata.

    Nothing is left behind unless verified: the stream goes to a temporary file in `out`'s folder,
    which is renamed onto `out` only after the canonical sha256 matches the chain.
    """
    from training.durable import durable_replace

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w+b") as handle:
            size = _fetch(channel, want, handle, timeout_s, max_bytes)
            handle.flush()
            os.fsync(handle.fileno())
        _verify_file(tmp, want)
        note = _settle_metadata(tmp, want, model, model_source)
        durable_replace(tmp, out)
    except grpc.RpcError as exc:
        tmp.unlink(missing_ok=True)
        raise CliError(
            f"--aggregator: StreamCheckpoint epoch {want.epoch} round {want.round} failed: "
            f"{exc.code().name} {exc.details()}"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, note


def _fetch(channel: grpc.Channel, want: ChainCheckpoint, handle: Any, timeout_s: float, max_bytes: int) -> int:
    """The checkpoint's bytes into `handle`: from the aggregator's object store when it names a URL for
    the round, else (or when that download fails or is not the object announced) its gRPC stream."""
    from proto.gonka.v1 import checkpoints_pb2 as cpb
    from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc

    stored = _from_store(channel, want, handle, timeout_s, max_bytes)
    if stored is not None:
        return stored
    handle.seek(0)
    handle.truncate()  # whatever a failed store download left
    request = cpb.StreamCheckpointRequest(epoch=want.epoch, round=want.round)
    stream = cpb_grpc.CheckpointsStub(channel).StreamCheckpoint(request, timeout=timeout_s)
    return _receive(stream, want, handle, max_bytes)


def _from_store(channel: grpc.Channel, want: ChainCheckpoint, handle: Any, timeout_s: float,
                max_bytes: int) -> int | None:
    """Download the round's checkpoint from the URL the aggregator's LocateRound names; None (saying why
    on stderr) when it names none or the download fails. Verified against the chain afterwards, as any."""
    from gonka_node.core.storage import StoreError, download_url
    from proto.gonka.v1 import aggregator_pb2 as pb
    from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc

    try:
        location = pb_grpc.AggregatorStub(channel).LocateRound(
            pb.RoundRef(epoch=want.epoch, round=want.round), timeout=timeout_s)
    except grpc.RpcError:  # an older aggregator, or a round it does not hold: its stream says why
        return None
    obj = location.checkpoint
    if not obj.url:
        return None
    if obj.length > max_bytes:
        raise CliError(f"the store's checkpoint of epoch {want.epoch} round {want.round} is {obj.length:,} bytes, "
                       f"more than --max-bytes {max_bytes:,}")
    try:
        size = download_url(obj.url, handle, obj.length, obj.file_sha256, timeout_s)
    except StoreError as exc:
        print(f"warning: the object store's copy was refused ({exc}); streaming from the aggregator instead",
              file=sys.stderr)
        return None
    print(f"downloaded {obj.key} from the aggregator's object store", file=sys.stderr)
    return size


def _settle_metadata(path: Path, want: ChainCheckpoint, model: Any, model_source: str) -> str:
    """Keep the file's model config only if it is the epoch's; refuse a contradicting one; strip one that
    nothing vouches for (a server can rewrite metadata freely: the chain's hash covers tensors only)."""
    from safetensors import safe_open

    from training.hf_export import MODEL_CONFIG_KEY, ExportError, config_from_metadata
    from training.model import ModelConfig

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    claimed: ModelConfig | ExportError | None
    try:
        claimed = config_from_metadata(metadata)
    except ExportError as exc:
        claimed = exc
    if claimed is None:
        return "the file records no model config"
    if model is not None and claimed == model:
        return f"its model config is {model_source}'s"
    if model is not None:
        raise CliError(
            f"epoch {want.epoch} round {want.round}: the file's tensors match the chain but its metadata "
            f"{MODEL_CONFIG_KEY!r} ({claimed}) is not {model_source}'s model ({model}): the aggregator "
            "rewrote what the hash does not cover; the file was deleted"
        )
    _rewrite_metadata(path, {k: v for k, v in metadata.items() if k != MODEL_CONFIG_KEY})
    return (f"its metadata {MODEL_CONFIG_KEY!r} was removed: no recipe on chain or --recipe vouches for it "
            "(export/generate then need --recipe or --preset)")


def _rewrite_metadata(path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata=metadata)


def _receive(stream: Iterator[Any], want: ChainCheckpoint, handle: Any, max_bytes: int) -> int:
    """Write the FileChunk stream to `handle`, checking its FileMeta as it goes; returns the length."""
    where = f"aggregator stream for epoch {want.epoch} round {want.round}"
    first = next(stream, None)
    if first is None or first.WhichOneof("part") != "meta":
        raise CliError(f"{where}: did not start with a FileMeta message")
    meta = first.meta
    if (meta.epoch, meta.round) != (want.epoch, want.round):
        raise CliError(f"{where}: FileMeta is for epoch {meta.epoch} round {meta.round}")
    if meta.content_sha256 != want.sha256:
        raise CliError(
            f"{where}: FileMeta.content_sha256 is {meta.content_sha256.hex() or '(empty)'}, the chain records "
            f"{want.sha256.hex()}: this aggregator serves a different checkpoint; nothing was written"
        )
    if meta.length > max_bytes:
        raise CliError(f"{where}: FileMeta.length {meta.length:,} exceeds --max-bytes {max_bytes:,}")
    digest, size = hashlib.sha256(), 0
    for message in stream:
        if message.WhichOneof("part") != "data":
            raise CliError(f"{where}: a second FileMeta in the stream")
        size += len(message.data)
        if size > meta.length:
            raise CliError(f"{where}: more bytes than FileMeta.length {meta.length:,}")
        digest.update(message.data)
        handle.write(message.data)
    if size != meta.length:
        raise CliError(f"{where}: ended after {size:,} of FileMeta.length {meta.length:,} bytes (truncated)")
    if digest.digest() != meta.file_sha256:
        raise CliError(f"{where}: the bytes do not hash to FileMeta.file_sha256 (corrupted in transfer)")
    return size


def _verify_file(path: Path, want: ChainCheckpoint) -> None:
    from training.checkpoint import CheckpointError, load_checkpoint

    try:
        load_checkpoint(path, expected_sha256=want.sha256.hex())
    except CheckpointError as exc:
        raise CliError(
            f"epoch {want.epoch} round {want.round}: the downloaded file fails verification against the "
            f"chain ({exc}); it was deleted"
        ) from None


# ---------------------------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Verified:
    tensors: dict[str, Any]
    config: Any  # training.model.ModelConfig
    sha256: str
    source: dict[str, str]  # provenance for the model card
    recipe: Any = None  # the epoch's Recipe (on chain, else --recipe), when there is one
    recipe_source: str = ""


def _load_verified(args: argparse.Namespace) -> Verified:
    """The checkpoint's tensors, hash-checked (against the chain with --epoch/--round) and its config."""
    from training.checkpoint import CheckpointError, load_checkpoint

    if (args.epoch is None) != (args.round is None):
        raise CliError("--epoch and --round go together (to verify the file against the chain)")
    want = client = None
    if args.epoch is not None:
        client = open_client(args)
        want = chain_checkpoint(client, args.epoch, args.round)
    try:
        checkpoint = load_checkpoint(args.checkpoint, expected_sha256=want.sha256.hex() if want else None)
    except CheckpointError as exc:
        raise CliError(f"--checkpoint: {exc}") from None
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
        return _recipe_file(args.recipe, None, None), f"--recipe {args.recipe}"
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
        found.append((f"--recipe {args.recipe}", _recipe_model(args.recipe, args.epoch, client)))
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


def _recipe_model(path: Path, epoch: int | None, client: Any) -> Any:
    return _recipe_file(path, epoch, client).model


def _recipe_file(path: Path, epoch: int | None, client: Any) -> Any:
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


# ---------------------------------------------------------------------------------------------- export


def _export(args: argparse.Namespace) -> int:
    from training.hf_export import EXPORT_DTYPES, ExportError, export_hf
    from training.tokenizer import HFTokenizer

    loaded = _load_verified(args)
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


# ---------------------------------------------------------------------------------------------- generate


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
    loaded = _load_verified(args)
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
