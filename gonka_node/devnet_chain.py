"""The devnet's chain: the embedded EVM served over JSON-RPC on 127.0.0.1 (or the kernel links' bridge)
from this process, or an
external development node (anvil) whose funded dev accounts play the same roles; the epoch scheduled
and funded by a Governor vote (the voting period passes by moving the chain's clock), and the sign-in
window closed the same way once every host has signed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chain.backends import ChainBackend, EmbeddedBackend, RpcBackend
from chain.client import ChainClient
from chain.server import ChainServer
from chain.types import Deployment
from gonka_node.core.recipe import Recipe
from gonka_node.devnet_procs import Children, DevnetError, wait_for

GOVERNANCE, AGGREGATOR = 0, 9  # dev account indices; hosts are 1..N
VOTING_PERIOD_S = 3600
SIGNIN_WINDOW_S = 600  # closed early by moving the clock once every host has signed in


@dataclass
class DevnetChain:
    """The devnet's chain: a backend this process controls (dev accounts, clock) and the URL children use."""

    backend: ChainBackend
    url: str
    server: ChainServer | None = None  # set when the chain is the embedded one, served from here

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_chain(chain_url: str | None = None, hub: str = "127.0.0.1") -> DevnetChain:
    """The embedded EVM served on `hub` (loopback, or the kernel links' bridge: devnet_links.py), or an
    external development node at `chain_url`."""
    if chain_url is None:
        backend = EmbeddedBackend()
        server = ChainServer(backend, hub, 0).start()
        return DevnetChain(backend, server.url, server)
    rpc = RpcBackend(chain_url)
    if len(rpc.dev_accounts()) <= AGGREGATOR:
        raise DevnetError(
            f"{chain_url} ({rpc.client_version()}) is not a development node with funded accounts "
            f"0..{AGGREGATOR}: the devnet needs anvil or `gonka-node chain serve`"
        )
    return DevnetChain(rpc, chain_url)


@dataclass(frozen=True)
class ScheduledEpoch:
    deployment: Deployment
    recipe: Recipe
    epoch: int
    init_sha: bytes


def schedule_by_vote(backend: ChainBackend, deployment: Deployment, spec: Any, pool: int) -> int:
    """Create and fund the epoch through the Governor: treasury transfer, escrow, propose, vote, execute."""
    accounts = backend.dev_accounts()
    gov = ChainClient(backend, accounts[GOVERNANCE], deployment).connect()
    if pool:
        gov.transfer(deployment.governor, pool)
    epoch = gov.epoch_count() + 1
    voters = [ChainClient(backend, accounts[i], deployment).connect() for i in (GOVERNANCE, AGGREGATOR)]
    for v in voters:
        v.gov_deposit(v.gnk_balance() * 9 // 10)
    funding = gov.action_fund_epoch(epoch, pool) if pool else []
    pid = gov.propose([gov.action_create_epoch(spec), *funding], "devnet epoch")
    for v in voters:
        v.vote(pid, True)
    backend.increase_time(VOTING_PERIOD_S + 1)
    created = gov.epochs_created(gov.execute(pid))
    if created != [epoch]:
        raise DevnetError(f"the proposal created epochs {created}, expected [{epoch}]")
    return epoch


def close_signin(chain: DevnetChain, sched: ScheduledEpoch, hosts: int, children: Children, out: Path) -> None:
    """Wait for `hosts` sign-ins, then move the clock past the sign-in window: rounds may finalize."""
    reader = ChainClient(chain.backend, chain.backend.dev_accounts()[GOVERNANCE], sched.deployment).connect()
    wait_for("every host to sign in", lambda: len(reader.hosts(sched.epoch)) >= hosts, 300, children, out / "logs")
    chain.backend.increase_time(SIGNIN_WINDOW_S + 1)
