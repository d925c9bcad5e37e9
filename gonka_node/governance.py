"""What a Governor proposal does, read back from the chain, and whether executing it now would work.

A proposal keeps only the hash of its actions on chain; the actions themselves are in its
ProposalCreated event. `decode` turns each back into a named call of the GNK, Registry or Governor
contract, `summary` into a line a voter can read, and `execution_problems` says, before a transaction is
spent, why `execute` would revert: voting not over, no quorum, defeated, a treasury that cannot pay what
the actions spend (the Governor refuses to touch its voters' escrow), or a proposal that funds the epoch
it creates by number when another epoch was created since it was proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chain.client import ChainClient
from chain.types import Action, EpochSpec, Proposal


@dataclass(frozen=True)
class Call:
    """One decoded action: which contract, which function, its arguments by name."""

    contract: str  # GNK | Registry | Governor | an address we do not know
    function: str
    args: dict[str, Any]


def decode(client: ChainClient, action: Action) -> Call:
    by_address = {c.address.lower(): (name, c) for name, c in
                  (("GNK", client.gnk), ("Registry", client.registry), ("Governor", client.governor))}
    known = by_address.get(action.target.lower())
    if known is None:
        return Call(action.target, f"0x{action.calldata[:4].hex()}", {})
    name, contract = known
    try:
        fn, args = contract.decode_function_input(action.calldata)
    except ValueError:  # calldata that matches no function of that contract: execute would revert
        return Call(name, f"unknown function 0x{action.calldata[:4].hex()}", {})
    return Call(name, fn.fn_name, dict(args))


def created_epoch_ids(client: ChainClient, calls: Sequence[Call]) -> list[int]:
    """The ids the proposal's create_epoch calls would get if it were executed now."""
    n = sum(1 for c in calls if (c.contract, c.function) == ("Registry", "create_epoch"))
    first = client.epoch_count() + 1
    return list(range(first, first + n))


def treasury_spend(calls: Sequence[Call]) -> int:
    """GNK (ngonka) the actions take out of the Governor: fundings and transfers."""
    spending = {("Registry", "fund_epoch"), ("GNK", "transfer")}
    return sum(int(c.args["amount"]) for c in calls if (c.contract, c.function) in spending)


def summary(calls: Sequence[Call], created: Sequence[int], show: Callable[[int], str]) -> list[str]:
    """One line per action, amounts through `show` (GNK or ngonka)."""
    lines, new = [], iter(created)
    for c in calls:
        key = (c.contract, c.function)
        if key == ("Registry", "create_epoch"):
            raw = c.args["spec"]  # web3 decodes a struct as a dict in field order
            spec = EpochSpec.from_abi(tuple(raw.values()) if isinstance(raw, dict) else tuple(raw))
            lines.append(f"create epoch {next(new, '?')}: {spec.n_rounds} rounds, {show(spec.reward_per_round)} "
                         f"per round, replay probability {spec.replay_probability:g}, stake >= "
                         f"{show(spec.min_stake)}, model {spec.model_spec_hash.hex()[:16]}…")
        elif key == ("Registry", "fund_epoch"):
            lines.append(f"fund epoch {c.args['epoch']} with {show(int(c.args['amount']))} from the treasury")
        elif key == ("GNK", "approve"):
            lines.append(f"let {c.args['spender']} spend {show(int(c.args['amount']))} of the treasury")
        elif key == ("Registry", "slash"):
            lines.append(f"slash {show(int(c.args['amount']))} of {c.args['host']} in epoch {c.args['epoch']}")
        elif key == ("GNK", "mint"):
            lines.append(f"mint {show(int(c.args['amount']))} to {c.args['receiver']}")
        else:
            lines.append(f"{c.contract}.{c.function}({', '.join(f'{k}={v}' for k, v in c.args.items())})")
    return lines


def execution_problems(client: ChainClient, proposal: Proposal, calls: Sequence[Call],
                       when: Callable[[int], str], show: Callable[[int], str]) -> list[str]:
    """Why `execute` would revert now, one line each with the fix; [] if it would go through."""
    pid = proposal.proposal_id
    by_state = {
        "voting": f"proposal {pid}: voting is open until {when(proposal.vote_end)}; execute it after that",
        "no-quorum": f"proposal {pid}: {show(proposal.for_votes + proposal.against_votes)} voted, below the "
        f"quorum of {show(proposal.quorum)}; it cannot pass: propose again",
        "defeated": f"proposal {pid} was defeated ({show(proposal.for_votes)} for, {show(proposal.against_votes)} "
        "against)",
        "executed": f"proposal {pid} was already executed",
        "unknown": f"no proposal {pid} on this Governor",
    }
    if proposal.state in by_state:
        return [by_state[proposal.state]]
    problems = []
    spend, treasury = treasury_spend(calls), client.treasury()
    if spend > treasury:
        problems.append(
            f"proposal {pid} spends {show(spend)} but the Governor's treasury holds {show(treasury)}: deposit "
            f"{show(spend - treasury)} with `gonka-node gov treasury-deposit --amount …`, then execute"
        )
    # A proposal that creates an epoch names the one it funds by the number it expected the new epoch to
    # get; if another epoch was created since, that number is someone else's epoch (or none yet).
    created = created_epoch_ids(client, calls)
    for c in calls:
        if created and (c.contract, c.function) == ("Registry", "fund_epoch"):
            epoch = int(c.args["epoch"])
            if epoch not in created:
                problems.append(
                    f"proposal {pid} funds epoch {epoch}, but executed now it would create epoch(s) "
                    f"{', '.join(map(str, created))}: another epoch was created since it was proposed; propose "
                    "again"
                )
    return problems
