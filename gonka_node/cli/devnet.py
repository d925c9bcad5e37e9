"""`gonka-node devnet`: chain, governance, an aggregator and N hosts on this machine; ends with a report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.verbs import add_verb


def register(subparsers: argparse._SubParsersAction) -> None:
    from gonka_node.cli.names import CODEC_NAMES, PRESET_NAMES, codec_name
    from gonka_node.core.recipe import recipe_default, recipe_help

    p = add_verb(
        subparsers, "devnet", help="run the whole network locally (chain, governance, aggregator, hosts) and report",
        amounts=True,
        examples=["gonka-node devnet", "gonka-node devnet --hosts 2 --rounds 3 --preset tiny --serve"],
        next="with --serve: gonka-node checkpoint list --deployment devnet-out/deployment.json (README \"After the "
        "devnet\")",
    )
    p.add_argument("--out", type=Path, default=Path("devnet-out"), help="report folder (default devnet-out)")
    p.add_argument("--hosts", type=int, default=3, help="host processes (default 3, at most 8)")
    # Recipe settings: left unset here, DevnetOptions' defaults (gonka_node/devnet.py) decide, so that
    # this parser need not import the devnet (chain, torch) to show them.
    devnet = "the devnet's: gonka_node/devnet.py DevnetOptions"
    p.add_argument("--rounds", type=int, help=recipe_help("n_rounds", devnet))
    p.add_argument("--inner-steps", type=int, help=recipe_help("inner_steps", devnet))
    p.add_argument("--preset", default="devnet", choices=PRESET_NAMES,
                   help="model preset (default devnet, ~1M parameters)")
    p.add_argument("--codec", type=codec_name, metavar="CODEC",
                   help=f"{recipe_help('codec', devnet)}; NAME one of {', '.join(CODEC_NAMES)}")
    p.add_argument("--serve", action="store_true",
                   help="after the epoch keep the chain and the aggregator running (and print their addresses) "
                   "until Ctrl-C, so the README's after-devnet commands work")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the rounds")
    p.add_argument(
        "--replay-fraction", type=float, default=1.0,
        help="the epoch's replay probability p: each host's round is recomputed by the aggregator with it "
        "(default 1: all); hosts stake reward/p; > 0 makes the recipe's rounds start fresh so "
        "they can be replayed; 0: AdamW state carried, no replay check and, by the stake rule, no rewards "
        "(docs/SECURITY.md)",
    )
    p.add_argument(
        "--shards", type=int, default=1,
        help="aggregator processes, each owning a fragment of the model (default 1); > 1: the epoch names that "
        "many aggregators (quorum all), hosts upload each fragment to its shard, checkpoint hashes are Merkle "
        "roots over fragments, and shard 0 scores and replays the sampled hosts from their fragments",
    )
    p.add_argument(
        "--link", metavar="DOWN/UP[@MS]",
        help="every host's link in Mbit/s down/up (and ms of latency per transfer), e.g. 100/10: uploads and "
        "downloads are paced like it on loopback (default: loopback as it is)",
    )
    p.add_argument(
        "--kernel-link", action="store_true",
        help="shape --link in the kernel instead of in each host: every host runs in a network namespace of its "
        "own, joined by a veth pair whose two ends the tc token-bucket filter paces at the upload and download "
        "rates; the chain and the aggregators listen on the pairs' bridge (needs root with CAP_NET_ADMIN and "
        "CAP_SYS_ADMIN, and iproute2; rates only, no @MS)",
    )
    p.add_argument(
        "--overlap", choices=("off", "delayed", "eager"), default="off",
        help="the recipe's overlap rule: hosts train round r while round r-1 uploads, from round r-2's model "
        "(delayed) or from their forecast of round r-1's: its outer step with their own round r-1 payload "
        "(eager; unsharded only) (default off)",
    )
    p.add_argument(
        "--broadcast", choices=("dense", "codec"), default="dense",
        help="what hosts download each round: the aggregated update as fp32 (dense) or encoded with the epoch's "
        "codec plus the aggregator's error feedback (codec; the model is defined by the decoded update)",
    )
    # the recipe's own fields: their help is the recipe's (one text for the recipe, `train` and the devnet)
    for flag, name, metavar, note in (
        ("--forecast-step", "forecast_step", "STEP", ""),
        ("--merge-step", "merge_step", "STEP", ""),
        ("--stream-fragments", "stream_fragments", "P", "; here: with --replay-fraction 0"),
        ("--stream-mix", "stream_mix", "A", ""),
    ):
        default = recipe_default(name)
        p.add_argument(flag, dest=name, type=type(default), default=default, metavar=metavar,
                       help=f"the recipe's {name}: {recipe_help(name)}{note}")
    p.add_argument(
        "--rpc-url", help="use this development node (anvil, `gonka-node chain serve`) instead of an embedded chain"
    )
    p.add_argument("--dataset", metavar="DIR|s3://BUCKET/PREFIX",
                   help="train on a prepared dataset (gonka-node data prepare) with its tokenizer; the model's "
                   "vocabulary follows it (default: this Python's stdlib sources, byte tokenizer)")
    p.add_argument("--tokenizer", type=Path, metavar="FILE",
                   help="the dataset's tokenizer.json, checked against the dataset's manifest")
    p.set_defaults(func=_devnet)


def _devnet(args: argparse.Namespace) -> int:
    from rich.console import Console

    from chain.errors import ChainError
    from gonka_node.devnet import DevnetError, DevnetOptions, run_devnet

    console = Console()
    if not 0.0 <= args.replay_fraction <= 1.0:
        raise CliError(f"--replay-fraction must be in [0, 1], got {args.replay_fraction}")
    recipe = {"rounds": args.rounds, "inner_steps": args.inner_steps, "codec": args.codec}
    opts = DevnetOptions(
        out=args.out, hosts=args.hosts, preset=args.preset, timeout_s=args.timeout, chain_url=args.rpc_url,
        replay_fraction=args.replay_fraction, serve=args.serve, dataset=args.dataset, tokenizer=args.tokenizer,
        link=args.link, kernel_link=args.kernel_link, overlap=args.overlap,
        forecast_step=args.forecast_step, merge_step=args.merge_step,
        broadcast=args.broadcast, shards=args.shards, stream_fragments=args.stream_fragments,
        stream_mix=args.stream_mix,
        **{k: v for k, v in recipe.items() if v is not None},
    )
    if args.link is not None:
        from gonka_node.core.link import LinkError, LinkSpec

        try:
            LinkSpec.parse(args.link)
        except LinkError as exc:
            raise CliError(f"--link: {exc}") from exc
    try:
        run_devnet(opts, say=lambda line: console.print(line), on_report=lambda r: _print_report(args, r))
    except (DevnetError, ChainError) as exc:
        raise CliError(str(exc)) from exc
    return 0


def _print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from gonka_node.cli.fmt import amount

    console = Console()
    table = Table(title=f"epoch {report['epoch']}: rewards read back from the chain")
    for column in ("host", "earned", "claimed", "bytes sent", "bytes received", "all-reduce bytes", "utilisation"):
        table.add_column(column, justify="right")
    for host, r in report["rewards"].items():
        table.add_row(
            host, amount(r["earned_ngonka"], args), amount(r["claimed_ngonka"], args),
            f"{report['bytes_per_host'][host]:,}", f"{report['download_bytes_per_host'][host]:,}",
            f"{report['allreduce_bytes_per_host']:,}", f"{report['utilisation'][host]['all']:.3f}",
        )
    console.print(table)
    losses = " → ".join(f"{x:.3f}" for x in report["losses"])
    console.print(f"held-out loss by round: {losses}")
    what = f"Merkle root over {report['shards']} fragments" if report["shards"] > 1 else "sha256"
    for r, h in enumerate(report["checkpoint_hashes"]):
        console.print(f"round {r} checkpoint {what if r else 'sha256'} (on chain, verified): {h}")

    console.print(f"report: {args.out / 'report.json'} and {args.out / 'loss.png'} ({report['seconds']} s)")
    if not args.serve:
        console.print("next: gonka-node devnet --serve keeps the chain and the aggregator running for "
                      "`gonka-node checkpoint list/pull` (README \"After the devnet\")")
