"""`gonka-node init host|aggregator|epoch`: commented templates to start from.

Each template is what its reader accepts (the host config, the aggregator config, an epoch recipe), with
every key explained and the values given as flags filled in; tests/gonka_node/test_cli_init.py loads
each one with the project's own loaders. Existing files are kept unless --force.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.names import add_codec_flag
from gonka_node.cli.verbs import add_group, add_verb
from gonka_node.core.recipe import (
    ASSIGNMENT_SEEDS,
    EPOCH_DEFAULTS,
    Recipe,
    field_help,
    recipe_default,
    recipe_help,
)

HOST = """\
# A host's configuration: gonka-node run --config {name}
# Relative paths are relative to this file's folder (or to $GONKA_HOME). Before staking anything:
#   gonka-node run --config {name} --check

[host]
key_dir = "{key_dir}"             # gonka-node keys init --key-dir {key_dir} (encrypted; unlock with --passphrase-file)
state_dir = "host-state"          # progress, so a restarted host resumes; rewards never depend on it
recipe = "{recipe}"               # the epoch's recipe from governance, checked against the chain
deployment = "{deployment}"       # the contracts' addresses, from whoever deployed them
epoch = {epoch}                   # 0: the latest epoch on chain
stake_gnk = {stake}               # GNK escrowed at sign-in; at least the epoch's min_stake
# aggregator = "host:port"        # default: the endpoint the epoch's aggregator announced on chain
metrics_port = 0                  # Prometheus on 127.0.0.1:PORT (gonka_host_*); 0: off
cache_dir = "cache"               # token cache for the corpus
log_level = "INFO"                # DEBUG, INFO, WARNING or ERROR

# [aggregator]
# tls_cert = "aggregator-cert.pem"  # pin this certificate instead of the one announced on chain

[chain]
rpc_url = "{rpc_url}"             # the chain's JSON-RPC node; GONKA_RPC_URL overrides it
"""

AGGREGATOR = """\
# An aggregator's configuration: gonka-node aggregator --config {name}
# Relative paths are relative to this file's folder (or to $GONKA_HOME). Its account must be one of the
# epoch's aggregators (gonka-node gov build-spec --aggregator ADDRESS); it pays gas for every round.

[aggregator]
listen = "{listen}"               # where gRPC (TLS) is served
# public_endpoint = "agg.example.org:50051"  # what hosts dial, announced on chain (needed when listen is 0.0.0.0)
data_dir = "aggregator-data"      # submissions, checkpoints, TLS identity (tls/cert.pem is what clients pin)
node_key = "{key_dir}/node_key.json"  # gonka-node keys init --key-dir {key_dir}: signs receipts
evm_key = "{key_dir}/evm_key.json"    # the account that finalizes rounds on chain
recipe = "{recipe}"               # the epoch's recipe (published on chain at start)
deployment = "{deployment}"       # the contracts' addresses
epoch = {epoch}                   # 0: the latest epoch on chain
metrics_port = 0                  # Prometheus on 127.0.0.1:PORT (gonka_aggregator_*); 0: off
log_level = "INFO"                # DEBUG, INFO, WARNING or ERROR

[chain]
backend = "rpc"                   # an aggregator reaches the chain over JSON-RPC
rpc_url = "{rpc_url}"             # GONKA_RPC_URL overrides it

[round]
quorum = 1                        # accepted submissions needed to close at the deadline (its length: the epoch's round_length on chain)

[aggregation]
rule = "clip_median"              # mean | clip_median | centered_clip
heldout_windows = 8               # windows scoring each update

# [store]                         # where finalized checkpoints and updates are published (PROTOCOL.md "Object storage")
# uri = "s3://bucket/gonka?endpoint=https://ACCOUNT.r2.cloudflarestorage.com"  # default: data_dir itself
# public_url = "https://models.example.org/gonka"  # serve the keys publicly; default: presigned GETs
# url_expiry_s = 3600             # how long a presigned GET stays valid
# direct_upload = false           # hosts PUT payloads into the S3 store (not with public_url)
"""

EPOCH_HEADER = """\
# An epoch's recipe: the model, the data and the training schedule hosts and aggregators must agree on.
# Its sha256 is the epoch's model_spec_hash on chain. Next:
#   gonka-node gov build-spec --recipe {name} --aggregator 0xAGGREGATOR --reward-per-round 100 --out epoch.toml
# which fills in the data manifest and writes the canonical recipe.json that hosts and aggregators load.

"""
# The template's values where they differ from the recipe's defaults (its flags set more); the comment
# on each line is the recipe field's help.
EPOCH_TEMPLATE: dict[str, Any] = {"n_rounds": 8, "warmup_steps": 10, "round_state": "fresh", **EPOCH_DEFAULTS}


def register(subparsers: argparse._SubParsersAction) -> None:
    from gonka_node.cli.names import PRESET_NAMES

    actions = add_group(subparsers, "init", help="write a commented host, aggregator or epoch template")
    host = add_verb(actions, "host", help="write a commented host config (host.toml)",
                    examples=["gonka-node init host --out host.toml --rpc-url http://chain.example.org:8545"],
                    next="gonka-node keys init --key-dir keys, then gonka-node run --config host.toml --check")
    _common(host, "host.toml")
    host.add_argument("--stake", default="10", metavar="GNK", help="stake_gnk (default 10)")
    host.set_defaults(func=_host)

    agg = add_verb(actions, "aggregator", help="write a commented aggregator config (aggregator.toml)",
                   examples=["gonka-node init aggregator --out aggregator.toml --listen 0.0.0.0:50051"],
                   next="gonka-node keys init --key-dir agg-keys, then gonka-node aggregator --config aggregator.toml")
    _common(agg, "aggregator.toml")
    agg.add_argument("--listen", default="127.0.0.1:50051", help="gRPC listen address (default 127.0.0.1:50051)")
    agg.set_defaults(func=_aggregator)

    epoch = add_verb(actions, "epoch", help="write a commented epoch recipe (recipe.toml) for governance",
                     examples=["gonka-node init epoch --out recipe.toml --preset tiny --rounds 4"],
                     next="gonka-node gov build-spec --recipe recipe.toml --aggregator 0xAGG --out epoch.toml")
    epoch.add_argument("--out", type=Path, default=Path("recipe.toml"), help="file to write (default recipe.toml)")
    epoch.add_argument("--force", action="store_true", help="replace an existing file")
    epoch.add_argument("--preset", choices=PRESET_NAMES, default="devnet", help="model preset (default devnet)")
    epoch.add_argument("--rounds", type=int, default=EPOCH_TEMPLATE["n_rounds"],
                       help=recipe_help("n_rounds", EPOCH_TEMPLATE["n_rounds"]))
    epoch.add_argument("--inner-steps", type=int, default=recipe_default("inner_steps"), help=recipe_help("inner_steps"))
    add_codec_flag(epoch, recipe_default("codec"))
    epoch.add_argument("--assignment-seed", choices=ASSIGNMENT_SEEDS, default=EPOCH_TEMPLATE["assignment_seed"],
                       help=recipe_help("assignment_seed", EPOCH_TEMPLATE["assignment_seed"]))
    epoch.set_defaults(func=_epoch)


def _common(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--out", type=Path, default=Path(default), help=f"file to write (default {default})")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    parser.add_argument("--rpc-url", default="http://127.0.0.1:8545", help="the chain's JSON-RPC URL")
    parser.add_argument("--deployment", default="deployment.json", help="deployment file (default deployment.json)")
    parser.add_argument("--recipe", default="recipe.json", help="the epoch's recipe file (default recipe.json)")
    parser.add_argument("--key-dir", default="keys", help="key directory (default keys)")
    parser.add_argument("--epoch", type=int, default=0, help="epoch number (default 0: the latest on chain)")


def _write(path: Path, text: str, force: bool) -> None:
    if path.exists() and not force:
        raise CliError(f"{path} exists; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")


def _fields(args: argparse.Namespace) -> dict[str, object]:
    if args.epoch < 0:
        raise CliError(f"--epoch {args.epoch}: must be >= 0")
    return dict(name=args.out.name, rpc_url=args.rpc_url, deployment=args.deployment, recipe=args.recipe,
                key_dir=args.key_dir, epoch=args.epoch)


def _host(args: argparse.Namespace) -> int:
    from chain.units import gnk_decimal, parse_gnk

    try:
        stake = gnk_decimal(parse_gnk(args.stake))
    except ValueError as exc:
        raise CliError(f"--stake: {exc}") from None
    _write(args.out, HOST.format(stake=stake, **_fields(args)), args.force)
    print(f"next: gonka-node keys init --key-dir {args.key_dir}, then gonka-node run --config {args.out} --check")
    return 0


def _aggregator(args: argparse.Namespace) -> int:
    _write(args.out, AGGREGATOR.format(listen=args.listen, **_fields(args)), args.force)
    print(f"next: gonka-node keys init --key-dir {args.key_dir}; its EVM address goes in the epoch spec "
          f"(gonka-node gov build-spec --aggregator …); then gonka-node aggregator --config {args.out}")
    return 0


def _epoch(args: argparse.Namespace) -> int:
    from gonka_node.cli.names import CODEC_NAMES
    from training.model import PRESETS

    if args.rounds < 1 or args.inner_steps < 1:
        raise CliError("--rounds and --inner-steps must be >= 1")
    values = {
        **EPOCH_TEMPLATE, "model": args.preset, "n_rounds": args.rounds, "inner_steps": args.inner_steps,
        "codec": args.codec, "seq_len": min(recipe_default("seq_len"), PRESETS[args.preset].max_seq_len),
        "warmup_steps": min(EPOCH_TEMPLATE["warmup_steps"], args.inner_steps),
        "assignment_seed": args.assignment_seed,
    }
    helps = {"model": f"a preset ({', '.join(sorted(PRESETS))}) or a table of ModelConfig fields",
             "codec": f"{field_help('codec')}; NAME one of {', '.join(CODEC_NAMES)}"}
    text = EPOCH_HEADER.format(name=args.out.name) + "".join(
        f"{f'{f.name} = {json.dumps(values.get(f.name, f.default))}':<32}  # {helps.get(f.name, field_help(f.name))}\n"
        for f in dataclasses.fields(Recipe) if f.name != "data_manifest_sha256"  # gov build-spec fills it in
    )
    _write(args.out, text, args.force)
    print(f"next: gonka-node gov build-spec --recipe {args.out} --aggregator 0xAGGREGATOR --reward-per-round 100 "
          "--out epoch.toml")
    return 0
