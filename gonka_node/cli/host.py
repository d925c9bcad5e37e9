"""`gonka-node run --config host.toml` (the host daemon) and `gonka-node rewards` (list and claim)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    run = subparsers.add_parser("run", help="run a host: sign in, train every round, submit, get paid")
    run.add_argument("--config", type=Path, required=True, help="host TOML file (gonka_node/host/config.py)")
    run.add_argument("--rounds", type=int, help="leave after this many rounds (default: the whole epoch)")
    run.add_argument("--quiet", action="store_true", help="log lines only, no progress bar")
    run.add_argument(
        "--gpus", "--procs", dest="gpus", type=int, default=1, metavar="N",
        help="processes of this host's rig (one per GPU; gloo processes on CPU): each round's inner steps "
        "run across them with the recipe's global batch (default 1)",
    )
    run.add_argument(
        "--shard", choices=("auto", "replicated", "sharded"), default="auto",
        help="the rig's model, gradients and AdamW state: whole in every process, or split over them "
        "(FSDP2); auto shards when one GPU cannot hold them (scripts/plan_rig.py shows the numbers)",
    )
    run.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute each layer in backward instead of keeping its activations")
    run.add_argument("--compile", action="store_true", help="torch.compile the model in the rig's processes")
    run.set_defaults(func=_run)
    rewards = subparsers.add_parser("rewards", help="list this host's rewards per round; --claim claims them")
    rewards.add_argument("--config", type=Path, required=True, help="host TOML file")
    rewards.add_argument("--claim", action="store_true", help="claim every unclaimed reward with its proof")
    rewards.set_defaults(func=_rewards)


class _Parts:
    """What both verbs open from a host config: keys, chain client, aggregator client, recipe."""

    def __init__(self, config_path: Path) -> None:
        from chain.backends import RpcBackend
        from chain.client import ChainClient
        from chain.errors import ChainError
        from chain.types import Deployment
        from gonka_node.aggregator.client import AggregatorClient
        from gonka_node.config import ConfigError
        from gonka_node.host.config import load_host_config
        from gonka_node.host.pin import aggregator_pin
        from gonka_node.keys import KeyStoreError, load_keys
        from gonka_node.recipe import Recipe, RecipeError
        from gonka_node.tls import TlsError

        try:
            self.cfg = load_host_config(config_path)
            self.keys = load_keys(self.cfg.key_dir, self.cfg.passphrase)
            self.recipe = Recipe.load(self.cfg.recipe)
            deployment = Deployment.load(self.cfg.deployment)
            self.chain = ChainClient(RpcBackend(self.cfg.rpc_url), self.keys.evm_account, deployment).connect()
            self.epoch = self.cfg.epoch or self.chain.epoch_count()
            pin = aggregator_pin(self.cfg, self.chain, self.epoch)
        except (ConfigError, KeyStoreError, RecipeError, ChainError, TlsError, ValueError, OSError) as exc:
            raise CliError(str(exc)) from exc
        self.aggregator = AggregatorClient(self.cfg.aggregator, pin)
        try:
            self.aggregator.check_peer()  # a wrong pin stops here, before any stake is escrowed
        except TlsError as exc:
            self.aggregator.close()
            raise CliError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    from gonka_node.host.events import HostEvents, MetricsEvents, MultiEvents
    from gonka_node.host.node import HostError, HostNode, HostSettings
    from gonka_node.recipe import RecipeError
    from gonka_node.tls import TlsError

    if args.gpus < 1:
        raise CliError(f"--gpus {args.gpus}: a rig has at least one process")
    parts = _Parts(args.config)
    cfg = parts.cfg
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sinks: list[HostEvents] = [HostEvents()]
    if cfg.metrics_port:
        metrics = MetricsEvents()
        port = metrics.serve(cfg.metrics_port)
        logging.getLogger("gonka_node.host").info("metrics on http://127.0.0.1:%d/metrics", port)
        sinks.append(metrics)
    settings = HostSettings(
        epoch=parts.epoch,
        stake=cfg.stake,
        state_dir=cfg.state_dir,
        cache_dir=cfg.cache_dir,
        stop_after_rounds=args.rounds,
        procs=args.gpus,
        sharding=args.shard,
        checkpoint_activations=args.activation_checkpointing,
        compile=args.compile,
    )
    node = HostNode(settings, parts.recipe, parts.chain, parts.aggregator, parts.keys, MultiEvents(sinks))
    try:
        progress = node.run() if args.quiet else _run_with_bar(node, sinks)
    except (HostError, RecipeError, TlsError) as exc:  # TlsError: the aggregator is not the pinned one
        raise CliError(str(exc)) from exc
    finally:
        parts.aggregator.close()
    print(f"epoch {progress.epoch}: {progress.round_done} rounds, model {progress.model_sha256}")
    return 0


def _run_with_bar(node: Any, sinks: list[Any]) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from gonka_node.host.events import HostEvents, MultiEvents

    class Bars(HostEvents):
        def __init__(self, progress: Progress) -> None:
            self.progress = progress
            self.task = progress.add_task("waiting for a round", total=None)

        def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
            self.progress.update(
                self.task, completed=step, total=total, description=f"round {round_} inner steps, loss {loss:.3f}"
            )

        def submitted(self, round_: int, accepted: bool, reason: str, seconds: float) -> None:
            state = "accepted" if accepted else f"refused ({reason})"
            self.progress.update(self.task, description=f"round {round_} upload {state}; waiting for the result")

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), transient=True) as bar:
        node.events = MultiEvents([*sinks, Bars(bar)])
        return node.run()


def _rewards(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from chain.errors import ChainError
    from gonka_node.host.store import HostStore
    from gonka_node.tls import TlsError

    parts = _Parts(args.config)
    snap = HostStore(parts.cfg.state_dir).load()
    earned = snap.progress.rewards if snap is not None else {}
    table = Table(title=f"rewards of {parts.keys.evm_address} in epoch {parts.epoch} (ngonka)")
    for column in ("round", "reward", "claimed"):
        table.add_column(column, justify="right")
    total_claimed = 0
    try:
        for round_str, amount in sorted(earned.items(), key=lambda kv: int(kv[0])):
            r = int(round_str)
            claimed = parts.chain.claimed(parts.epoch, r)
            if args.claim and amount > 0 and not claimed:
                proof = parts.aggregator.reward_proof(parts.epoch, r, bytes.fromhex(parts.keys.evm_address[2:]))
                parts.chain.claim(parts.epoch, r, int(proof.amount), list(proof.proof))
                claimed = True
                total_claimed += int(proof.amount)
            table.add_row(str(r), f"{amount:,}", "yes" if claimed else "no")
    except (ChainError, TlsError) as exc:
        raise CliError(f"claiming: {exc}") from exc
    finally:
        parts.aggregator.close()
    Console().print(table)
    if args.claim:
        print(f"claimed {total_claimed:,} ngonka; balance {parts.chain.gnk_balance():,} ngonka")
    return 0
