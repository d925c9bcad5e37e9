"""What a host checks before it stakes anything: each failure one line that names the fix.

`gonka-node run` signs in with a stake as its first transaction; everything that would make the epoch
fail for this host afterwards is checked before that, from what the chain and the aggregator say:
the epoch exists and is open to sign-in with a free slot, the stake meets the epoch's minimum, the
account holds the GNK to stake and the ETH to pay for its transactions, the recipe is the epoch's
(model spec hash and every hyperparameter the chain records), this machine's corpus is the epoch's
data (its manifest), and the aggregator answers with the certificate announced on chain.
A host already signed in (a restart) skips the sign-in checks, and waits for an aggregator that does
not answer (an outage) rather than refusing to start; a wrong certificate stops it either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chain.client import ChainClient
from chain.units import gnk_decimal
from gonka_node.core.recipe import Recipe, RecipeError
from gonka_node.core.tls import TlsError, check_peer

# Gas a host spends over an epoch with a margin: approve + sign-in (~250k), a claim per round (~80k
# each, a handful of rounds), the stake withdrawal. Priced at the fee cap the host signs with.
GAS_BUDGET = 1_500_000
PEER_CHECK_S = 10.0


@dataclass(frozen=True)
class HostPlan:
    """What the host is about to do: who, in which epoch, with what stake, recipe and aggregator."""

    chain: ChainClient
    epoch: int
    stake: int  # ngonka
    recipe: Recipe
    recipe_path: Path
    node_key: bytes
    cache_dir: Path | None = None


def check_epoch(chain: ChainClient, epoch: int) -> str | None:
    count = chain.epoch_count()
    if not 1 <= epoch <= count:
        have = f"epochs 1..{count}" if count else "no epoch yet"
        return (f"epoch {epoch} does not exist on chain {chain.chain_id} (it has {have}): set [host] "
                "epoch to one of them (0: the latest), or wait for governance to create it")
    return None


def check_signin(plan: HostPlan, when: Callable[[int, int], str]) -> list[str]:
    """The sign-in checks (skipped by the caller when the host is already signed in)."""
    chain, epoch = plan.chain, plan.epoch
    info = chain.get_epoch(epoch)
    spec, now = info.spec, chain.chain_time()
    problems = []
    if info.latest_round >= spec.n_rounds or info.ended:
        problems.append(f"epoch {epoch} has ended: set [host] epoch to an open one (gonka-node chain status)")
    elif now >= info.signin_end:
        problems.append(f"epoch {epoch} closed sign-in {when(info.signin_end, now)}: "
                        "join a later epoch (gonka-node chain status lists them)")
    elif info.n_hosts >= spec.max_hosts:
        problems.append(f"epoch {epoch} is full ({info.n_hosts} of {spec.max_hosts} slots): join another epoch")
    if plan.stake < spec.min_stake:
        problems.append(f"[host] stake_gnk = {gnk_decimal(plan.stake)} is below epoch {epoch}'s minimum stake of "
                        f"{gnk_decimal(spec.min_stake)} GNK: raise stake_gnk")
    owner = chain.key_owner(epoch, plan.node_key)
    if owner is not None:
        problems.append(f"this node key is already registered in epoch {epoch} by {owner}: use another key "
                        "directory (gonka-node keys init)")
    return problems


def check_funds(plan: HostPlan, joined: bool) -> str | None:
    """One line naming what is missing and the command that sends it, or None."""
    chain = plan.chain
    need_gnk = 0 if joined else plan.stake
    have_gnk, have_wei = chain.gnk_balance(), chain.eth_balance()
    need_wei = GAS_BUDGET * chain.max_fee_per_gas()
    short = []
    if have_gnk < need_gnk:
        short.append(("gnk", need_gnk - have_gnk, f"{gnk_decimal(have_gnk)} GNK of the {gnk_decimal(need_gnk)} "
                      "to stake"))
    if have_wei < need_wei:
        short.append(("eth", need_wei - have_wei, f"{_eth(have_wei)} ETH of the ~{_eth(need_wei)} its "
                      "transactions cost"))
    if not short:
        return None
    flags = " ".join(f"--{kind} {gnk_decimal(missing) if kind == 'gnk' else _eth(missing, up=True)}"
                     for kind, missing, _ in short)
    holds = " and ".join(what for _, _, what in short)
    return f"account {chain.address} holds {holds}: fund it, e.g. `gonka-node transfer --to {chain.address} {flags}`"


def check_recipe(plan: HostPlan) -> list[str]:
    spec = plan.chain.get_epoch(plan.epoch).spec
    try:
        plan.recipe.check_against_chain(spec)
    except RecipeError as exc:
        return [f"recipe {plan.recipe_path} is not epoch {plan.epoch}'s ({exc}): get the epoch's recipe from "
                "governance and set [host] recipe to it"]
    try:
        plan.recipe.windows(plan.cache_dir)
    except RecipeError as exc:
        return [f"{exc}: put the epoch's corpus on this machine (recipe field corpus)"]
    return []


def check_aggregator(target: str, pin: bytes, source: str, must_answer: bool = True) -> str | None:
    """A wrong certificate is always a problem; silence only when `must_answer` (before staking: a host
    already signed in waits out an aggregator outage instead, saying so)."""
    try:
        check_peer(target, pin, PEER_CHECK_S)
    except TlsError as exc:
        return f"aggregator {target}: {exc}"
    except (OSError, ValueError) as exc:
        if not must_answer:
            return None
        return (f"aggregator {target} (from {source}) does not answer ({exc}): is it running and reachable from "
                "here? set [host] aggregator if it serves elsewhere")
    return None


def _eth(wei: int, up: bool = False) -> str:
    """Wei as ETH with at most 6 decimals (rounded up when `up`: an amount to send must suffice)."""
    micro = -(-wei // 10**12) if up else wei // 10**12
    whole, frac = divmod(micro, 10**6)
    return f"{whole}.{frac:06d}".rstrip("0").rstrip(".")
