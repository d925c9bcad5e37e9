"""The `gonka-node` command line.

Each verb group lives in its own module exposing `register(subparsers)`; this module only assembles
them and turns the project's user-facing errors into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules under gonka_node.cli that contribute verbs, in the order `--help` lists them.
_VERB_MODULES = ("train",)


class CliError(Exception):
    """A mistake the user can fix (bad file, bad field, missing key); printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gonka-node",
        description="Decentralized DiLoCo training with an EVM chain keeping the books.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in _VERB_MODULES:
        importlib.import_module(f"gonka_node.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"gonka-node {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
