"""`gonka-node transfer`: send GNK (stake, rewards, the Governor's treasury) and ETH (gas) to an address.

A fresh host account (`gonka-node keys init`) holds nothing: before it can sign in it needs ETH to pay
for its transactions and GNK to stake. On a devnet a funded dev account sends both; elsewhere any account
whose key is in `--key-file`.
"""

from __future__ import annotations

import argparse
from decimal import Decimal, InvalidOperation

from eth_utils import is_address

from gonka_node.cli import CliError
from gonka_node.cli.chain import add_connection_args, chain_errors, open_client, parse_amount
from gonka_node.cli.fmt import amount, eth
from gonka_node.cli.verbs import add_verb

WEI_PER_ETH = 10**18


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_verb(
        subparsers, "transfer", help="send GNK and/or ETH (for gas) from your account to an address",
        amounts=True,
        examples=["gonka-node transfer --to 0xHOST --gnk 150 --eth 1 --dev-account 0   # a devnet's funded account",
                  "gonka-node transfer --to 0xHOST --gnk 150 --key-file treasurer.key"],
        next="the receiver can stake: gonka-node run --config host.toml --check",
    )
    add_connection_args(p)
    p.add_argument("--to", required=True, metavar="ADDRESS", help="receiving EVM address (0x…)")
    p.add_argument("--gnk", metavar="AMOUNT", help="GNK to send (decimals allowed: 1.5)")
    p.add_argument("--eth", metavar="AMOUNT", help="ETH to send, for the receiver's gas")
    p.set_defaults(func=chain_errors(_transfer))


def parse_eth(text: str) -> int:
    try:
        value = Decimal(text) * WEI_PER_ETH
    except InvalidOperation:
        raise CliError(f"--eth {text!r}: not a number") from None
    if not value.is_finite() or value < 0 or value != value.to_integral_value():
        raise CliError(f"--eth {text!r}: must be >= 0 with at most 18 decimals")
    return int(value)


def _transfer(args: argparse.Namespace) -> int:
    if not is_address(args.to):
        raise CliError(f"--to {args.to!r}: not an EVM address (0x and 40 hex digits)")
    if args.gnk is None and args.eth is None:
        raise CliError("give --gnk AMOUNT, --eth AMOUNT or both")
    gnk = parse_amount("--gnk", args.gnk) if args.gnk is not None else 0
    wei = parse_eth(args.eth) if args.eth is not None else 0
    client = open_client(args)
    if gnk:
        have = client.gnk_balance()
        if have < gnk:
            raise CliError(f"--gnk: {client.address} holds {amount(have, args)}, less than {amount(gnk, args)}")
        client.transfer(args.to, gnk)
    if wei:
        client.transfer_eth(args.to, wei)
    print(f"sent {amount(gnk, args)} and {eth(wei)} from {client.address} to {args.to}; it now holds "
          f"{amount(client.gnk_balance(args.to), args)} and {eth(client.eth_balance(args.to))}")
    return 0
