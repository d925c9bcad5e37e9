"""Read models: what each page and API route shows, derived from the index (events, specs, reports).

Plain dicts of JSON types, so the API returns them as they are and the HTML pages render them. Token
amounts are decimal strings of ngonka (JSON numbers lose precision past 2**53); times are the chain's
block timestamps (Unix seconds). Nothing here writes.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gonka_node.core.recipe import Recipe, RecipeError
from gonka_node.explorer.db import EventRow, ReportRow, read_cursor, read_events, read_reports, read_spec

ALLREDUCE_BYTES_PER_PARAM = 4  # fp32 gradients all-reduced at every inner step: the baseline DiLoCo avoids
REPLAY = re.compile(r"cosine ([+-]?[0-9.]+), norm ratio ([0-9.]+|inf)")
VERDICTS = ("copy", "mix", "dissent", "replay mismatch", "departed", "resubmission")


@dataclass(frozen=True)
class Site:
    """What the pages say about where they come from (the chain, and how to pull a checkpoint)."""

    chain_id: int
    registry: str
    governor: str
    rpc_url: str
    deployment_file: str
    downloads: bool  # the explorer streams checkpoints from an aggregator


def _ngonka(value: int) -> str:
    return str(int(value))


def _events(db: sqlite3.Connection, name: str, epoch: int | None = None, round_: int | None = None) -> list[EventRow]:
    where = "name=?"
    args: list[str | int] = [name]
    if epoch is not None:
        where, args = where + " AND epoch=?", [*args, epoch]
    if round_ is not None:
        where, args = where + " AND round=?", [*args, round_]
    return read_events(db, where, args)


def chain_time(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT time FROM blocks ORDER BY number DESC LIMIT 1").fetchone()
    return int(row[0]) if row else 0


def status(db: sqlite3.Connection, site: Site) -> dict[str, Any]:
    cursor = read_cursor(db)
    return {
        "chain_id": site.chain_id, "registry": site.registry, "governor": site.governor,
        "block": cursor.block if cursor else None, "block_hash": "0x" + cursor.hash.hex() if cursor else None,
        "time": chain_time(db), "version": cursor.version if cursor else 0,
    }


# ---------------------------------------------------------------------------------------- recipes


def recipe_of(db: sqlite3.Connection, epoch: int, model_spec_hash: str) -> dict[str, Any] | None:
    """The epoch's published recipe whose sha256 is the model_spec_hash on chain, summarized."""
    for e in _events(db, "RecipePublished", epoch):
        raw = bytes.fromhex(e.args["recipe_json"][2:])
        if "0x" + hashlib.sha256(raw).hexdigest() != model_spec_hash:
            continue
        try:
            recipe = Recipe.from_dict(json.loads(raw), where=f"epoch {epoch}'s recipe")
        except (RecipeError, json.JSONDecodeError, UnicodeDecodeError):
            return {"valid": False}
        return {
            "valid": True, "params": recipe.model.num_params(), "model": recipe.model.to_dict(),
            "codec": recipe.codec, "inner_steps": recipe.inner_steps, "n_rounds": recipe.n_rounds,
            "seq_len": recipe.seq_len, "micro_batch": recipe.micro_batch, "grad_accum": recipe.grad_accum,
            "inner_lr": recipe.inner_lr, "outer_lr": recipe.outer_lr, "outer_momentum": recipe.outer_momentum,
            "round_state": recipe.round_state, "corpus": recipe.corpus,
            "data_manifest_sha256": recipe.data_manifest_sha256,
        }
    return None


# ---------------------------------------------------------------------------------------- network


def epoch_summary(db: sqlite3.Connection, created: EventRow, now: int) -> dict[str, Any]:
    epoch = int(created.args["epoch"])
    spec = read_spec(db, epoch) or {}
    n_rounds = int(created.args["n_rounds"])
    finalized = [int(e.args["round"]) for e in _events(db, "RoundFinalized", epoch)]
    latest = max(finalized, default=0)
    signin_end = int(created.args["signin_end"])
    round_length = int(spec.get("round_length", 0))
    return {
        "epoch": epoch,
        "created_at": created.time,
        "signin_end": signin_end,
        "deadline": signin_end + n_rounds * round_length,
        "round_length": round_length,
        "n_rounds": n_rounds,
        "latest_round": latest,
        "state": _epoch_state(now, signin_end, n_rounds, latest, signin_end + n_rounds * round_length),
        "hosts": len(_events(db, "HostJoined", epoch)),
        "funded": _ngonka(sum(int(e.args["amount"]) for e in _events(db, "EpochFunded", epoch))),
        "paid": _ngonka(sum(int(e.args["total_reward"]) for e in _events(db, "RoundFinalized", epoch))),
        "reward_per_round": _ngonka(int(created.args["reward_per_round"])),
        "model_spec_hash": created.args["model_spec_hash"],
        "init_checkpoint_hash": created.args["init_checkpoint_hash"],
        "spec": spec,
        "recipe": recipe_of(db, epoch, created.args["model_spec_hash"]),
    }


def _epoch_state(now: int, signin_end: int, n_rounds: int, latest: int, deadline: int) -> str:
    if latest >= n_rounds:
        return "finished"
    if now < signin_end:
        return "sign-in"
    if now >= deadline:
        return "expired"
    return "training"


def proposals(db: sqlite3.Connection, now: int) -> list[dict[str, Any]]:
    votes: dict[int, list[EventRow]] = defaultdict(list)
    for v in _events(db, "VoteCast"):
        votes[int(v.args["proposal_id"])].append(v)
    executed = {int(e.args["proposal_id"]): e for e in _events(db, "ProposalExecuted")}
    out = []
    for p in _events(db, "ProposalCreated"):
        pid = int(p.args["proposal_id"])
        for_votes = sum(int(v.args["weight"]) for v in votes[pid] if v.args["support"])
        against = sum(int(v.args["weight"]) for v in votes[pid] if not v.args["support"])
        quorum, vote_end = int(p.args["quorum"]), int(p.args["vote_end"])
        out.append({
            "proposal_id": pid, "proposer": p.args["proposer"], "description": p.args["description"],
            "targets": p.args["targets"], "created_at": p.time, "vote_end": vote_end, "quorum": _ngonka(quorum),
            "for_votes": _ngonka(for_votes), "against_votes": _ngonka(against), "voters": len(votes[pid]),
            "state": _proposal_state(now, pid in executed, vote_end, for_votes, against, quorum),
            "tx": "0x" + p.tx.hex(),
        })
    return out


def _proposal_state(now: int, executed: bool, vote_end: int, for_votes: int, against: int, quorum: int) -> str:
    """Governor.state, computed from the events at the index's latest block time."""
    if executed:
        return "executed"
    if now < vote_end:
        return "voting"
    if for_votes + against < quorum:
        return "no-quorum"
    return "defeated" if for_votes <= against else "passed"


def challenges(db: sqlite3.Connection, epoch: int | None = None, host: str | None = None) -> list[dict[str, Any]]:
    resolved = {int(e.args["challenge_id"]): e for e in _events(db, "ChallengeResolved")}
    votes: dict[int, int] = defaultdict(int)
    for v in _events(db, "ChallengeVote"):
        votes[int(v.args["challenge_id"])] += 1
    out = []
    for c in _events(db, "ChallengeFiled", epoch):
        if host is not None and c.host != host:
            continue
        cid = int(c.args["challenge_id"])
        r = resolved.get(cid)
        out.append({
            "challenge_id": cid, "epoch": c.epoch, "host": c.args["host"], "challenger": c.args["challenger"],
            "bond": _ngonka(int(c.args["bond"])), "evidence_hash": c.args["evidence_hash"],
            "evidence_uri": c.args["evidence_uri"], "filed_at": c.time, "votes": votes[cid],
            "status": "open" if r is None else ("upheld" if r.args["upheld"] else "rejected"),
            "slashed": _ngonka(int(r.args["slashed"])) if r else "0",
        })
    return out


def network(db: sqlite3.Connection, site: Site) -> dict[str, Any]:
    now = chain_time(db)
    return {
        "status": status(db, site),
        "epochs": [epoch_summary(db, e, now) for e in _events(db, "EpochCreated")],
        "proposals": proposals(db, now),
        "challenges": challenges(db),
    }


# ---------------------------------------------------------------------------------------- epoch


def epoch_detail(db: sqlite3.Connection, site: Site, epoch: int) -> dict[str, Any] | None:
    created = _events(db, "EpochCreated", epoch)
    if not created:
        return None
    summary = epoch_summary(db, created[0], chain_time(db))
    reports = read_reports(db, epoch)
    rounds = [round_row(db, site, epoch, r, reports.get(r)) for r in range(1, summary["n_rounds"] + 1)]
    params = (summary["recipe"] or {}).get("params")
    inner_steps = int(summary["spec"].get("inner_steps", 0))
    done = sum(1 for r in rounds if r["state"] == "finalized")
    return {
        **summary,
        "status": status(db, site),
        "rounds": rounds,
        "loss": loss_points(reports),
        "bytes_per_host": bytes_per_host(reports),
        "allreduce_bytes_per_host": str(ALLREDUCE_BYTES_PER_PARAM * params * inner_steps * done) if params else None,
        "utilisation": None,  # hosts do not report it yet
        "hosts_detail": epoch_hosts(db, epoch, reports),
        "aggregators": aggregators(db, epoch, summary["spec"]),
        "challenges": challenges(db, epoch),
    }


def loss_points(reports: dict[int, ReportRow]) -> list[dict[str, Any]]:
    """Held-out loss by round as the aggregator reported it: round 0 is round 1's base model, round r
    the checkpoint round r made (each measured on its round's held-out windows)."""
    points = []
    first = reports.get(1)
    if first is not None and first.heldout_loss_base is not None:
        points.append({"round": 0, "loss": first.heldout_loss_base})
    for r, report in sorted(reports.items()):
        if report.heldout_loss is not None:
            points.append({"round": r, "loss": report.heldout_loss})
    return points


def bytes_per_host(reports: dict[int, ReportRow]) -> dict[str, str]:
    total: dict[str, int] = defaultdict(int)
    for report in reports.values():
        for c in report.contributions:
            total[c.host] += c.payload_length
    return {h: str(n) for h, n in sorted(total.items())}


def aggregators(db: sqlite3.Connection, epoch: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    sets = _events(db, "AggregatorsSet", epoch)
    addresses = sets[-1].args["aggregators"] if sets else spec.get("aggregators", [])
    announced = {e.args["aggregator"]: e for e in _events(db, "AggregatorAnnounced", epoch)}  # latest wins
    out = []
    for a in addresses:
        e = announced.get(a)
        out.append({
            "address": a, "endpoint": e.args["endpoint"] if e else None,
            "tls_cert_sha256": "0x" + hashlib.sha256(bytes.fromhex(e.args["tls_cert"][2:])).hexdigest() if e else None,
            "announced_at": e.time if e else None,
        })
    return out


def claims(db: sqlite3.Connection, epoch: int) -> dict[tuple[int, str], int]:
    return {(int(e.args["round"]), e.args["host"]): int(e.args["amount"]) for e in _events(db, "RewardClaimed", epoch)}


def epoch_hosts(db: sqlite3.Connection, epoch: int, reports: dict[int, ReportRow]) -> list[dict[str, Any]]:
    claimed = claims(db, epoch)
    left = {e.args["host"] for e in _events(db, "HostLeft", epoch)}
    slashed: dict[str, int] = defaultdict(int)
    for e in _events(db, "Slashed", epoch):
        slashed[e.args["host"]] += int(e.args["amount"])
    out = []
    for j in _events(db, "HostJoined", epoch):
        host = j.args["host"]
        mine = [(r, c) for r, rep in reports.items() if rep.verified for c in rep.contributions if c.host == host]
        out.append({
            "host": host, "slot": int(j.args["slot"]), "stake": _ngonka(int(j.args["stake"])),
            "node_key": j.args["node_key"], "left": host in left, "slashed": _ngonka(slashed[host]),
            "rounds_contributed": sum(1 for _, c in mine if c.aggregated),
            "earned": _ngonka(sum(c.reward for _, c in mine)),
            "claimed": _ngonka(sum(a for (_, h), a in claimed.items() if h == host)),
        })
    return out


def round_row(db: sqlite3.Connection, site: Site, epoch: int, r: int, report: ReportRow | None) -> dict[str, Any]:
    """One line of the epoch's round timeline."""
    committed = _events(db, "SeedCommitted", epoch, r)
    revealed = _events(db, "SeedRevealed", epoch, r)
    final = _events(db, "RoundFinalized", epoch, r)
    f = final[0] if final else None
    state = "finalized" if f else "closing" if revealed else "open" if committed else "pending"
    return {
        "round": r, "state": state,
        "opened_at": committed[0].time if committed else None,
        "closing_at": revealed[0].time if revealed else None,
        "finalized_at": f.time if f else None,
        "checkpoint_sha256": f.args["checkpoint_sha256"] if f else None,
        "rewards_root": f.args["rewards_root"] if f else None,
        "n_contributors": int(f.args["n_contributors"]) if f else None,
        "total_reward": _ngonka(int(f.args["total_reward"])) if f else None,
        "finalize_tx": "0x" + f.tx.hex() if f else None,
        "votes": len(_events(db, "RoundVote", epoch, r)),
        "heldout_loss": report.heldout_loss if report else None,
        "pull_command": pull_command(site, epoch, r) if f else None,
        "download": f"/epochs/{epoch}/rounds/{r}/checkpoint.safetensors" if f and site.downloads else None,
    }


def pull_command(site: Site, epoch: int, round_: int) -> str:
    return (f"gonka-node checkpoint pull --rpc-url {site.rpc_url} --deployment {site.deployment_file} "
            f"--epoch {epoch} --round {round_}")


# ---------------------------------------------------------------------------------------- round


def verdict(c: Any) -> dict[str, Any]:
    """What a contribution's reasons say: accepted or the kind of exclusion, and the replay's numbers."""
    kind = "accepted" if c.aggregated else next(
        (v for why in c.reasons for v in VERDICTS if why.startswith(v + ":")), "excluded"
    )
    if not c.aggregated and kind == "excluded" and any(w.startswith("score ") for w in c.reasons):
        kind = "score"
    found = next((REPLAY.search(w) for w in c.reasons if w.startswith("replay")), None)
    return {
        "verdict": kind,
        "replay_cosine": float(found.group(1)) if found else None,
        "replay_norm_ratio": float(found.group(2)) if found else None,
    }


def round_detail(db: sqlite3.Connection, site: Site, epoch: int, r: int) -> dict[str, Any] | None:
    created = _events(db, "EpochCreated", epoch)
    if not created or not 1 <= r <= int(created[0].args["n_rounds"]):
        return None
    report = read_reports(db, epoch).get(r)
    row = round_row(db, site, epoch, r, report)
    claimed = claims(db, epoch)
    contributions = [
        {"host": c.host, "score": c.score, "reward": _ngonka(c.reward), "aggregated": c.aggregated,
         "reasons": c.reasons, "payload_length": str(c.payload_length), **verdict(c),
         "claimed": (r, c.host) in claimed}
        for c in (report.contributions if report else [])
    ]
    seen = {c["host"] for c in contributions}
    absent = [j.args["host"] for j in _events(db, "HostJoined", epoch) if j.args["host"] not in seen]
    return {
        **row,
        "epoch": epoch,
        "status": status(db, site),
        "votes_detail": [{"aggregator": v.args["aggregator"], "result_hash": v.args["result_hash"], "time": v.time}
                         for v in _events(db, "RoundVote", epoch, r)],
        "seed": next((e.args["seed"] for e in reversed(_events(db, "SeedRevealed", epoch, r))), None),
        "report": None if report is None else {
            "source": report.source, "verified": report.verified, "note": report.note,
            "base_checkpoint_sha256": "0x" + report.base_sha256.hex(), "aggregation": report.aggregation,
            "heldout_loss_base": report.heldout_loss_base, "heldout_loss": report.heldout_loss,
        },
        "contributions": contributions,
        "no_submission": absent if report else [],
    }


# ---------------------------------------------------------------------------------------- host


def host_detail(db: sqlite3.Connection, site: Site, host: str) -> dict[str, Any]:
    epochs = []
    for j in read_events(db, "name='HostJoined' AND host=?", [host]):
        epoch = int(j.args["epoch"])
        reports = read_reports(db, epoch)
        claimed = claims(db, epoch)
        rounds = [
            {"round": r, "reward": _ngonka(c.reward), "aggregated": c.aggregated, "verified": rep.verified,
             "claimed": (r, host) in claimed, **verdict(c)}
            for r, rep in sorted(reports.items()) for c in rep.contributions if c.host == host
        ]
        summary = next(h for h in epoch_hosts(db, epoch, reports) if h["host"] == host)
        slashes = [{"amount": _ngonka(int(e.args["amount"])), "evidence_hash": e.args["evidence_hash"],
                    "time": e.time, "tx": "0x" + e.tx.hex()}
                   for e in read_events(db, "name='Slashed' AND host=? AND epoch=?", [host, epoch])]
        epochs.append({**summary, "epoch": epoch, "rounds": rounds, "slashes": slashes,
                       "challenges": challenges(db, epoch, host)})
    return {"host": host, "status": status(db, site), "epochs": epochs}
