"""`gonka-node challenge file|list|vote|resolve`: anyone may put slashing evidence on chain with a bond.

`file` reads an evidence record (`<sha256>.json`, as an aggregator writes it in `evidence/`), checks it
before any bond is put at risk — it parses, its host's signature verifies under the node key that host
registered on chain for the epoch, and a kept payload hashes to the signed digest — and files a challenge
naming the record's sha256. The stake is then frozen until the challenge is resolved: by the epoch's
aggregators (`vote`, `aggregator_quorum` votes either way) or by governance (`resolve`, directly or as a
Governor proposal). Upheld, the host's whole remaining stake is slashed and the challenger gets its bond
back with half of it; rejected, the bond goes to the host (docs/PROTOCOL.md "Challenges").

A `replay_mismatch` record's claim (the host's round does not reproduce) is checked by re-running the
round (`training.worker.replay_round`); `file` checks only its signature, and says so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gonka_node.cli import CliError
from gonka_node.cli.chain import add_connection_args, chain_errors, open_client
from gonka_node.cli.fmt import amount
from gonka_node.cli.verbs import add_group, add_verb

MAX_EVIDENCE_BYTES = 1 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    actions = add_group(
        subparsers, "challenge", help="challenge a host's stake with evidence and a bond; list, vote on, resolve challenges"
    )
    file = add_verb(
        actions, "file", help="file a challenge from an evidence record (the epoch's challenge bond is escrowed)",
        amounts=True,
        examples=["gonka-node challenge file --evidence aggregator/evidence/<sha256>.json "
                  "--uri https://example.org/evidence/<sha256>.json"],
        next="gonka-node challenge list --epoch E",
    )
    add_connection_args(file)
    file.add_argument("--evidence", type=Path, required=True, help="evidence record (<sha256>.json)")
    file.add_argument("--uri", default="", help="where voters can fetch the record (stored in the event)")
    file.add_argument("--recipe", type=Path,
                      help="the epoch's recipe (JSON or TOML): needed for a top-k replay mismatch claimed on an opening "
                           "that does not answer its challenge, which is checked against the chain's seed and the "
                           "recipe's residual layout and sample")
    file.set_defaults(func=chain_errors(_file))

    listing = add_verb(
        actions, "list", help="the challenges filed in an epoch, with their state", amounts=True,
        examples=["gonka-node challenge list --epoch 1"],
        next="gonka-node challenge vote --id N --uphold (an aggregator) or gonka-node challenge resolve (governance)",
    )
    add_connection_args(listing, need_key=False)
    listing.add_argument("--epoch", type=int, required=True, help="epoch number")
    listing.set_defaults(func=chain_errors(_list))

    for name, who in (("vote", "an aggregator of the challenge's epoch"), ("resolve", "governance")):
        p = add_verb(
            actions, name, help=f"uphold or reject a challenge, as {who}",
            examples=[f"gonka-node challenge {name} --id 1 --uphold" + (" --propose \"copied payloads\""
                                                                       if name == "resolve" else "")],
            next="gonka-node challenge list --epoch E",
        )
        add_connection_args(p)
        p.add_argument("--id", type=int, required=True, help="challenge id (from `file` or `list`)")
        ruling = p.add_mutually_exclusive_group(required=True)
        ruling.add_argument("--uphold", action="store_true", help="slash the host's remaining stake")
        ruling.add_argument("--reject", action="store_true", help="the bond goes to the host")
        if name == "resolve":
            p.add_argument("--propose", metavar="DESCRIPTION", help="make it a Governor proposal instead")
        p.set_defaults(func=chain_errors(_vote if name == "vote" else _resolve))


def load_evidence(path: Path) -> Any:
    """The record at `path` as a `gonka_node.slashing.Evidence`; a one-line error if it is not one."""
    from gonka_node.slashing import Evidence

    try:
        if path.stat().st_size > MAX_EVIDENCE_BYTES:
            raise CliError(f"--evidence {path}: larger than an evidence record can be")
        data = json.loads(path.read_text())
        return Evidence(**data)
    except FileNotFoundError:
        raise CliError(f"--evidence {path}: no such file") from None
    except (ValueError, TypeError) as exc:
        raise CliError(f"--evidence {path}: not an evidence record ({exc})") from None


def _file(args: argparse.Namespace) -> int:
    from gonka_node.slashing import SLASHABLE, verify_evidence

    ev = load_evidence(args.evidence)
    if ev.kind not in SLASHABLE:
        raise CliError(f"--evidence: kind {ev.kind!r} is not slashable (slashable: {', '.join(SLASHABLE)})")
    client = open_client(args)
    host = client.host_info(ev.epoch, ev.host)
    if not host.joined:
        raise CliError(f"--evidence: {ev.host} is not a host of epoch {ev.epoch}")
    try:
        valid = verify_evidence(ev, bytes(host.node_key), args.evidence.parent, _challenge_terms(args, client, ev))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"--evidence: cannot check the record ({exc})") from None
    if not valid:
        raise CliError(
            f"--evidence: the record is not signed by the node key {ev.host} registered for epoch {ev.epoch} "
            "(or its kept payload does not hash to the signed digest): filing it would forfeit your bond"
        )
    bond = client.get_epoch(ev.epoch).spec.challenge_bond
    challenge_id = client.challenge(ev.epoch, ev.host, ev.hash, args.uri)
    print(f"challenge {challenge_id}: {ev.host}'s stake in epoch {ev.epoch} frozen on {ev.kind} evidence "
          f"{ev.hash.hex()} ({amount(bond, args)} bond escrowed)")
    if ev.kind == "replay_mismatch":
        claim = (ev.other or {}).get("claim")
        if claim == "unverified":
            print("checked: the host's signature and opening, which does not answer the challenge drawn from the "
                  "chain's seed and the recipe")
        elif claim == "judged":
            print("checked: the host's signature and opening; the mismatch itself is checked by re-running the "
                  "payload check on the host's payloads and the host's round")
        else:
            print("checked: the host's signature; the mismatch itself is checked by re-running the host's round")
    print(f"next: the epoch's aggregators vote (`gonka-node challenge vote --id {challenge_id} --uphold`) "
          "or governance resolves it")
    return 0


def _challenge_terms(args: argparse.Namespace, client: Any, ev: Any) -> Any:
    """The challenge a top-k opening claimed not to answer was drawn from, as this verifier knows it:
    the chain's round seed, the recipe's residual layout and sample (None: no such claim in `ev`)."""
    from gonka_node.core.recipe import Recipe, RecipeError
    from gonka_node.slashing import ChallengeTerms
    from training.codecs import get_codec
    from training.model import build_model
    from training.residual_commit import commitment_layout

    other = ev.other or {}
    if "opening" not in other or other.get("claim") == "judged":
        return None
    if args.recipe is None:
        raise CliError("--evidence: a top-k opening claimed not to answer its challenge is checked against the "
                       "epoch's recipe: give --recipe FILE (the recipe.json the epoch was built from)")
    try:
        recipe = Recipe.load(args.recipe)
        spec = client.get_epoch(ev.epoch).spec
        recipe.check_against_chain(spec)
    except RecipeError as exc:
        raise CliError(f"--recipe: {exc}") from None
    model = build_model(recipe.model, recipe.init_seed)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    seed = client.round_seed(ev.epoch, ev.round).seed
    return ChallengeTerms(seed, commitment_layout(shapes, get_codec(spec.codec)), recipe.residual_sample,
                          recipe.residual_sample_min)


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    client = open_client(args)
    table = Table(title=f"challenges of epoch {args.epoch}")
    for column in ("id", "host", "status", "uphold/reject", "bond", "slashed", "evidence sha256", "uri"):
        table.add_column(column, no_wrap=column in ("host", "evidence sha256"))
    for c in client.challenges(args.epoch):
        table.add_row(str(c.challenge_id), c.host, c.status, f"{c.uphold_votes}/{c.reject_votes}",
                      amount(c.bond, args), amount(c.slashed, args), c.evidence_hash.hex(), c.evidence_uri)
    Console(width=200).print(table)
    return 0


def _vote(args: argparse.Namespace) -> int:
    client = open_client(args)
    client.vote_challenge(args.id, bool(args.uphold))
    c = client.get_challenge(args.id)
    print(f"challenge {c.challenge_id}: {c.uphold_votes} to uphold, {c.reject_votes} to reject ({c.status})")
    return 0


def _resolve(args: argparse.Namespace) -> int:
    client = open_client(args)
    if args.propose:
        pid = client.propose([client.action_resolve_challenge(args.id, bool(args.uphold))], args.propose)
        print(f"proposal {pid} created; vote with `gonka-node gov vote --proposal {pid} --support yes`")
        return 0
    client.resolve_challenge(args.id, bool(args.uphold))
    print(f"challenge {args.id}: {client.get_challenge(args.id).status}")
    return 0
