"""The `gonka-node` command line.

Each verb group lives in its own module exposing `register(subparsers)`; this module only assembles
them and turns the project's user-facing errors into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence


class CliError(Exception):
    """A mistake the user can fix (bad file, bad field, missing key); printed without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gonka-node",
        description="Decentralized DiLoCo training with an EVM chain keeping the books.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    # Every module of this package that defines `register` contributes its verbs, in name order.
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
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
