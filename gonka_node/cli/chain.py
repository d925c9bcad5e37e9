"""`gonka-node chain deploy|serve|status`: the contracts, the embedded chain served on 127.0.0.1, and
a summary of what is on chain. Also the connection helpers `gov.py` shares (node URL, signing key,
deployment file).

Keys: `--key-file` holds a plain hex private key and must not be readable by others (0600); it is
never printed. On a devnet (anvil, `chain serve`) `--dev-account N` signs with the node's funded
test account N instead.
"""

from __future__ import annotations

import argparse
import signal
import stat
import sys
import threading
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from eth_account import Account
from eth_account.signers.local import LocalAccount

from gonka_node.cli import CliError
from gonka_node.cli.verbs import add_group, add_verb

DEFAULT_DEPLOYMENT = Path("deployment.json")
MAX_KEY_FILE_BYTES = 4096


def register(subparsers: argparse._SubParsersAction) -> None:
    actions = add_group(subparsers, "chain", help="deploy the contracts, serve the embedded chain, show status")

    deploy = add_verb(
        actions, "deploy", help="deploy GNK, Governor and Registry; write the deployment file",
        examples=["gonka-node chain deploy --rpc-url http://127.0.0.1:8545 --governor --key-file deployer.key"],
        next="gonka-node gov build-spec … to plan an epoch; share deployment.json with hosts and aggregators",
    )
    add_connection_args(deploy, need_url=True)
    deploy.add_argument("--governor", action="store_true", help="hand governance and minting to the Governor")
    deploy.add_argument("--voting-period", type=int, default=3600, help="seconds (default 3600)")
    deploy.add_argument("--quorum-bps", type=int, default=2000, help="quorum in basis points of supply")
    deploy.add_argument("--mint-dev", default="0", metavar="GNK", help="mint this much to each dev account")
    deploy.set_defaults(func=chain_errors(_deploy))

    serve = add_verb(
        actions, "serve", help="run the embedded EVM and serve it over JSON-RPC until Ctrl-C",
        examples=["gonka-node chain serve --port 8545 --deployment deployment.json"],
        next="gonka-node chain status --deployment deployment.json; hand deployment.json to every role",
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=0, help="port (default 0: the OS picks one)")
    serve.add_argument("--url-file", type=Path, help="write the URL here once listening")
    serve.add_argument("--deployment", type=Path, help="deploy the contracts at start and write this file")
    serve.add_argument("--governor", action="store_true", help="with --deployment: the Governor holds "
                       "governance and minting (default: dev account 0 does, and acts without votes)")
    serve.add_argument("--mint-dev", default="1000000", metavar="GNK", help="GNK minted to each dev account")
    serve.add_argument("--voting-period", type=int, default=3600, help="the Governor's voting period in "
                       "seconds (default 3600)")
    serve.add_argument("--quorum-bps", type=int, default=2000, help="the Governor's quorum in basis points of "
                       "the GNK supply (default 2000)")
    serve.add_argument("--frozen-clock", action="store_true",
                       help="move the chain's time only when a transaction is mined (default: follow the "
                       "wall clock, so deadlines pass on their own)")
    serve.set_defaults(func=chain_errors(_serve))

    status = add_verb(
        actions, "status", help="deployment, epochs, hosts and rounds as tables", amounts=True,
        examples=["gonka-node chain status --deployment deployment.json --epoch 1"],
        next="gonka-node checkpoint list, or gonka-node gov proposals",
    )
    add_connection_args(status, need_key=False)
    status.add_argument("--epoch", type=int, help="also list this epoch's hosts and rounds")
    status.set_defaults(func=chain_errors(_status))


# ---------------------------------------------------------------------- shared with gov.py


def add_connection_args(parser: argparse.ArgumentParser, need_url: bool = False, need_key: bool = True) -> None:
    parser.add_argument(
        "--deployment", type=Path, default=DEFAULT_DEPLOYMENT,
        help="deployment file (default deployment.json)" if not need_url else "deployment file to write "
        "(default deployment.json)",
    )
    parser.add_argument(
        "--rpc-url", required=need_url,
        help="JSON-RPC URL of the node (saved in the deployment file)" if need_url
        else "JSON-RPC URL (default: the one saved in the deployment file)",
    )
    if need_key:
        parser.add_argument("--key-file", type=Path, help="file with a hex private key (mode 0600)")
        parser.add_argument(
            "--dev-account", type=int, default=0, help="on a devnet without --key-file: funded account N"
        )


def chain_errors(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Chain failures (a revert, a refused transaction, a bad file) are the user's to fix: one line."""
    from chain.errors import ChainError
    from gonka_node.cli.failures import explain

    @wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ChainError as exc:
            raise CliError(explain(exc) or str(exc)) from exc

    return wrapper


def load_key_file(path: Path) -> LocalAccount:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CliError(f"--key-file {path}: no such file") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CliError(f"--key-file {path}: readable by other users; run `chmod 600 {path}`")
    if path.stat().st_size > MAX_KEY_FILE_BYTES:
        raise CliError(f"--key-file {path}: too large for a key file")
    text = path.read_text(encoding="utf-8").strip().removeprefix("0x")
    try:
        key = bytes.fromhex(text)
        if len(key) != 32:
            raise ValueError
        return Account.from_key(key)
    except ValueError:
        # Never echo the content: it may be a key with a typo.
        raise CliError(f"--key-file {path}: not a 32-byte hex private key") from None


def open_client(args: argparse.Namespace, need_deployment: bool = True) -> Any:
    """A connected ChainClient for these arguments."""
    from chain.backends import RpcBackend
    from chain.client import ChainClient
    from chain.types import Deployment

    deployment = Deployment.load(args.deployment) if need_deployment else None
    url = args.rpc_url or (deployment.extra.get("rpc_url") if deployment else None)
    if not url:
        raise CliError(f"no --rpc-url given and {args.deployment} records none")
    backend = RpcBackend(url)
    if not hasattr(args, "key_file"):  # a read-only verb (add_connection_args(need_key=False))
        # It only calls views, so any address will do; this key is made here and never signs.
        return ChainClient(backend, Account.create(), deployment).connect()
    key_file = args.key_file
    if key_file is not None:
        account = load_key_file(key_file)
    else:
        accounts = backend.dev_accounts()
        if not accounts:
            raise CliError(f"{url} is not a known devnet: give --key-file")
        index = getattr(args, "dev_account", 0)
        if not 0 <= index < len(accounts):
            raise CliError(f"--dev-account {index}: the devnet has accounts 0..{len(accounts) - 1}")
        account = accounts[index]
    return ChainClient(backend, account, deployment).connect()


def parse_amount(flag: str, text: str) -> int:
    from chain.units import parse_gnk

    try:
        return parse_gnk(text)
    except ValueError as exc:
        raise CliError(f"{flag}: {exc}") from None


# ---------------------------------------------------------------------- verbs


def _deploy(args: argparse.Namespace) -> int:
    client = open_client(args, need_deployment=False)
    mint = parse_amount("--mint-dev", args.mint_dev)
    dev = client.backend.dev_accounts() if mint else []
    deployment = client.deploy_all(
        use_governor=args.governor,
        voting_period_s=args.voting_period,
        quorum_bps=args.quorum_bps,
        initial_mint={a.address: mint for a in dev},
    )
    deployment.extra["rpc_url"] = args.rpc_url
    deployment.save(args.deployment)
    _print_deployment(deployment)
    print(f"wrote {args.deployment}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from chain.backends import EmbeddedBackend
    from chain.client import ChainClient
    from chain.server import ChainServer

    backend = EmbeddedBackend()
    server = ChainServer(backend, args.host, args.port, follow_clock=not args.frozen_clock).start()
    if args.deployment is not None:
        mint = parse_amount("--mint-dev", args.mint_dev)
        accounts = backend.dev_accounts()
        client = ChainClient(backend, accounts[0]).connect()
        deployment = client.deploy_all(initial_mint={a.address: mint for a in accounts},
                                       use_governor=args.governor, voting_period_s=args.voting_period,
                                       quorum_bps=args.quorum_bps)
        deployment.extra["rpc_url"] = server.url
        deployment.save(args.deployment)
        print(f"deployed; wrote {args.deployment}", flush=True)
    if args.url_file is not None:
        tmp = args.url_file.with_name(args.url_file.name + ".tmp")
        tmp.write_text(server.url + "\n", encoding="utf-8")
        tmp.replace(args.url_file)  # atomic: a waiting process never reads half a URL
    print(f"serving chain {backend.connect().eth.chain_id} at {server.url}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _print_deployment(deployment: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"deployment on chain {deployment.chain_id}")
    table.add_column("contract")
    table.add_column("address", no_wrap=True, min_width=42)
    for name in ("gnk", "governor", "registry", "governance", "deployer"):
        table.add_row(name, getattr(deployment, name))
    Console(file=sys.stdout).print(table)


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gonka_node.cli.fmt import amount, when

    client = open_client(args)
    now = client.chain_time()
    console = Console(file=sys.stdout)
    _print_deployment(client.deployment)
    epochs = Table(title=f"epochs (chain time {when(now, now)})")
    for col in ("epoch", "rounds", "hosts", "stake", "pool", "funded", "sign-in ends", "ended"):
        epochs.add_column(col)
    for epoch in range(1, client.epoch_count() + 1):
        e = client.get_epoch(epoch)
        epochs.add_row(
            str(epoch), f"{e.latest_round}/{e.spec.n_rounds}", f"{e.n_hosts}/{e.spec.max_hosts}",
            amount(e.total_stake, args), amount(e.pool, args), amount(e.funded, args), when(e.signin_end, now),
            "yes" if e.ended else "no",
        )
    console.print(epochs)
    if args.epoch is not None:
        _print_epoch(console, client, args.epoch, args)
    return 0


def _print_epoch(console: Any, client: Any, epoch: int, args: argparse.Namespace) -> None:
    from rich.table import Table

    from gonka_node.cli.fmt import amount, when

    hosts = Table(title=f"epoch {epoch}: hosts")
    for col in ("slot", "host", "node key", "stake", "slashed", "left", "withdrawn"):
        # Addresses are copied from here: never wrap or cut them.
        hosts.add_column(col, no_wrap=True, min_width=42 if col == "host" else None)
    for address in client.hosts(epoch):
        h = client.host_info(epoch, address)
        hosts.add_row(str(h.slot), address, h.node_key.hex()[:16] + "…", amount(h.stake, args),
                      amount(h.slashed, args), "yes" if h.left else "no", "yes" if h.withdrawn else "no")
    console.print(hosts)
    rounds = Table(title=f"epoch {epoch}: rounds")
    for col in ("round", "checkpoint sha256", "contributors", "reward", "claimed", "finalized"):
        rounds.add_column(col)
    now = client.chain_time()
    for r in range(1, client.latest_round(epoch) + 1):
        res = client.round_result(epoch, r)
        rounds.add_row(str(r), res.checkpoint_sha256.hex(), str(res.n_contributors),
                       amount(res.total_reward, args), amount(res.claimed, args), when(res.finalized_at, now))
    console.print(rounds)
