"""`gonka-node gov …`: governance actions. Each one is sent directly when the signer holds the
governance role (an EOA on a devnet), or with `--propose "why"` becomes a Governor proposal that GNK
holders vote on (`gov deposit`, `gov vote`) and anyone executes after the vote (`gov execute`).
"""

from __future__ import annotations

import argparse
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.chain import add_connection_args, chain_errors, open_client, parse_amount


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gov", help="schedule epochs, fund, slash, propose, vote, execute")
    actions = parser.add_subparsers(dest="gov_action", metavar="ACTION", required=True)

    create = _action(actions, "create-epoch", "schedule a training epoch from a TOML spec", _create_epoch)
    create.add_argument("--spec", type=str, required=True, help="epoch spec TOML file")

    fund = _action(actions, "fund", "move GNK into an epoch's reward pool", _fund)
    fund.add_argument("--epoch", type=int, required=True)
    fund.add_argument("--amount", required=True, metavar="GNK")

    slash = _action(actions, "slash", "slash a host's stake (goes back to the reward pool)", _slash)
    slash.add_argument("--epoch", type=int, required=True)
    slash.add_argument("--host", required=True, help="host EVM address")
    slash.add_argument("--amount", required=True, metavar="GNK")
    slash.add_argument("--evidence", required=True, help="sha256 (hex) of the evidence")

    deposit = actions.add_parser("deposit", help="escrow GNK in the Governor to vote with")
    add_connection_args(deposit)
    deposit.add_argument("--amount", required=True, metavar="GNK")
    deposit.set_defaults(func=chain_errors(_deposit))

    vote = actions.add_parser("vote", help="vote on a proposal with the escrowed GNK")
    add_connection_args(vote)
    vote.add_argument("--proposal", type=int, required=True)
    vote.add_argument("--support", choices=("yes", "no"), required=True)
    vote.set_defaults(func=chain_errors(_vote))

    execute = actions.add_parser("execute", help="execute a passed proposal")
    add_connection_args(execute)
    execute.add_argument("--proposal", type=int, required=True)
    execute.set_defaults(func=chain_errors(_execute))


def _action(actions: Any, name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
    parser = actions.add_parser(name, help=help_text)
    add_connection_args(parser)
    parser.add_argument("--propose", metavar="DESCRIPTION", help="make it a Governor proposal instead")
    parser.set_defaults(func=chain_errors(func))
    return parser


def _propose_or_send(args: argparse.Namespace, client: Any, actions: list[Any], send: Any) -> None:
    if args.propose:
        pid = client.propose(actions, args.propose)
        print(f"proposal {pid} created; vote with `gonka-node gov vote --proposal {pid} --support yes`")
    else:
        send()


def _create_epoch(args: argparse.Namespace) -> int:
    from chain.spec_file import load_epoch_spec

    spec = load_epoch_spec(args.spec)
    client = open_client(args)
    if args.propose:
        _propose_or_send(args, client, [client.action_create_epoch(spec)], None)
    else:
        print(f"epoch {client.create_epoch(spec)} created")
    return 0


def _fund(args: argparse.Namespace) -> int:
    amount = parse_amount("--amount", args.amount)
    client = open_client(args)
    _propose_or_send(args, client, client.action_fund_epoch(args.epoch, amount),
                     lambda: client.fund_epoch(args.epoch, amount))
    if not args.propose:
        print(f"epoch {args.epoch} pool: {client.get_epoch(args.epoch).pool} ngonka")
    return 0


def _slash(args: argparse.Namespace) -> int:
    amount = parse_amount("--amount", args.amount)
    try:
        evidence = bytes.fromhex(args.evidence.removeprefix("0x"))
    except ValueError:
        raise CliError(f"--evidence: not hex: {args.evidence!r}") from None
    if len(evidence) != 32:
        raise CliError("--evidence: must be a 32-byte sha256 (64 hex digits)")
    client = open_client(args)
    _propose_or_send(args, client, [client.action_slash(args.epoch, args.host, amount, evidence)],
                     lambda: client.slash(args.epoch, args.host, amount, evidence))
    if not args.propose:
        print(f"slashed {amount} ngonka from {args.host} in epoch {args.epoch}")
    return 0


def _deposit(args: argparse.Namespace) -> int:
    client = open_client(args)
    client.gov_deposit(parse_amount("--amount", args.amount))
    print(f"escrowed; voting weight now {client.read(client.governor, 'escrow', client.address)} ngonka")
    return 0


def _vote(args: argparse.Namespace) -> int:
    client = open_client(args)
    client.vote(args.proposal, args.support == "yes")
    p = client.proposal(args.proposal)
    print(f"proposal {p.proposal_id}: for {p.for_votes}, against {p.against_votes}, quorum {p.quorum} ({p.state})")
    return 0


def _execute(args: argparse.Namespace) -> int:
    client = open_client(args)
    receipt = client.execute(args.proposal)
    created = client.epochs_created(receipt)
    print(f"proposal {args.proposal} executed" + (f"; epoch(s) {created} created" if created else ""))
    return 0
