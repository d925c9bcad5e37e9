"""The HTML pages: network, epoch, round and host, each a `<main>` that live.js refreshes in place.

Every value comes from `queries` and goes through `markup.el`, so it is escaped; the layout has no
inline script or style (the server's Content-Security-Policy forbids both).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from chain.units import NGONKA_PER_GNK
from gonka_node.explorer.charts import bytes_chart, human_bytes, loss_chart, short
from gonka_node.explorer.markup import Markup, el, join


def gnk(ngonka: str | int | None) -> str:
    if ngonka is None:
        return "–"
    value = Decimal(int(ngonka)) / Decimal(NGONKA_PER_GNK)
    return f"{value:,.9f}".rstrip("0").rstrip(".")


def when(ts: int | None) -> str:
    if not ts:
        return "–"
    return dt.datetime.fromtimestamp(int(ts), dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def host_link(address: str) -> Markup:
    return el("a", el("code", short(address)), href=f"/hosts/{address}", title=address, class_="addr")


def code(text: object, **attrs: object) -> Markup:
    return el("code", text, **attrs)


def table(head: Sequence[str], rows: Sequence[Markup], empty: str, **attrs: object) -> Markup:
    if not rows:
        return el("p", empty, class_="empty")
    return el("div", el("table", el("thead", el("tr", [el("th", h) for h in head])), el("tbody", rows), **attrs),
              class_="scroll")


def facts(items: Sequence[tuple[str, object]]) -> Markup:
    return el("dl", [[el("dt", k), el("dd", v)] for k, v in items if v is not None], class_="facts")


def layout(title: str, main: Markup, live: str, status: Mapping[str, Any]) -> Markup:
    block = status.get("block")
    head = el(
        "head",
        el("meta", charset="utf-8"),
        el("meta", name="viewport", content="width=device-width, initial-scale=1"),
        el("title", f"{title} · gonka explorer"),
        el("link", rel="stylesheet", href="/static/style.css"),
        el("script", src="/static/live.js", defer=True),
    )
    header = el("header", el("a", "gonka explorer", href="/", class_="brand"),
                el("span", f"chain {status.get('chain_id')} · block {block if block is not None else '–'}",
                   id="status"))
    body = el("body", header, el("main", main, id="main", data_live=live or None, data_version=status.get("version")),
              el("footer", "Read-only view of the chain and the aggregators' reports; amounts in GNK."))
    return Markup("<!doctype html>" + el("html", head, body, lang="en"))


# ---------------------------------------------------------------------------------------- network


def model_label(recipe: Mapping[str, Any] | None) -> str:
    if not recipe:
        return "recipe not published"
    if not recipe.get("valid"):
        return "recipe unreadable"
    m = recipe["model"]
    return f"{recipe['params']:,} params ({m['n_layers']} layers, dim {m['dim']})"


def epoch_rows(epochs: Sequence[Mapping[str, Any]]) -> list[Markup]:
    rows = []
    for e in epochs:
        recipe, spec = e["recipe"] or {}, e["spec"]
        rows.append(el(
            "tr",
            el("td", el("a", f"epoch {e['epoch']}", href=f"/epochs/{e['epoch']}")),
            el("td", el("span", e["state"], class_=f"state {e['state']}")),
            el("td", model_label(e["recipe"])),
            el("td", recipe.get("codec") or spec.get("codec", "–")),
            el("td", spec.get("inner_steps", "–")),
            el("td", f"{e['latest_round']}/{e['n_rounds']}"),
            el("td", e["hosts"]),
            el("td", when(e["signin_end"])),
            el("td", f"{e['round_length']} s"),
            el("td", gnk(e["funded"])),
            el("td", gnk(e["paid"])),
            data_epoch=e["epoch"],
        ))
    return rows


def proposal_rows(proposals: Sequence[Mapping[str, Any]]) -> list[Markup]:
    return [
        el("tr",
           el("td", p["proposal_id"]),
           el("td", el("span", p["description"], class_="text")),
           el("td", host_link(p["proposer"])),
           el("td", f"{gnk(p['for_votes'])} for / {gnk(p['against_votes'])} against ({p['voters']} voters)"),
           el("td", gnk(p["quorum"])),
           el("td", when(p["vote_end"])),
           el("td", el("span", p["state"], class_=f"state {p['state']}")),
           data_proposal=p["proposal_id"])
        for p in proposals
    ]


def challenge_rows(challenges: Sequence[Mapping[str, Any]]) -> list[Markup]:
    return [
        el("tr",
           el("td", c["challenge_id"]),
           el("td", el("a", c["epoch"], href=f"/epochs/{c['epoch']}")),
           el("td", host_link(c["host"])),
           el("td", code(c["evidence_hash"], class_="sha")),
           el("td", el("span", c["evidence_uri"], class_="text")),
           el("td", f"{c['status']} ({c['votes']} votes)"),
           el("td", gnk(c["slashed"])),
           data_challenge=c["challenge_id"])
        for c in challenges
    ]


def challenges_section(challenges: Sequence[Mapping[str, Any]]) -> Markup:
    return el("section", el("h2", "Challenges"), table(
        ("#", "epoch", "host", "evidence sha256", "evidence", "status", "slashed"),
        challenge_rows(challenges), "No challenges filed.", id="challenges"))


def network_page(data: Mapping[str, Any]) -> Markup:
    s = data["status"]
    return join([
        el("h1", "Network"),
        facts([("chain id", s["chain_id"]), ("registry", code(s["registry"])), ("governor", code(s["governor"])),
               ("indexed to", f"block {s['block']} ({when(s['time'])})" if s["block"] is not None else "nothing yet")]),
        el("section", el("h2", "Epochs"), table(
            ("epoch", "state", "model", "codec", "H", "rounds", "hosts", "sign-in ends", "round length",
             "funded", "paid"), epoch_rows(data["epochs"]), "No epoch scheduled yet.", id="epochs")),
        el("section", el("h2", "Governance"), table(
            ("#", "description", "proposer", "tally", "quorum", "voting ends", "state"),
            proposal_rows(data["proposals"]), "No proposals yet.", id="proposals")),
        challenges_section(data["challenges"]),
    ])


# ---------------------------------------------------------------------------------------- epoch


def round_rows(epoch: int, rounds: Sequence[Mapping[str, Any]]) -> list[Markup]:
    rows = []
    for r in rounds:
        sha = r["checkpoint_sha256"]
        checkpoint = None if sha is None else [
            code(sha, class_="sha", data_round=r["round"]),
            el("pre", el("code", r["pull_command"]), class_="cmd"),
            el("a", "download", href=r["download"], class_="download") if r["download"] else None,
        ]
        rows.append(el(
            "tr",
            el("td", el("a", f"round {r['round']}", href=f"/epochs/{epoch}/rounds/{r['round']}")),
            el("td", el("span", r["state"], class_=f"state {r['state']}")),
            el("td", when(r["opened_at"])),
            el("td", when(r["closing_at"])),
            el("td", when(r["finalized_at"])),
            el("td", "–" if r["n_contributors"] is None else r["n_contributors"]),
            el("td", gnk(r["total_reward"])),
            el("td", checkpoint or "–", class_="checkpoint"),
            data_round=r["round"], data_state=r["state"],
        ))
    return rows


def host_rows(hosts: Sequence[Mapping[str, Any]]) -> list[Markup]:
    return [
        el("tr",
           el("td", host_link(h["host"])), el("td", h["slot"]), el("td", gnk(h["stake"])),
           el("td", h["rounds_contributed"]), el("td", gnk(h["earned"])), el("td", gnk(h["claimed"])),
           el("td", gnk(h["slashed"])), el("td", "left" if h["left"] else "signed in"),
           data_host=h["host"])
        for h in hosts
    ]


def aggregator_items(aggregators: Sequence[Mapping[str, Any]]) -> Markup:
    return el("ul", [
        el("li", code(a["address"]), " ",
           el("span", a["endpoint"], class_="text") if a["endpoint"] else "(not announced)")
        for a in aggregators
    ], class_="plain")


def recipe_facts(e: Mapping[str, Any]) -> Markup:
    recipe, spec = e["recipe"] or {}, e["spec"]
    return facts([
        ("model", model_label(e["recipe"])),
        ("codec", recipe.get("codec") or spec.get("codec")),
        ("H (inner steps)", spec.get("inner_steps")),
        ("rounds", f"{e['latest_round']} of {e['n_rounds']} finalized"),
        ("round state", recipe.get("round_state")),
        ("sequence × batch", f"{recipe['seq_len']} × {recipe['micro_batch'] * recipe['grad_accum']}" if recipe.get("valid") else None),
        ("outer lr / momentum", f"{spec.get('outer_lr')} / {spec.get('outer_momentum')}"),
        ("replay probability", spec.get("replay_probability")),
        ("min stake", gnk(spec.get("min_stake"))),
        ("reward per round", gnk(e["reward_per_round"])),
        ("funded / paid", f"{gnk(e['funded'])} / {gnk(e['paid'])}"),
        ("created", when(e["created_at"])),
        ("sign-in ends", when(e["signin_end"])),
        ("rounds due by", when(e["deadline"])),
        ("initial checkpoint", code(e["init_checkpoint_hash"], class_="sha")),
        ("aggregators", aggregator_items(e["aggregators"])),
    ])


def epoch_page(e: Mapping[str, Any]) -> Markup:
    allreduce = e["allreduce_bytes_per_host"]
    return join([
        el("h1", f"Epoch {e['epoch']} ", el("span", e["state"], class_=f"state {e['state']}")),
        recipe_facts(e),
        el("section", el("h2", "Held-out loss"), loss_chart(e["loss"]),
           el("p", "As the aggregator reports it: round 0 is the initial model; each round's checkpoint is measured "
                   "on that round's held-out windows.", class_="note")),
        el("section", el("h2", "Bytes per host"),
           bytes_chart({h: int(n) for h, n in e["bytes_per_host"].items()}, int(allreduce) if allreduce else None),
           el("p", "Uploads over the epoch against all-reduce of fp32 gradients at every inner step (log scale).",
              class_="note")),
        el("section", el("h2", "Utilisation"), el("p", "Hosts do not report utilisation yet.", class_="empty")),
        el("section", el("h2", "Rounds"), table(
            ("round", "state", "opened", "closing", "finalized", "contributors", "GNK", "checkpoint sha256"),
            round_rows(e["epoch"], e["rounds"]), "No rounds.", id="rounds")),
        el("section", el("h2", "Hosts"), table(
            ("host", "slot", "stake", "rounds", "earned", "claimed", "slashed", "status"),
            host_rows(e["hosts_detail"]), "No host signed in yet.", id="hosts")),
        challenges_section(e["challenges"]),
    ])


# ---------------------------------------------------------------------------------------- round


def contribution_rows(contributions: Sequence[Mapping[str, Any]]) -> list[Markup]:
    def number(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)

    return [
        el("tr",
           el("td", host_link(c["host"])),
           el("td", el("span", c["verdict"], class_=f"verdict {'ok' if c['aggregated'] else 'bad'}")),
           el("td", el("ul", [el("li", why) for why in c["reasons"]], class_="reasons")),
           el("td", number(c["replay_cosine"], "+.4f")),
           el("td", number(c["replay_norm_ratio"], ".4f")),
           el("td", format(c["score"], "+.5f")),
           el("td", gnk(c["reward"]), class_="reward", data_ngonka=c["reward"]),
           el("td", "claimed" if c["claimed"] else "not claimed", class_="claimed"),
           el("td", human_bytes(int(c["payload_length"]))),
           data_host=c["host"])
        for c in contributions
    ]


def report_facts(report: Mapping[str, Any] | None) -> Markup:
    if report is None:
        return el("p", "No aggregator has reported this round yet.", class_="empty")
    check = "verified against the chain" if report["verified"] else f"NOT verified: {report['note']}"
    loss = (f"{report['heldout_loss_base']:.4f} → {report['heldout_loss']:.4f}"
            if report["heldout_loss"] is not None and report["heldout_loss_base"] is not None else None)
    return facts([("reported by", el("span", report["source"], class_="text")), ("report", check),
                  ("base checkpoint", code(report["base_checkpoint_sha256"], class_="sha")),
                  ("aggregation", report["aggregation"]), ("held-out loss", loss)])


def round_page(r: Mapping[str, Any]) -> Markup:
    return join([
        el("h1", el("a", f"Epoch {r['epoch']}", href=f"/epochs/{r['epoch']}"), f" · round {r['round']} ",
           el("span", r["state"], class_=f"state {r['state']}")),
        facts([
            ("checkpoint sha256", code(r["checkpoint_sha256"], class_="sha") if r["checkpoint_sha256"] else "–"),
            ("Merkle root of rewards", code(r["rewards_root"], class_="sha") if r["rewards_root"] else "–"),
            ("finalizing transaction", code(r["finalize_tx"], class_="sha") if r["finalize_tx"] else "–"),
            ("opened / closing / finalized", f"{when(r['opened_at'])} / {when(r['closing_at'])} / {when(r['finalized_at'])}"),
            ("aggregator votes", r["votes"]),
            ("round seed", code(r["seed"], class_="sha") if r["seed"] else None),
            ("total reward", gnk(r["total_reward"])),
            ("pull", el("pre", el("code", r["pull_command"]), class_="cmd") if r["pull_command"] else None),
        ]),
        el("section", el("h2", "Aggregator's report"), report_facts(r["report"])),
        el("section", el("h2", "Contributions"), table(
            ("host", "verdict", "why", "replay cosine", "norm ratio", "score", "GNK", "claim", "upload"),
            contribution_rows(r["contributions"]), "No contributions reported.", id="contributions")),
        el("section", el("h2", "Signed in, no accepted submission"),
           el("ul", [el("li", host_link(h)) for h in r["no_submission"]], class_="plain")
           if r["no_submission"] else el("p", "None.", class_="empty")),
    ])


# ---------------------------------------------------------------------------------------- host


def host_epoch(e: Mapping[str, Any]) -> Markup:
    rounds = [
        el("tr", el("td", el("a", f"round {x['round']}", href=f"/epochs/{e['epoch']}/rounds/{x['round']}")),
           el("td", x["verdict"]), el("td", gnk(x["reward"]), class_="reward", data_ngonka=x["reward"]),
           el("td", "claimed" if x["claimed"] else "not claimed"),
           el("td", "verified" if x["verified"] else "unverified report"), data_round=x["round"])
        for x in e["rounds"]
    ]
    slashes = [el("tr", el("td", gnk(s["amount"])), el("td", code(s["evidence_hash"], class_="sha")),
                  el("td", when(s["time"])), el("td", code(s["tx"], class_="sha"))) for s in e["slashes"]]
    return el(
        "section",
        el("h2", el("a", f"Epoch {e['epoch']}", href=f"/epochs/{e['epoch']}")),
        facts([("slot", e["slot"]), ("stake", gnk(e["stake"])), ("node key", code(e["node_key"], class_="sha")),
               ("rounds contributed", e["rounds_contributed"]), ("earned", gnk(e["earned"])),
               ("claimed", gnk(e["claimed"])), ("slashed", gnk(e["slashed"])),
               ("status", "left" if e["left"] else "signed in")]),
        table(("round", "verdict", "GNK", "claim", "report"), rounds, "No contributions reported."),
        el("h3", "Slashes"),
        table(("amount", "evidence sha256", "when", "transaction"), slashes, "Never slashed.", class_="slashes"),
        challenges_section(e["challenges"]),
        data_epoch=e["epoch"],
    )


def host_page(h: Mapping[str, Any]) -> Markup:
    return join([
        el("h1", "Host ", code(h["host"])),
        [host_epoch(e) for e in h["epochs"]] if h["epochs"] else el("p", "This address never signed in.", class_="empty"),
    ])


def error_page(title: str, message: str) -> Markup:
    return join([el("h1", title), el("p", message)])
