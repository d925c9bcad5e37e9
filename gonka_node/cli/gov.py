"""`gonka-node gov …`: governance actions. Each one is sent directly when the signer holds the
governance role (an EOA on a devnet), or with `--propose "why"` becomes a Governor proposal that GNK
holders vote on (`gov deposit`, `gov vote`) and anyone executes after the vote (`gov execute`).

Planning an epoch needs no Python: `gov build-spec` turns a recipe and the terms into a spec TOML with
every hash filled in, `gov check-spec` validates one against the recipe, `gov create-epoch --fund GNK
--propose …` schedules and funds it in one proposal, paid from the Governor's treasury, which `gov
treasury-deposit` fills. `gov proposals` shows what each proposal does and when its vote ends.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.chain import add_connection_args, chain_errors, open_client, parse_amount
from gonka_node.cli.fmt import amount, when
from gonka_node.cli.verbs import add_group, add_verb
from gonka_node.core.recipe import ASSIGNMENT_SEEDS

VOTE_NEXT = "gonka-node gov vote --proposal N --support yes (voters), then gonka-node gov proposals"


def register(subparsers: argparse._SubParsersAction) -> None:
    actions = add_group(subparsers, "gov", help="plan, schedule and fund epochs; slash; propose, vote, execute")
    _register_planning(actions)
    _register_actions(actions)
    _register_voting(actions)


def _register_planning(actions: Any) -> None:
    build = add_verb(
        actions, "build-spec", help="write an epoch spec TOML from a recipe, every hash filled in",
        examples=["gonka-node gov build-spec --recipe recipe.toml --aggregator 0xAGG --reward-per-round 100 "
                  "--replay-probability 0.5 --out epoch.toml"],
        next="gonka-node gov check-spec --spec epoch.toml --recipe recipe.json, then gonka-node gov "
        "create-epoch --spec epoch.toml --fund GNK --propose \"why\"",
        description="Complete the recipe (its data manifest, from the corpus on this machine), compute the "
        "hashes the chain records (model spec, data manifest, initial checkpoint) and write the epoch spec "
        "TOML with the terms given here, plus the completed recipe (JSON) that hosts and aggregators load. "
        "min_stake defaults to the least the stake rule allows (reward per round / replay probability). A "
        "recipe that names no assignment_seed gets \"signin-block\" (docs/DATA.md).",
    )
    build.add_argument("--recipe", type=Path, required=True, help="recipe file (TOML or JSON; gonka-node init epoch)")
    build.add_argument("--aggregator", action="append", required=True, metavar="ADDRESS",
                       help="an aggregator's EVM address (repeat for several)")
    build.add_argument("--aggregator-quorum", type=int, default=1, help="aggregator votes that finalize a round")
    build.add_argument("--reward-per-round", default="0", metavar="GNK", help="GNK a round pays (default 0)")
    build.add_argument("--replay-probability", type=float, default=1.0, metavar="P",
                       help="chance each host's round is recomputed (default 1; > 0 to pay rewards)")
    build.add_argument("--min-stake", metavar="GNK", help="stake per host (default: reward per round / P)")
    build.add_argument("--round-length", type=int, default=600, metavar="S", help="seconds per round (600)")
    build.add_argument("--signin-window", type=int, default=3600, metavar="S",
                       help="seconds after creation hosts may sign in (3600)")
    build.add_argument("--max-hosts", type=int, default=16, help="host slots (default 16)")
    build.add_argument("--challenge-window", type=int, default=3600, metavar="S",
                       help="seconds stake stays locked after the epoch, open to challenges (3600)")
    build.add_argument("--challenge-bond", default="1", metavar="GNK", help="GNK a challenger escrows (1)")
    build.add_argument("--model-uri", help="where the recipe can be read (default: file:<recipe out name>)")
    build.add_argument("--out", type=Path, default=Path("epoch.toml"), help="spec file (default epoch.toml)")
    build.add_argument("--recipe-out", type=Path,
                       help="the completed recipe, JSON (default: recipe.json next to --out)")
    build.add_argument("--cache-dir", type=Path, help="token cache for the corpus (default: none)")
    build.add_argument("--assignment-seed", choices=ASSIGNMENT_SEEDS,
                       help="override the recipe's assignment_seed (default: the recipe file's; signin-block, so no "
                       "host knows its data before sign-in closes, when the file names none)")
    build.add_argument("--force", action="store_true", help="replace existing output files")
    build.set_defaults(func=chain_errors(_build_spec))

    check = add_verb(
        actions, "check-spec", help="validate an epoch spec TOML (and, with --recipe, its hashes)",
        examples=["gonka-node gov check-spec --spec epoch.toml --recipe recipe.json"],
        next="gonka-node gov create-epoch --spec epoch.toml --fund GNK --propose \"why\"",
    )
    check.add_argument("--spec", type=Path, required=True, help="epoch spec TOML file")
    check.add_argument("--recipe", type=Path, help="recompute the hashes from this recipe and compare")
    check.add_argument("--cache-dir", type=Path, help="token cache for the corpus (default: none)")
    check.set_defaults(func=chain_errors(_check_spec))


def _register_actions(actions: Any) -> None:
    create = _action(
        actions, "create-epoch", "schedule a training epoch from a spec TOML (optionally funded)", _create_epoch,
        examples=["gonka-node gov create-epoch --spec epoch.toml --fund 300 --propose \"epoch 1: tiny llama\"",
                  "gonka-node gov create-epoch --spec epoch.toml --dev-account 0   # EOA governance (devnet)"],
    )
    create.add_argument("--spec", type=Path, required=True, help="epoch spec TOML file (gonka-node gov build-spec)")
    create.add_argument("--fund", metavar="GNK", help="also move this much into the new epoch's pool "
                        "(from the treasury in a proposal)")

    fund = _action(actions, "fund", "move GNK into an epoch's reward pool", _fund,
                   examples=["gonka-node gov fund --epoch 1 --amount 300 --propose \"fund epoch 1\""])
    fund.add_argument("--epoch", type=int, required=True, help="epoch number")
    fund.add_argument("--amount", required=True, metavar="GNK", help="GNK to move into the pool")

    slash = _action(actions, "slash", "slash a host's stake (goes back to the reward pool)", _slash,
                    examples=["gonka-node gov slash --epoch 1 --host 0xHOST --amount 10 --evidence SHA256 "
                              "--propose \"copied payloads\""])
    slash.add_argument("--epoch", type=int, required=True, help="epoch number")
    slash.add_argument("--host", required=True, help="host EVM address")
    slash.add_argument("--amount", required=True, metavar="GNK", help="GNK to slash")
    slash.add_argument("--evidence", required=True, help="sha256 (hex) of the evidence")

    treasury = add_verb(
        actions, "treasury-deposit", help="move GNK into the Governor's treasury, which proposals spend",
        amounts=True, examples=["gonka-node gov treasury-deposit --amount 300 --key-file treasurer.key"],
        next="gonka-node gov create-epoch --spec epoch.toml --fund 300 --propose \"why\"",
    )
    add_connection_args(treasury)
    treasury.add_argument("--amount", required=True, metavar="GNK", help="GNK to give to the treasury")
    treasury.set_defaults(func=chain_errors(_treasury_deposit))


def _register_voting(actions: Any) -> None:
    deposit = add_verb(
        actions, "deposit", help="escrow GNK in the Governor to vote with", amounts=True,
        examples=["gonka-node gov deposit --amount 100000"], next=VOTE_NEXT,
    )
    add_connection_args(deposit)
    deposit.add_argument("--amount", required=True, metavar="GNK", help="GNK to escrow")
    deposit.set_defaults(func=chain_errors(_deposit))

    withdraw = add_verb(
        actions, "withdraw", help="take escrowed GNK back (once the votes it cast are over)", amounts=True,
        examples=["gonka-node gov withdraw --amount 100000"], next="gonka-node keys show … to see the balance",
    )
    add_connection_args(withdraw)
    withdraw.add_argument("--amount", required=True, metavar="GNK", help="GNK to take back")
    withdraw.set_defaults(func=chain_errors(_withdraw))

    proposals = add_verb(
        actions, "proposals", help="list proposals: what they do, votes, state, when voting ends",
        amounts=True, examples=["gonka-node gov proposals", "gonka-node gov proposals --open"],
        next="gonka-node gov vote --proposal N --support yes, or gonka-node gov execute --proposal N",
    )
    add_connection_args(proposals, need_key=False)
    proposals.add_argument("--open", action="store_true", help="only proposals still voting or passed")
    proposals.set_defaults(func=chain_errors(_proposals))

    vote = add_verb(
        actions, "vote", help="vote on a proposal with the escrowed GNK", amounts=True,
        examples=["gonka-node gov vote --proposal 1 --support yes"],
        next="gonka-node gov execute --proposal N once voting ends (gonka-node gov proposals says when)",
    )
    add_connection_args(vote)
    vote.add_argument("--proposal", type=int, required=True, help="proposal id (gonka-node gov proposals)")
    vote.add_argument("--support", choices=("yes", "no"), required=True, help="yes or no")
    vote.set_defaults(func=chain_errors(_vote))

    execute = add_verb(
        actions, "execute", help="execute a passed proposal (anyone may)", amounts=True,
        examples=["gonka-node gov execute --proposal 1"],
        next="gonka-node chain status (a created epoch), then hosts sign in: gonka-node run --config host.toml",
    )
    add_connection_args(execute)
    execute.add_argument("--proposal", type=int, required=True, help="proposal id (gonka-node gov proposals)")
    execute.set_defaults(func=chain_errors(_execute))


def _action(actions: Any, name: str, help_text: str, func: Any, examples: list[str]) -> argparse.ArgumentParser:
    parser = add_verb(actions, name, help=help_text, examples=examples, amounts=True,
                      next=f"with --propose: {VOTE_NEXT}")
    add_connection_args(parser)
    parser.add_argument("--propose", metavar="DESCRIPTION", help="make it a Governor proposal instead")
    parser.set_defaults(func=chain_errors(func))
    return parser


def _proposed(pid: int, client: Any) -> None:
    end = client.proposal(pid).vote_end
    print(f"proposal {pid} created; voting ends {when(end, client.chain_time())}")
    print(f"next: gonka-node gov vote --proposal {pid} --support yes")


def _propose_or_send(args: argparse.Namespace, client: Any, actions: list[Any], send: Any) -> None:
    if args.propose:
        _proposed(client.propose(actions, args.propose), client)
    else:
        send()


# ---------------------------------------------------------------------------------------------- planning


def _build_spec(args: argparse.Namespace) -> int:
    from chain.spec_file import format_epoch_spec
    from gonka_node.spec_builder import build_spec, load_epoch_recipe

    recipe_out = args.recipe_out or args.out.with_name("recipe.json")
    _refuse_overwrite(args.out, args.force)
    built = build_spec(load_epoch_recipe(args.recipe, args.assignment_seed), _terms(args), args.model_uri or f"file:{recipe_out.name}",
                       args.cache_dir)
    _write_recipe(recipe_out, built.recipe.canonical_json() + b"\n", args.force)
    header = (f"Epoch spec built by `gonka-node gov build-spec` from {args.recipe}.\n"
              f"Its recipe (completed, canonical JSON): {recipe_out}; hosts and aggregators load that file.\n"
              "Amounts are GNK; times are seconds. Check it: gonka-node gov check-spec --spec THIS --recipe RECIPE")
    args.out.write_text(format_epoch_spec(built.spec, _SPEC_COMMENTS, header), encoding="utf-8")
    s = built.spec
    print(f"wrote {args.out} and {recipe_out}: model_spec_hash {s.model_spec_hash.hex()}, init_checkpoint_hash "
          f"{s.init_checkpoint_hash.hex()}, {s.n_rounds} rounds × {amount(s.reward_per_round)} (pool needed: "
          f"{amount(s.n_rounds * s.reward_per_round)}), stake >= {amount(s.min_stake)}")
    print(f"next: gonka-node gov create-epoch --spec {args.out} --fund {_gnk(s.n_rounds * s.reward_per_round)} "
          "--propose \"why\"")
    return 0


def _terms(args: argparse.Namespace) -> Any:
    """The epoch's terms from build-spec's flags; min_stake by default the least the stake rule allows."""
    from gonka_node.epoch_setup import EpochTerms

    reward = parse_amount("--reward-per-round", args.reward_per_round)
    p = args.replay_probability
    if not 0.0 <= p <= 1.0:
        raise CliError(f"--replay-probability {p}: must be in [0, 1]")
    common = dict(
        aggregators=args.aggregator, round_length_s=args.round_length, signin_window_s=args.signin_window,
        max_hosts=args.max_hosts, aggregator_quorum=args.aggregator_quorum, challenge_window_s=args.challenge_window,
        challenge_bond=parse_amount("--challenge-bond", args.challenge_bond),
    )
    if args.min_stake is None:
        return EpochTerms.staked_for(reward, p, **common)
    return EpochTerms(min_stake=parse_amount("--min-stake", args.min_stake), reward_per_round=reward,
                      replay_probability=p, **common)


_SPEC_COMMENTS = {
    "model_spec_hash": "sha256 of the recipe's canonical JSON",
    "data_manifest_hash": "the corpus: tokenizer, then each file's sha256, size and path",
    "init_checkpoint_hash": "canonical sha256 of the round-0 model built from the recipe",
    "inner_steps": "H: AdamW steps per round (from the recipe, as are the next four)",
    "n_rounds": "outer rounds",
    "round_length": "seconds an aggregator keeps a round open",
    "signin_window": "seconds after creation hosts may sign in",
    "min_stake_gnk": "each host escrows at least this; min_stake x replay_probability >= reward_per_round",
    "aggregators": "EVM accounts that finalize rounds",
    "reward_per_round_gnk": "paid per round in equal shares to the hosts that pass the checks",
    "replay_probability": "chance a host's round is recomputed by the aggregator",
    "challenge_window": "seconds after the epoch the stake stays locked and open to challenges",
    "challenge_bond_gnk": "what a challenger escrows",
}


def _gnk(ngonka: int) -> str:
    from chain.units import gnk_decimal

    return gnk_decimal(ngonka)


def _refuse_overwrite(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise CliError(f"{path} exists; pass --force to replace it")


def _write_recipe(path: Path, content: bytes, force: bool) -> None:
    if path.exists() and path.read_bytes() != content:
        _refuse_overwrite(path, force)
    path.write_bytes(content)


def _check_spec(args: argparse.Namespace) -> int:
    from chain.spec_file import load_epoch_spec
    from gonka_node.spec_builder import check_spec, load_epoch_recipe

    spec = load_epoch_spec(args.spec)  # SpecError: names the file and field
    recipe = load_epoch_recipe(args.recipe) if args.recipe is not None else None
    problems = check_spec(spec, recipe, args.cache_dir)
    if problems:
        raise CliError("\n".join(f"{args.spec}: {p}" for p in problems))
    against = f" and matches {args.recipe} (model, data manifest, initial checkpoint, hyperparameters)" if recipe else ""
    print(f"{args.spec}: a valid epoch spec{against}: {spec.n_rounds} rounds, {amount(spec.reward_per_round)} per "
          f"round, replay probability {spec.replay_probability:g}, stake >= {amount(spec.min_stake)}, "
          f"{len(spec.aggregators)} aggregator(s)")
    return 0


# ---------------------------------------------------------------------------------------------- actions


def _create_epoch(args: argparse.Namespace) -> int:
    from chain.spec_file import load_epoch_spec

    spec = load_epoch_spec(args.spec)
    fund = parse_amount("--fund", args.fund) if args.fund is not None else 0
    client = open_client(args)
    epoch = client.epoch_count() + 1
    if args.propose:
        funding = client.action_fund_epoch(epoch, fund) if fund else []
        if fund and client.treasury() < fund:
            print(f"note: the Governor's treasury holds {amount(client.treasury(), args)}; deposit "
                  f"{amount(fund - client.treasury(), args)} with `gonka-node gov treasury-deposit` before "
                  "executing")
        print(f"proposing: create epoch {epoch}" + (f" and fund it with {amount(fund, args)}" if fund else ""))
        _proposed(client.propose([client.action_create_epoch(spec), *funding], args.propose), client)
        return 0
    created = client.create_epoch(spec)
    if fund:
        client.fund_epoch(created, fund)
    print(f"epoch {created} created" + (f", pool {amount(client.get_epoch(created).pool, args)}" if fund else ""))
    return 0


def _fund(args: argparse.Namespace) -> int:
    value = parse_amount("--amount", args.amount)
    client = open_client(args)
    _propose_or_send(args, client, client.action_fund_epoch(args.epoch, value),
                     lambda: client.fund_epoch(args.epoch, value))
    if not args.propose:
        print(f"epoch {args.epoch} pool: {amount(client.get_epoch(args.epoch).pool, args)}")
    return 0


def _slash(args: argparse.Namespace) -> int:
    value = parse_amount("--amount", args.amount)
    try:
        evidence = bytes.fromhex(args.evidence.removeprefix("0x"))
    except ValueError:
        raise CliError(f"--evidence: not hex: {args.evidence!r}") from None
    if len(evidence) != 32:
        raise CliError("--evidence: must be a 32-byte sha256 (64 hex digits)")
    client = open_client(args)
    _propose_or_send(args, client, [client.action_slash(args.epoch, args.host, value, evidence)],
                     lambda: client.slash(args.epoch, args.host, value, evidence))
    if not args.propose:
        print(f"slashed {amount(value, args)} from {args.host} in epoch {args.epoch}")
    return 0


def _treasury_deposit(args: argparse.Namespace) -> int:
    value = parse_amount("--amount", args.amount)
    client = open_client(args)
    if client.deployment.governance.lower() != client.deployment.governor.lower():
        print("note: this deployment's governance is an account, not the Governor: proposals are not needed")
    client.transfer(client.governor.address, value)
    print(f"treasury now holds {amount(client.treasury(), args)}")
    return 0


# ---------------------------------------------------------------------------------------------- voting


def _deposit(args: argparse.Namespace) -> int:
    client = open_client(args)
    client.gov_deposit(parse_amount("--amount", args.amount))
    print(f"escrowed; voting weight now {amount(client.escrow(), args)}")
    return 0


def _withdraw(args: argparse.Namespace) -> int:
    client = open_client(args)
    value = parse_amount("--amount", args.amount)
    locked = int(client.read(client.governor, "locked_until", client.address))
    now = client.chain_time()
    if locked > now:
        raise CliError(f"the escrow voted on a proposal whose vote ends {when(locked, now)}; withdraw after that")
    client.gov_withdraw(value)
    print(f"withdrew {amount(value, args)}; escrow now {amount(client.escrow(), args)}")
    return 0


def _proposals(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gonka_node.governance import created_epoch_ids, decode, summary

    client = open_client(args)
    now = client.chain_time()
    table = Table(title=f"proposals (treasury {amount(client.treasury(), args)}; chain time {when(now, now)})")
    for column in ("id", "state", "for / against (quorum)", "voting ends", "description", "actions"):
        table.add_column(column)
    for pid in range(client.proposal_count(), 0, -1):
        p = client.proposal(pid)
        if args.open and p.state not in ("voting", "passed"):
            continue
        calls = [decode(client, a) for a in client.proposal_actions(pid)]
        lines = summary(calls, created_epoch_ids(client, calls) if not p.executed else [], lambda v: amount(v, args))
        table.add_row(str(pid), p.state, f"{amount(p.for_votes, args)} / {amount(p.against_votes, args)} "
                      f"({amount(p.quorum, args)})", when(p.vote_end, now), client.proposal_description(pid),
                      "\n".join(lines))
    Console(width=200).print(table)
    return 0


def _vote(args: argparse.Namespace) -> int:
    client = open_client(args)
    client.vote(args.proposal, args.support == "yes")
    p = client.proposal(args.proposal)
    print(f"proposal {p.proposal_id}: for {amount(p.for_votes, args)}, against {amount(p.against_votes, args)}, "
          f"quorum {amount(p.quorum, args)} ({p.state}); voting ends {when(p.vote_end, client.chain_time())}")
    return 0


def _execute(args: argparse.Namespace) -> int:
    from gonka_node.governance import decode, execution_problems

    client = open_client(args)
    now = client.chain_time()
    proposal = client.proposal(args.proposal)
    actions = client.proposal_actions(args.proposal) if proposal.state != "unknown" else []
    calls = [decode(client, a) for a in actions]
    problems = execution_problems(client, proposal, calls, lambda t: when(t, now), lambda v: amount(v, args))
    if problems:
        raise CliError("\n".join(problems))
    receipt = client.execute(args.proposal, actions)
    created = client.epochs_created(receipt)
    print(f"proposal {args.proposal} executed" + (f"; epoch(s) {', '.join(map(str, created))} created" if created else ""))
    return 0
