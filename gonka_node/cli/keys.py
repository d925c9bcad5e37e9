"""`gonka-node keys init|show|import`: a host's node key (ed25519) and EVM account (secp256k1).

Secrets never come from argv (process lists show it to every user): keys are imported from a file or
stdin, passphrases come from a prompt, `--passphrase-file` or GONKA_KEY_PASSPHRASE (read through
`gonka_node.core.config`, the one module that reads the environment).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.verbs import add_group, add_verb
from gonka_node.core import config, keys

PASSPHRASE_ENV = "GONKA_KEY_PASSPHRASE"
_MAX_SECRET_FILE_BYTES = 4096
_KDF = {"standard": keys.STANDARD_KDF, "interactive": keys.INTERACTIVE_KDF}


def register(subparsers: argparse._SubParsersAction) -> None:
    actions = add_group(subparsers, "keys", help="create, show or import the node key and EVM account")

    init = add_verb(
        actions, "init", help="create a fresh node key and EVM account",
        examples=["gonka-node keys init --key-dir keys --passphrase-file keys.pass",
                  "gonka-node keys init --key-dir keys --insecure-plaintext   # devnets only"],
        next="fund the EVM address (gonka-node transfer --to ADDRESS …), then gonka-node run --config host.toml --check",
    )
    _add_common(init)
    _add_protection(init)
    init.set_defaults(func=_init)

    show = add_verb(
        actions, "show", help="print the node public key, EVM and gonka1 addresses, and the balances", amounts=True,
        examples=["gonka-node keys show --key-dir keys --deployment deployment.json",
                  "gonka-node keys show --config host.toml --passphrase-file keys.pass"],
        next="gonka-node status --config host.toml",
    )
    _add_common(show)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.add_argument("--config", type=Path, help="a host config: its key_dir, deployment and chain (for balances)")
    show.add_argument("--deployment", type=Path, help="deployment file: show the GNK and ETH balances on its chain")
    show.add_argument("--rpc-url", help="with --deployment: the node to ask (default: the file's)")
    show.set_defaults(func=_show)

    imp = add_verb(
        actions, "import", help="import existing key(s) from files or stdin; a missing partner key is generated",
        examples=["gonka-node keys import --key-dir keys --evm-key evm.hex --passphrase-file keys.pass",
                  "cat node.hex | gonka-node keys import --key-dir keys --node-key -"],
        next="gonka-node keys show --key-dir keys --deployment deployment.json",
    )
    _add_common(imp)
    _add_protection(imp)
    imp.add_argument("--node-key", metavar="FILE", help="file holding the ed25519 seed as hex ('-': stdin)")
    imp.add_argument("--evm-key", metavar="FILE", help="file holding the EVM private key as hex ('-': stdin)")
    imp.set_defaults(func=_import)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key-dir", type=Path, default=keys.DEFAULT_KEY_DIR, help="key directory (default: ~/.gonka/keys)"
    )
    parser.add_argument(
        "--passphrase-file", type=Path, help="read the passphrase from this file (mode 0600; first line)"
    )


def _add_protection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help="store keys unencrypted (devnets and tests only; anyone who reads the files owns the keys)",
    )
    parser.add_argument("--force", action="store_true", help="replace existing key files")
    parser.add_argument(
        "--kdf",
        choices=sorted(_KDF),
        default="standard",
        help="passphrase hashing cost: standard (~2-4 s to unlock) or interactive (~0.2 s, weaker)",
    )


# ---------------------------------------------------------------------------------------------- verbs


def _init(args: argparse.Namespace) -> int:
    passphrase = None if args.insecure_plaintext else _passphrase(args, confirm=True)
    try:
        node_keys = keys.init_keys(
            args.key_dir,
            passphrase,
            insecure_plaintext=args.insecure_plaintext,
            force=args.force,
            kdf=_KDF[args.kdf],
        )
    except keys.KeyStoreError as exc:
        raise CliError(str(exc)) from None
    print(f"created {keys.NODE_KEY_FILE} and {keys.EVM_KEY_FILE} in {args.key_dir.expanduser()}")
    _print_identity(args.key_dir, node_keys, encrypted=passphrase is not None)
    return 0


def _import(args: argparse.Namespace) -> int:
    if args.node_key is None and args.evm_key is None:
        raise CliError("give --node-key FILE, --evm-key FILE or both ('-' reads stdin)")
    if args.node_key == "-" and args.evm_key == "-":
        raise CliError("only one of --node-key and --evm-key can read stdin")
    try:
        node_seed = _read_key(args.node_key, "node key") if args.node_key else None
        evm_key = _read_key(args.evm_key, "EVM key") if args.evm_key else None
        passphrase = None if args.insecure_plaintext else _passphrase(args, confirm=True)
        node_keys, written = keys.import_keys(
            args.key_dir,
            passphrase,
            node_seed=node_seed,
            evm_private_key=evm_key,
            insecure_plaintext=args.insecure_plaintext,
            force=args.force,
            kdf=_KDF[args.kdf],
        )
    except keys.KeyStoreError as exc:
        raise CliError(str(exc)) from None
    for name in written:
        imported = (name == keys.NODE_KEY_FILE and node_seed) or (name == keys.EVM_KEY_FILE and evm_key)
        print(f"{'imported' if imported else 'generated'} {name} in {args.key_dir.expanduser()}")
    _print_identity(args.key_dir, node_keys, encrypted=passphrase is not None)
    return 0


def _show(args: argparse.Namespace) -> int:
    key_dir, deployment, rpc_url = args.key_dir, args.deployment, args.rpc_url
    if args.config is not None:
        from gonka_node.host.config import load_host_config

        cfg = load_host_config(args.config)
        key_dir, deployment, rpc_url = cfg.key_dir, deployment or cfg.deployment, rpc_url or cfg.rpc_url
    try:
        encrypted = keys.keys_encrypted(key_dir)
        passphrase = _passphrase(args, confirm=False) if encrypted else None
        node_keys = keys.load_keys(key_dir, passphrase)
    except keys.KeyStoreError as exc:
        raise CliError(str(exc)) from None
    identity = _identity(key_dir, node_keys, encrypted)
    if deployment is not None:
        identity |= _balances(node_keys.evm_address, deployment, rpc_url)
    if args.json:
        print(json.dumps(identity))
        return 0
    _print_identity(key_dir, node_keys, encrypted)
    if deployment is None:
        print("balances:         give --deployment FILE (or --config host.toml) to read them from the chain")
        return 0
    from gonka_node.cli.fmt import amount, eth

    print(f"GNK balance:      {amount(identity['gnk_ngonka'], args)}")
    print(f"ETH balance:      {eth(identity['eth_wei'])} (pays for gas)")
    return 0


def _balances(address: str, deployment: Path, rpc_url: str | None) -> dict[str, Any]:
    from eth_account import Account

    from chain.backends import RpcBackend
    from chain.client import ChainClient
    from chain.types import Deployment

    dep = Deployment.load(deployment)
    url = rpc_url or dep.extra.get("rpc_url")
    if not url:
        raise CliError(f"{deployment} records no rpc_url: give --rpc-url")
    reader = ChainClient(RpcBackend(url), Account.create(), dep).connect()  # reads only: this key never signs
    return {"chain_id": dep.chain_id, "gnk_ngonka": reader.gnk_balance(address), "eth_wei": reader.eth_balance(address)}


def _identity(key_dir: Path, node_keys: keys.NodeKeys, encrypted: bool) -> dict[str, Any]:
    return {
        "key_dir": str(Path(key_dir).expanduser()),
        "encrypted": encrypted,
        "node_public_key": node_keys.node_public_key.hex(),
        "evm_address": node_keys.evm_address,
        "cosmos_address": node_keys.cosmos_address,
    }


def _print_identity(key_dir: Path, node_keys: keys.NodeKeys, encrypted: bool) -> None:
    identity = _identity(key_dir, node_keys, encrypted)
    storage = "encrypted" if encrypted else "PLAINTEXT (devnet only)"
    print(f"key dir:          {identity['key_dir']}")
    print(f"storage:          {storage}")
    print(f"node public key:  {identity['node_public_key']}")
    print(f"EVM address:      {identity['evm_address']}")
    print(f"Cosmos address:   {identity['cosmos_address']}")
    if not encrypted:
        print("warning: keys are stored unencrypted; use them on devnets only", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- secrets


def read_passphrase_file(path: Path) -> str:
    """The first line of a passphrase file, which must be private to its owner (0600)."""
    text = _read_secret_file(path, "passphrase file", check_private=True)
    passphrase = text.splitlines()[0] if text else ""
    if not passphrase:
        raise CliError(f"{path}: the passphrase file is empty")
    return passphrase


def _passphrase(args: argparse.Namespace, *, confirm: bool) -> str:
    """From --passphrase-file, else GONKA_KEY_PASSPHRASE, else a prompt on the terminal."""
    if args.passphrase_file is not None:
        passphrase = read_passphrase_file(args.passphrase_file)
    else:
        try:
            env = config.read_env()
        except config.ConfigError as exc:
            raise CliError(str(exc)) from None
        passphrase = env.get(PASSPHRASE_ENV) or _prompt(confirm)
    if not passphrase:
        source = args.passphrase_file or PASSPHRASE_ENV
        raise CliError(f"empty passphrase from {source}; give one, or use --insecure-plaintext on devnets")
    return passphrase


def _prompt(confirm: bool) -> str:
    try:
        first = getpass.getpass("key passphrase: ")
        if confirm and getpass.getpass("repeat passphrase: ") != first:
            raise CliError("the two passphrases differ; nothing was written")
    except EOFError:
        raise CliError(
            f"no terminal to ask for a passphrase; use --passphrase-file, {PASSPHRASE_ENV} "
            "or --insecure-plaintext"
        ) from None
    return first


def _read_key(spec: str, what: str) -> bytes:
    if spec == "-":
        # On a terminal, read without echo; piped, read at most a few KiB.
        text = (
            getpass.getpass(f"{what} (hex): ")
            if sys.stdin.isatty()
            else sys.stdin.read(_MAX_SECRET_FILE_BYTES)
        )
    else:
        text = _read_secret_file(Path(spec), f"{what} file", check_private=False)
    return keys.parse_private_key_hex(text, f"{what} from {'stdin' if spec == '-' else spec}")


def _read_secret_file(path: Path, what: str, *, check_private: bool) -> str:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise CliError(f"{path}: cannot read {what} ({exc.strerror})") from None
    if check_private and mode & 0o077:
        raise CliError(
            f"{path}: {what} is readable by group/others (mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )
    if len(raw) > _MAX_SECRET_FILE_BYTES:
        raise CliError(f"{path}: {what} is larger than {_MAX_SECRET_FILE_BYTES} bytes")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise CliError(f"{path}: {what} is not UTF-8 text") from None
