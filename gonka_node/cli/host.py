"""`gonka-node run` (the host daemon), `rewards` (list and claim), `status` and `stake withdraw`.

`run` checks everything before it stakes (gonka_node/host/preflight.py): a problem is one line naming
the fix, and nothing is sent. `rewards` and `status` read the chain and the aggregator, so a host that
lost its state folder still sees and claims all it earned (gonka_node/host/ledger.py).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.fmt import amount, eth, when
from gonka_node.cli.verbs import add_group, add_verb

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register(subparsers: argparse._SubParsersAction) -> None:
    run = add_verb(
        subparsers, "run", help="run a host: check, sign in, train every round, submit, get paid",
        examples=["gonka-node run --config host.toml --check   # preflight only: nothing is staked",
                  "gonka-node run --config host.toml --gpus 8"],
        next="gonka-node status --config host.toml; after the epoch gonka-node rewards --config host.toml --claim",
    )
    _add_host_args(run)
    run.add_argument("--check", action="store_true", help="run the preflight checks and stop (stakes nothing)")
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
    run.add_argument(
        "--rig-stall-s", type=float, metavar="S",
        help="stop a rig that takes no inner step for S seconds while it is up (a hung process or collective) and "
        "leave with an error; rerunning resumes (default: 30 minutes; torch.compile's first step counts)",
    )
    run.add_argument(
        "--rig-start-s", type=float, metavar="S",
        help="stop a rig that takes longer than S seconds to start or restart (join its processes, build its "
        "model, load its data) and leave with an error (default: 1 hour)",
    )
    run.add_argument(
        "--link", metavar="DOWN/UP[@MS]",
        help="pace this host's downloads and uploads like a link of DOWN/UP Mbit/s (and MS ms of latency per "
        "transfer), e.g. 100/10: a home connection reproduced on loopback (gonka_node/core/link.py)",
    )
    run.set_defaults(func=_run)

    rewards = add_verb(
        subparsers, "rewards", help="this host's reward per round, from the chain and the aggregator",
        amounts=True, examples=["gonka-node rewards --config host.toml", "gonka-node rewards --config host.toml --claim"],
        next="gonka-node stake withdraw --config host.toml once the stake unlocks (gonka-node status says when)",
    )
    _add_host_args(rewards)
    rewards.add_argument("--claim", action="store_true", help="claim every unclaimed reward with its proof")
    rewards.set_defaults(func=_rewards)

    status = add_verb(
        subparsers, "status", help="this host in its epoch: slot, rounds, stake, earned, claimable, next deadline",
        amounts=True, examples=["gonka-node status --config host.toml"],
        next="gonka-node rewards --config host.toml --claim",
    )
    _add_host_args(status)
    status.set_defaults(func=_status)

    stake = add_group(subparsers, "stake", help="a host's stake: take it back after the epoch")
    withdraw = add_verb(
        stake, "withdraw", help="take the stake back once the epoch's challenge window is over", amounts=True,
        examples=["gonka-node stake withdraw --config host.toml"], next="gonka-node keys show --config host.toml",
    )
    _add_host_args(withdraw)
    withdraw.set_defaults(func=_withdraw)


def _add_host_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True,
                        help="host TOML file (gonka-node init host writes a commented one)")
    parser.add_argument("--passphrase-file", type=Path,
                        help="file whose first line unlocks encrypted keys (mode 0600; else GONKA_KEY_PASSPHRASE)")


class HostSession:
    """What the host verbs open from a host config: keys, recipe, chain client, epoch; the aggregator
    is found (from the chain unless configured) and dialled only when asked for."""

    def __init__(self, args: argparse.Namespace) -> None:
        from chain.backends import RpcBackend
        from chain.client import ChainClient
        from chain.types import Deployment
        from gonka_node.cli.keys import read_passphrase_file
        from gonka_node.core.keys import load_keys
        from gonka_node.host.config import load_host_config

        passphrase = read_passphrase_file(args.passphrase_file) if args.passphrase_file else None
        self.cfg = load_host_config(args.config, passphrase=passphrase)
        self.keys = load_keys(self.cfg.key_dir, self.cfg.passphrase)
        deployment = Deployment.load(self.cfg.deployment)
        self.chain = ChainClient(RpcBackend(self.cfg.rpc_url), self.keys.evm_account, deployment).connect()
        self.epoch = self.cfg.epoch or self.chain.epoch_count()
        self._aggregator: Any = None
        self._recipe: Any = None
        self.shaped: Any = None  # `run --link`: the Link its uploads and downloads are paced by

    @property
    def recipe(self) -> Any:
        """The recipe file (loaded on first use: reading it imports the training engine)."""
        from gonka_node.core.recipe import Recipe

        if self._recipe is None:
            self._recipe = Recipe.load(self.cfg.recipe)
        return self._recipe

    def plan(self) -> Any:
        from gonka_node.host.preflight import HostPlan

        return HostPlan(self.chain, self.epoch, self.cfg.stake, self.recipe, self.cfg.recipe,
                        self.keys.node_public_key, self.cfg.cache_dir)

    def address(self) -> Any:
        """Where the aggregator is and its certificate (AggregatorAddress); raises TlsError if unknown."""
        from gonka_node.host.pin import aggregator_pin

        return aggregator_pin(self.cfg, self.chain, self.epoch)

    def aggregator(self) -> Any:
        from gonka_node.core.client import AggregatorClient

        if self._aggregator is None and self.recipe.shards > 1:  # every shard of the epoch, as one
            from gonka_node.host.shards import sharded_aggregator

            self._aggregator = sharded_aggregator(self.chain, self.epoch, self.recipe, self.shaped)
        if self._aggregator is None:
            found = self.address()
            self._aggregator = AggregatorClient(found.target, found.tls_cert_pem, link=self.shaped)
        return self._aggregator

    def close(self) -> None:
        if self._aggregator is not None:
            self._aggregator.close()


def _check_epoch_exists(session: HostSession) -> None:
    from gonka_node.host.preflight import check_epoch

    problem = check_epoch(session.chain, session.epoch)
    if problem is not None:
        raise CliError(problem)


def preflight(session: HostSession) -> list[str]:
    """Every reason this host should not stake now, one line each (see gonka_node/host/preflight.py)."""
    from gonka_node.core.tls import TlsError
    from gonka_node.host import preflight as checks

    _check_epoch_exists(session)
    plan = session.plan()
    me = session.chain.host_info(session.epoch, session.chain.address)
    joined = me.joined and not me.left
    problems = [] if joined else checks.check_signin(plan, when)
    if joined and me.node_key != plan.node_key:
        problems.append(f"{session.chain.address} signed in to epoch {session.epoch} with another node key "
                        f"({me.node_key.hex()[:16]}…): use the key directory it signed in with")
    problems += [p for p in [checks.check_funds(plan, joined)] if p]
    problems += checks.check_recipe(plan)
    try:
        found = session.address()
    except TlsError as exc:
        problems.append(str(exc))
    else:
        problem = checks.check_aggregator(found.target, found.tls_cert_pem, found.source, must_answer=not joined)
        problems += [problem] if problem else []
    return problems


def _shaped_link(text: str | None) -> Any:
    from gonka_node.core.link import LinkError, LinkSpec

    if text is None:
        return None
    try:
        return LinkSpec.parse(text).buckets()
    except LinkError as exc:
        raise CliError(f"--link: {exc}") from exc


def _run(args: argparse.Namespace) -> int:
    if args.gpus < 1:
        raise CliError(f"--gpus {args.gpus}: a rig has at least one process")
    if args.rig_stall_s is not None and not args.rig_stall_s > 0:
        raise CliError(f"--rig-stall-s {args.rig_stall_s}: give the seconds a round may go without a step (> 0)")
    if args.rig_start_s is not None and not args.rig_start_s > 0:
        raise CliError(f"--rig-start-s {args.rig_start_s}: give the seconds the rig may take to start (> 0)")
    shaped = _shaped_link(args.link)  # a malformed --link is refused before anything is read
    session = HostSession(args)
    session.shaped = shaped
    try:
        problems = preflight(session)
        if problems:
            raise CliError("\n".join([*problems, f"preflight: {len(problems)} problem(s); nothing was staked"]))
        if args.check:
            print(f"preflight passed: {session.chain.address} can sign in to epoch {session.epoch} with "
                  f"{amount(session.cfg.stake)} stake; aggregator {session.address().target} answers")
            print(f"next: gonka-node run --config {args.config}")
            return 0
        return _train(args, session)
    finally:
        session.close()


def _train(args: argparse.Namespace, session: HostSession) -> int:
    from gonka_node.host.events import HostEvents, LogEvents, MetricsEvents
    from gonka_node.host.node import HostError, HostNode, HostSettings

    cfg = session.cfg
    logging.basicConfig(level=cfg.log_level, format=LOG_FORMAT)
    sinks: list[HostEvents] = [LogEvents()]
    if cfg.metrics_port:
        metrics = MetricsEvents()
        port = metrics.serve(cfg.metrics_port)
        logging.getLogger("gonka_node.host").info("metrics on http://127.0.0.1:%d/metrics", port)
        sinks.append(metrics)
    settings = HostSettings(
        epoch=session.epoch,
        stake=cfg.stake,
        state_dir=cfg.state_dir,
        cache_dir=cfg.cache_dir,
        stop_after_rounds=args.rounds,
        procs=args.gpus,
        sharding=args.shard,
        checkpoint_activations=args.activation_checkpointing,
        compile=args.compile,
        **({"rig_stall_s": args.rig_stall_s} if args.rig_stall_s is not None else {}),
        **({"rig_start_s": args.rig_start_s} if args.rig_start_s is not None else {}),
    )
    aggregator = session.aggregator()
    node = HostNode(settings, session.recipe, session.chain, aggregator, session.keys, sinks[0])
    try:
        progress = _run_node(node, sinks, bar=not args.quiet)
    except HostError as exc:
        raise CliError(str(exc)) from exc
    print(f"epoch {progress.epoch}: {progress.round_done} rounds, model {progress.model_sha256}")
    print(f"next: gonka-node rewards --config {args.config} --claim")
    return 0


def _run_node(node: Any, sinks: list[Any], bar: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from gonka_node.host.events import HostEvents, MultiEvents

    if not bar:
        node.events = MultiEvents(sinks)
        return node.run()

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

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), transient=True) as progress:
        node.events = MultiEvents([*sinks, Bars(progress)])
        return node.run()


# ---------------------------------------------------------------------------------------------- rewards


def _ledger(session: HostSession, say: Callable[[str], None]) -> list[Any]:
    """The rewards per round; from the local state folder only for what the aggregator cannot tell."""
    import grpc

    from gonka_node.core.tls import TlsError
    from gonka_node.host.ledger import rewards
    from gonka_node.host.store import HostStore

    try:
        return rewards(session.chain, session.aggregator(), session.epoch)
    except (TlsError, grpc.RpcError) as exc:
        why = f"{exc.code().name}" if isinstance(exc, grpc.RpcError) else str(exc)
        say(f"note: the aggregator cannot be asked ({why}); unclaimed rewards come from the local state folder")
    snap = HostStore(session.cfg.state_dir).load()
    local = snap.progress.rewards if snap is not None and snap.progress.epoch == session.epoch else {}
    return rewards(session.chain, None, session.epoch, local)


def _print_rewards(rows: list[Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for column in ("round", "reward", "claimed", "from"):
        table.add_column(column, justify="right" if column != "from" else "left")
    for row in rows:
        claimed = row.claimed or (args.claim and row.claimable)
        table.add_row(str(row.round), amount(row.amount, args), "yes" if claimed else "no", row.source)
    Console(width=120).print(table)


def _rewards(args: argparse.Namespace) -> int:
    from gonka_node.host.ledger import LedgerError, claim

    session = HostSession(args)
    try:
        _check_epoch_exists(session)
        try:
            rows = _ledger(session, print)
            claimed_now = 0
            if args.claim:
                for row in rows:
                    if row.claimable:
                        claim(session.chain, session.epoch, row)
                        claimed_now += row.amount
        except LedgerError as exc:
            raise CliError(str(exc)) from None
    finally:
        session.close()
    print(f"rewards of {session.chain.address} in epoch {session.epoch}")
    _print_rewards(rows, args)
    total = sum(r.amount for r in rows)
    unclaimed = sum(r.amount for r in rows if not r.claimed) - claimed_now
    print(f"earned {amount(total, args)}; unclaimed {amount(unclaimed, args)}")
    if args.claim:
        print(f"claimed {amount(claimed_now, args)}; balance {amount(session.chain.gnk_balance(), args)}")
    elif unclaimed:
        print(f"next: gonka-node rewards --config {args.config} --claim")
    return 0


# ---------------------------------------------------------------------------------------------- status


def _status(args: argparse.Namespace) -> int:
    session = HostSession(args)
    try:
        _check_epoch_exists(session)
        lines = _status_lines(args, session)
    finally:
        session.close()
    for label, value in lines:
        print(f"{label + ':':<15} {value}")
    return 0


def _status_lines(args: argparse.Namespace, session: HostSession) -> list[tuple[str, str]]:
    chain, epoch = session.chain, session.epoch
    info, me, now = chain.get_epoch(epoch), chain.host_info(epoch, chain.address), chain.chain_time()
    lines = [("host", chain.address), ("epoch", f"{epoch} on chain {chain.chain_id}"),
             ("balance", f"{amount(chain.gnk_balance(), args)}, {eth(chain.eth_balance())}")]
    if not me.joined:
        lines.append(("slot", "not signed in"))
    else:
        left = " (left)" if me.left else ""
        lines.append(("slot", f"{me.slot}{left}"))
        lines.append(("stake", _stake_text(args, me)))
    lines.append(("rounds", f"{info.latest_round} of {info.spec.n_rounds} finalized"))
    if me.joined:
        rows = _ledger(session, lambda line: lines.append(("note", line.removeprefix("note: "))))
        earned = sum(r.amount for r in rows)
        claimable = sum(r.amount for r in rows if not r.claimed)
        paid = sum(1 for r in rows if r.amount > 0)
        lines.append(("earned", f"{amount(earned, args)} in {paid} round(s)"))
        lines.append(("claimable", amount(claimable, args)))
    lines.append(("next deadline", _next_deadline(session, info, now)))
    return lines


def _stake_text(args: argparse.Namespace, me: Any) -> str:
    text = amount(me.stake - me.slashed, args)
    if me.slashed:
        text += f" ({amount(me.slashed, args)} slashed)"
    if me.withdrawn:
        text += " (withdrawn)"
    if me.open_challenges:
        text += f" (frozen by {me.open_challenges} open challenge(s))"
    return text


def _next_deadline(session: HostSession, info: Any, now: int) -> str:
    import grpc

    from gonka_node.core.tls import TlsError

    chain, epoch = session.chain, session.epoch
    if now < info.signin_end and info.latest_round == 0:
        return f"sign-in closes {when(info.signin_end, now)}"
    if info.latest_round < info.spec.n_rounds and not info.ended:
        try:
            open_round = session.aggregator().open_round()
            return f"round {open_round.round} closes {when(open_round.deadline_unix_ms // 1000)}"
        except (TlsError, grpc.RpcError):  # the aggregator is down or between rounds: the chain's deadline holds
            return f"the epoch's last round is due {when(chain.epoch_end(epoch), now)}"
    return f"stake unlocks {when(chain.stake_unlock_time(epoch), now)}"


# ---------------------------------------------------------------------------------------------- stake


def _withdraw(args: argparse.Namespace) -> int:
    session = HostSession(args)
    try:
        _check_epoch_exists(session)
        chain, epoch = session.chain, session.epoch
        me, now = chain.host_info(epoch, chain.address), chain.chain_time()
        unlock = chain.stake_unlock_time(epoch)
        if not me.joined:
            raise CliError(f"{chain.address} is not a host of epoch {epoch}: no stake to withdraw")
        if me.withdrawn:
            raise CliError(f"the stake of {chain.address} in epoch {epoch} was already withdrawn")
        if me.open_challenges:
            raise CliError(f"the stake is frozen by {me.open_challenges} open challenge(s) until they are resolved "
                           f"(gonka-node challenge list --epoch {epoch}); it unlocks {when(unlock, now)} at the earliest")
        if not chain.get_epoch(epoch).ended or now < unlock:
            raise CliError(f"the stake is locked until the epoch's challenge window closes: it unlocks "
                           f"{when(unlock, now)}; withdraw after that")
        got = chain.withdraw_stake(epoch)
    finally:
        session.close()
    print(f"withdrew {amount(got, args)} from epoch {epoch}; balance {amount(chain.gnk_balance(), args)}")
    return 0
