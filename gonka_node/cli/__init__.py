"""The `gonka-node` command line.

Each verb group lives in its own module exposing `register(subparsers)`, declaring its verbs with
`verbs.add_verb` (examples and a "next:" line in every --help); this module only assembles them and
turns failures into one line on stderr (`failures.explain`): exit status 2 for the user's mistakes and
the outside world's refusals, 1 for a bug. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
import sys
from collections.abc import Sequence

from gonka_node.cli.verbs import add_common_flags


class CliError(Exception):
    """A mistake the user can fix (bad file, bad field, missing key); printed without a traceback."""


def version() -> str:
    try:
        return importlib.metadata.version("gonka-node")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


# verb -> the module of this package that registers it. Parsing `gonka-node VERB …` imports only that
# module (a host's `status` need not load torch); tests/gonka_node/test_cli_help.py checks the map
# against what the modules register.
VERB_MODULES = {
    "aggregator": "aggregator", "chain": "chain", "challenge": "challenge", "checkpoint": "checkpoint",
    "data": "data", "devnet": "devnet", "explorer": "explorer", "gov": "gov", "init": "init", "keys": "keys", "rewards": "host",
    "run": "host", "serve": "serve", "stake": "host", "status": "host", "train": "train", "transfer": "transfer",
}


def _verb_in(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (with a known `verb`) one holding only the module that registers it."""
    parser = argparse.ArgumentParser(
        prog="gonka-node",
        description="Decentralized DiLoCo training with an EVM chain keeping the books.",
        epilog="start here: gonka-node devnet (everything on this machine), then README.md "
        "\"Run a real epoch\" for each role; gonka-node VERB --help for examples",
    )
    parser.add_argument("--version", action="version", version=f"gonka-node {version()}")
    add_common_flags(parser)
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    # Every module of this package that defines `register` contributes its verbs, in name order.
    names = sorted(m.name for m in pkgutil.iter_modules(__path__))
    if verb in VERB_MODULES:
        names = [VERB_MODULES[verb]]
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_verb_in(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a usage error argparse has printed (2)
        return int(exc.code or 0)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        if getattr(args, "debug", False):
            raise
        return _fail(args, str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        from gonka_node.cli.failures import explain

        message = explain(exc)
        if message is None:  # not the user's doing: a bug, said in one line all the same
            return _fail(args, f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the "
                         "traceback, and report it)", status=1)
        return _fail(args, message)


def _fail(args: argparse.Namespace, message: str, status: int = 2) -> int:
    where = " ".join(str(v) for v in (args.verb, *_actions(args)))
    first, *rest = message.splitlines() or [""]
    print(f"gonka-node {where}: error: {first}", file=sys.stderr)
    for line in rest:  # a message of several lines is several problems, one per line
        print(f"gonka-node {where}: error: {line}", file=sys.stderr)
    return status


def _actions(args: argparse.Namespace) -> list[str]:
    return [v for k, v in sorted(vars(args).items()) if k.endswith("_action") and isinstance(v, str)]


if __name__ == "__main__":
    sys.exit(main())
