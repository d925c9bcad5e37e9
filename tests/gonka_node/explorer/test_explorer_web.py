"""The explorer's web server over a real index of the embedded EVM: API values equal the chain's, the
stream announces new blocks, untrusted strings render as text, bad requests get one-line errors, and
an aggregator's report is only called verified when it has the chain's checkpoint and reward root."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from eth_utils import to_canonical_address
from explorer_chain import REWARD, Net, sha

from gonka_node.explorer.db import IndexDb
from gonka_node.explorer.reports import Finalized, check_report, to_report
from gonka_node.explorer.service import Explorer, ExplorerOptions, open_chain
from proto.gonka.v1 import aggregator_pb2 as pb

HOSTILE = "<script>window.pwned=1</script>"


@pytest.fixture
def explorer(fresh: Net, tmp_path: Path) -> Iterator[Explorer]:
    options = ExplorerOptions(poll_s=0.05, rpc_url="http://127.0.0.1:8545", deployment_file="deployment.json")
    handle = Explorer(open_chain("", fresh.deployment, fresh.backend), options, tmp_path / "index.sqlite3").start()
    yield handle
    handle.stop()


def get(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def api(explorer: Explorer, path: str) -> Any:
    status, _, body = get(explorer.url + "api/" + path)
    assert status == 200, body
    return json.loads(body)


def indexed(explorer: Explorer, net: Net) -> None:
    head = int(net.backend.connect().eth.block_number)
    deadline = time.monotonic() + 20
    while api(explorer, "status")["block"] != head:
        assert time.monotonic() < deadline, "the explorer did not reach the head"
        time.sleep(0.05)


def played(net: Net) -> int:
    epoch = net.schedule(2)
    for host in (1, 2):
        net.join(epoch, host)
    net.backend.increase_time(601)
    net.finalize(epoch, 1, (1, 2))
    return epoch


def test_the_api_says_what_the_chain_says_and_the_stream_announces_new_blocks(fresh: Net, explorer: Explorer) -> None:
    epoch = played(fresh)
    indexed(explorer, fresh)
    chain = fresh.client(0)
    e = api(explorer, f"epochs/{epoch}")
    on_chain = chain.round_result(epoch, 1)
    assert [r["state"] for r in e["rounds"]] == ["finalized", "pending"]
    assert e["rounds"][0]["checkpoint_sha256"] == "0x" + on_chain.checkpoint_sha256.hex()
    assert e["rounds"][0]["rewards_root"] == "0x" + on_chain.rewards_root.hex()
    assert e["rounds"][0]["pull_command"] == (
        f"gonka-node checkpoint pull --rpc-url http://127.0.0.1:8545 --deployment deployment.json --epoch {epoch} --round 1"
    )
    assert (e["funded"], e["paid"], e["hosts"]) == (str(chain.get_epoch(epoch).funded), str(REWARD), 2)
    assert [h["host"] for h in e["hosts_detail"]] == chain.hosts(epoch)
    assert e["state"] == "training" and e["latest_round"] == 1
    assert e["aggregators"][0]["address"] == chain.get_epoch(epoch).spec.aggregators[0]

    with urllib.request.urlopen(explorer.url + "api/stream", timeout=10) as stream:
        first = _event(stream)
        fresh.finalize(epoch, 2, (1,))
        while (second := _event(stream))["block"] < int(fresh.backend.connect().eth.block_number):
            pass
    assert second["block"] > first["block"] and second["version"] > first["version"]
    e = api(explorer, f"epochs/{epoch}")
    assert [r["state"] for r in e["rounds"]] == ["finalized", "finalized"] and e["state"] == "finished"


def _event(stream: Any) -> dict[str, Any]:
    lines = []
    while not (line := stream.readline().decode()).startswith("data: "):
        lines.append(line)
    assert "event: update\n" in lines
    return dict(json.loads(line[6:]))


def test_untrusted_strings_render_as_text(fresh: Net, explorer: Explorer, tmp_path: Path) -> None:
    epoch = played(fresh)
    proposer = fresh.client(5)
    proposer.propose([proposer.action_mint(fresh.address(5), 1)], HOSTILE)
    fresh.client(6).challenge(epoch, fresh.address(1), sha("evidence"), '"><img src=x onerror=alert(1)>')
    indexed(explorer, fresh)
    # An aggregator's answer with a hostile reason and endpoint (what a malicious aggregator could send).
    hostile = pb.RoundResult(checkpoint_sha256=sha("ckpt-1"), contributions=[
        pb.Contribution(host=to_canonical_address(fresh.address(1)), reward=REWARD, aggregated=True, reasons=[HOSTILE])
    ])
    d = fresh.deployment
    db = IndexDb(tmp_path / "index.sqlite3").open({"chain_id": d.chain_id, "registry": d.registry, "governor": d.governor})
    block = db.db.execute("SELECT block FROM events WHERE name='RoundFinalized'").fetchone()[0]
    want = Finalized(epoch, 1, block, sha("ckpt-1"), bytes(32), REWARD)
    db.save_report(to_report(want, "<b>agg</b>", hostile, "forged"))
    db.close()

    for path in ("", f"epochs/{epoch}", f"epochs/{epoch}/rounds/1", f"hosts/{fresh.address(1)}"):
        status, _, body = get(explorer.url + path)
        assert status == 200
        assert body.count("<script") == 1 and body.count('<script src="/static/live.js" defer></script>') == 1
        assert "<img" not in body and "<b>" not in body
    _, _, network = get(explorer.url)
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in network
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in network
    _, _, round_page = get(explorer.url + f"epochs/{epoch}/rounds/1")
    assert "<li>&lt;script&gt;window.pwned=1&lt;/script&gt;</li>" in round_page
    assert "&lt;b&gt;agg&lt;/b&gt;" in round_page and "NOT verified: forged" in round_page


def test_bad_requests_get_one_line_errors_and_nothing_writes(explorer: Explorer) -> None:
    cases = {
        "api/epochs/x": (400, "epoch must be a whole number, got 'x'"),
        "api/epochs/99": (404, "no epoch 99 on chain (yet)"),
        "api/epochs/1/rounds/99999999999999999999": (400, "round must be a whole number, got '99999999999999999999'"),
        "api/hosts/0x12": (400, "not an address: '0x12' (give 0x and 40 hex digits)"),
    }
    for path, (code, message) in cases.items():
        status, headers, body = get(explorer.url + path)
        assert (status, json.loads(body)) == (code, {"error": message})
        assert headers["Content-Security-Policy"].startswith("default-src 'none'; script-src 'self'")
    for method in ("POST", "PUT", "DELETE"):
        assert get(explorer.url + "api/network", method)[0] == 405
    status, _, body = get(explorer.url + "no/such/page")
    assert status == 404 and "Not Found" in body and "Traceback" not in body


def test_a_report_is_verified_only_with_the_chains_checkpoint_root_and_total(fresh: Net) -> None:
    epoch = played(fresh)
    chain = fresh.client(0)
    on_chain = chain.round_result(epoch, 1)
    want = Finalized(epoch, 1, 0, on_chain.checkpoint_sha256, on_chain.rewards_root, on_chain.total_reward)
    share = REWARD // 2

    def result(checkpoint: bytes, rewards: dict[int, int]) -> pb.RoundResult:
        return pb.RoundResult(checkpoint_sha256=checkpoint, contributions=[
            pb.Contribution(host=to_canonical_address(fresh.address(h)), reward=r, aggregated=r > 0)
            for h, r in rewards.items()
        ])

    d = fresh.deployment
    assert check_report(d.chain_id, d.registry, want, result(on_chain.checkpoint_sha256, {1: share, 2: share})) == ""
    assert "is not the chain's" in check_report(d.chain_id, d.registry, want, result(sha("x"), {1: share, 2: share}))
    moved = check_report(d.chain_id, d.registry, want, result(on_chain.checkpoint_sha256, {1: share + 1, 2: share - 1}))
    assert moved == "the reward tree of its per-host rewards does not have the chain's root"
    short = check_report(d.chain_id, d.registry, want, result(on_chain.checkpoint_sha256, {1: share}))
    assert short == f"its rewards add up to {share} ngonka, the chain's total is {REWARD}"
