"""How every `gonka-node` verb is declared: help, examples, the next step, and the common flags.

Each leaf verb is made by `add_verb`, so `gonka-node VERB --help` always ends with examples and a
"next:" line saying what a user usually runs after it (tests/gonka_node/test_cli_help.py checks every
verb). `--debug` (tracebacks instead of one-line errors) is accepted by every verb, `--ngonka` (amounts in
ngonka instead of GNK) by every verb that shows amounts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def add_verb(
    actions: Any,
    name: str,
    *,
    help: str,
    examples: Sequence[str],
    next: str,
    description: str | None = None,
    amounts: bool = False,
) -> argparse.ArgumentParser:
    """A sub-parser of `actions` whose --help shows `description`, then `examples` and `next`."""
    lines = ["examples:", *(f"  {example}" for example in examples), f"next: {next}"]
    parser: argparse.ArgumentParser = actions.add_parser(
        name,
        help=help,
        description=description or help[:1].upper() + help[1:] + ".",
        epilog="\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_flags(parser, amounts=amounts)
    return parser


def add_group(subparsers: Any, name: str, *, help: str) -> Any:
    """A verb group (`gonka-node chain …`): its actions are added with `add_verb`."""
    parser = subparsers.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".")
    return parser.add_subparsers(dest=f"{name}_action", metavar="ACTION", required=True)


def add_common_flags(parser: argparse.ArgumentParser, *, amounts: bool = False) -> None:
    # SUPPRESS: a verb's flag must not reset the same flag given before the verb (`gonka-node --debug run`).
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS,
        help="on failure print the Python traceback instead of a one-line error",
    )
    if amounts:
        parser.add_argument(
            "--ngonka", action="store_true", default=argparse.SUPPRESS,
            help="show amounts in ngonka (1 GNK = 10^9 ngonka) instead of GNK",
        )
