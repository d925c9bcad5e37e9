"""`gonka-node explorer`: index a deployment's chain and serve the network explorer's pages and API."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.chain import DEFAULT_DEPLOYMENT
from gonka_node.cli.verbs import add_verb


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_verb(
        subparsers, "explorer", help="follow the chain into a local index and serve the network's pages and JSON API",
        examples=["gonka-node explorer --deployment devnet-out/deployment.json --port 8080"],
        next="open the printed URL; docs/EXPLORER.md describes the pages and the JSON API",
    )
    p.add_argument("--rpc", metavar="URL", help="JSON-RPC URL (default: the one saved in the deployment file)")
    p.add_argument("--deployment", type=Path, default=DEFAULT_DEPLOYMENT,
                   help="deployment file (default deployment.json)")
    p.add_argument("--aggregator", action="append", default=[], metavar="HOST:PORT",
                   help="ask this aggregator for round results (repeatable; default: every aggregator announced "
                   "on chain); its TLS certificate is the one it announced")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0: the OS picks one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--db", type=Path, help="index file (default: explorer.sqlite3 beside the deployment file)")
    p.set_defaults(func=_explorer)


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    for target in args.aggregator:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise CliError(f"--aggregator {target!r}: give HOST:PORT")


def _explorer(args: argparse.Namespace) -> int:
    from chain.errors import ChainError
    from chain.types import Deployment
    from gonka_node.explorer import ExplorerStartError, IndexFileError, start_explorer

    _check(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        url = args.rpc or Deployment.load(args.deployment).extra.get("rpc_url")
        if not url:
            raise CliError(f"no --rpc given and {args.deployment} records none")
        handle = start_explorer(url, args.deployment, args.port, args.db, aggregators=args.aggregator, host=args.host)
    except (ChainError, IndexFileError, ExplorerStartError) as exc:
        raise CliError(str(exc)) from None
    print(f"explorer: {handle.url}", flush=True)
    _wait_for_signal()
    handle.stop()
    return 0


def _wait_for_signal() -> None:
    done = threading.Event()

    def stop(*_: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, stop)
    try:
        while not done.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
