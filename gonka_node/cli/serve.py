"""`gonka-node serve`: the OpenAI completions API over a chain-verified checkpoint (gonka_node/serve/).

Pulls epoch E's round (or the latest, then follows the chain), verifies it as `checkpoint pull` does,
and serves it until SIGTERM or Ctrl-C. `--rpc` and `--rpc-url` are the same option.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from gonka_node.cli import CliError
from gonka_node.cli.chain import DEFAULT_DEPLOYMENT, chain_errors
from gonka_node.cli.verbs import add_verb

if TYPE_CHECKING:
    from gonka_node.serve.server import ServeSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_verb(
        subparsers, "serve", help="serve a chain-verified checkpoint over the OpenAI completions API",
        examples=["gonka-node serve --deployment deployment.json --epoch 1 --port 8000"],
        next="curl http://127.0.0.1:8000/v1/models, then POST /v1/completions (any OpenAI client)",
    )
    p.add_argument("--rpc", "--rpc-url", dest="rpc_url", metavar="URL",
                   help="JSON-RPC URL of the chain (default: the one saved in the deployment file)")
    p.add_argument("--deployment", type=Path, default=DEFAULT_DEPLOYMENT,
                   help="deployment file (default deployment.json)")
    p.add_argument("--epoch", type=int, required=True, help="epoch whose checkpoints to serve")
    p.add_argument("--round", default="latest",
                   help="round number (0: the initial checkpoint) or 'latest' (default: follow the chain)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: the OS picks one)")
    p.add_argument("--recipe", type=Path, help="the epoch's recipe file, when the chain publishes none")
    p.add_argument("--tokenizer", type=Path, metavar="FILE",
                   help="the epoch's tokenizer.json, checked against the recipe's sha256 (default: the recipe's, "
                   "from its dataset; bytes when the recipe names none)")
    p.add_argument("--aggregator", metavar="HOST:PORT", help="pull from this aggregator (default: from the chain)")
    p.add_argument("--tls-cert", type=Path, metavar="FILE", help="trust this aggregator certificate file")
    p.add_argument("--cache-dir", type=Path, help="keep verified checkpoints here (default: a temporary folder)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 is fastest for tiny models)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--max-waiting", type=int, default=64, help="sequences queued beyond that; more get 429")
    p.add_argument("--max-prompt-bytes", type=int, default=8192,
                   help="longest prompt in tokens (bytes for the byte tokenizer; default 8192)")
    p.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a completion may take (default 120)")
    p.add_argument("--keep-rounds", type=int, default=2, help="rounds served at once when following (default 2)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between chain polls when following")
    p.set_defaults(func=chain_errors(_serve))


def _settings(args: argparse.Namespace) -> ServeSettings:
    from gonka_node.serve.protocol import Limits
    from gonka_node.serve.server import ServeSettings

    try:
        limits = Limits(max_prompt_bytes=args.max_prompt_bytes, max_tokens=args.max_tokens)
        return ServeSettings(
            max_batch=args.max_batch, max_waiting=args.max_waiting, limits=limits,
            request_timeout_s=args.timeout, keep_rounds=args.keep_rounds, poll_s=args.poll, device=args.device,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _serve_log() -> logging.Handler:
    """The server's own lines (a newly served round, a pull that failed and will be retried) on stderr,
    while this verb runs."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("gonka_node.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _serve(args: argparse.Namespace) -> int:
    if args.round != "latest" and not args.round.isdigit():
        raise CliError(f"--round {args.round!r}: give a round number or 'latest'")
    settings = _settings(args)
    if args.threads is not None:
        if args.threads < 1:
            raise CliError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    handler = _serve_log()
    try:
        return _run(args, settings)
    finally:
        logging.getLogger("gonka_node.serve").removeHandler(handler)


def _run(args: argparse.Namespace, settings: ServeSettings) -> int:
    stop = threading.Event()
    # Before the URL is printed: whoever reads it may send SIGTERM at once.
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        return _serve_until(args, settings, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_until(args: argparse.Namespace, settings: ServeSettings, stop: threading.Event) -> int:
    from gonka_node.serve.server import ListenError, start_model_server

    try:
        handle = start_model_server(
            args.rpc_url, args.deployment, args.epoch, args.port, round_=args.round, host=args.host,
            recipe=args.recipe, aggregator=args.aggregator, tls_cert=args.tls_cert, cache_dir=args.cache_dir,
            settings=settings, tokenizer=args.tokenizer,
        )
    except ListenError as exc:
        raise CliError(f"--host/--port: {exc}") from None
    for served in handle.served():
        print(f"serving {served.id}: checkpoint sha256 {served.provenance.sha256} verified against chain "
              f"{served.provenance.chain_id} registry {served.provenance.registry}")
    following = " (following the chain's newest round)" if args.round == "latest" else ""
    print(f"model: {handle.url}{following}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
    return 0
