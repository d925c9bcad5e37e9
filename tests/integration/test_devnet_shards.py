"""`gonka-node devnet --shards 2` end to end: two aggregator processes, each owning a fragment of the
model, finalize every round once on chain with the Merkle-of-fragments root of the final checkpoint;
one shard SIGKILLed mid-round (a host's fragment accepted, the round not closed) and restarted on its
port loses nothing: the round finalizes with every host accepted before the kill. The shards reach each
other over the Shard gRPC service (signed messages), as on separate machines.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from chain.backends import RpcBackend
from chain.client import ChainClient
from chain.types import Deployment
from gonka_node.cli import main
from gonka_node.core.fragments import model_root, plan_fragments
from gonka_node.core.recipe import Recipe
from gonka_node.devnet import DevnetOptions, run_devnet
from gonka_node.devnet_procs import Children, aggregator_name, restart_aggregator
from gonka_node.host.shards import sharded_aggregator
from training.checkpoint import canonical_sha256, load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _accepted(db_path: Path, round_: int, query: str = "SELECT host FROM submissions WHERE round=?") -> set[bytes]:
    """The hosts whose fragment a shard holds for the round (its SQLite file, read-only); or, by
    `query`, those it aggregated."""
    if not db_path.exists():
        return set()
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
    try:
        return {bytes(h) for (h,) in db.execute(query, (round_,))}
    except sqlite3.OperationalError:  # not created yet
        return set()
    finally:
        db.close()


def _finalize_votes(backend: RpcBackend, chain: ChainClient) -> list[tuple[int, str, int]]:
    """Every `finalize_round` transaction ever mined: (round, sender, receipt status); with S
    aggregators each one's finalize_round is its vote, and the round finalizes at the quorum's."""
    w3 = backend.connect()
    registry = chain.registry
    txs = [tx for n in range(int(w3.eth.block_number) + 1)
           for tx in w3.eth.get_block(n, full_transactions=True)["transactions"]]
    votes = []
    for tx in txs:
        if tx["to"] != registry.address:
            continue
        fn, args = registry.decode_function_input(tx.get("input", tx.get("data")))
        if fn.fn_name == "finalize_round":
            status = int(w3.eth.get_transaction_receipt(tx["hash"])["status"])
            votes.append((int(list(args.values())[1]), str(tx["from"]), status))  # (epoch, round, ...)
    return sorted(votes)


def _chain(out: Path) -> tuple[RpcBackend, ChainClient]:
    """A reader of the devnet's chain (its URL is in the deployment file)."""
    deployment = Deployment.load(out / "deployment.json")
    backend = RpcBackend(str(deployment.extra["rpc_url"]))
    return backend, ChainClient(backend, backend.dev_accounts()[0], deployment).connect()


def _observe(out: Path, report: dict[str, Any]) -> dict[str, Any]:
    """While the devnet still runs (its `on_report`): the chain's rounds and the final checkpoint."""
    backend, chain = _chain(out)
    epoch, recipe = report["epoch"], Recipe.load(out / "recipe.json")
    results = [chain.round_result(epoch, r) for r in range(1, report["rounds"] + 1)]
    shards = sharded_aggregator(chain, epoch, recipe)
    try:
        final = load_safetensors(shards.checkpoint(epoch, report["rounds"]).data)
    finally:
        shards.close()
    # A client's `checkpoint pull`: every shard announced on chain, merged, checked by the Merkle root.
    pulled, args = out / "pulled.safetensors", ["--deployment", str(out / "deployment.json"), "--epoch", str(epoch)]
    pull = main(["checkpoint", "pull", *args, "--round", "latest", "--out", str(pulled)])
    one = main(["checkpoint", "pull", *args, "--round", "1", "--aggregator", shards.target.split(", ")[0]])
    # One fragment alone: from shard 1 only, checked by the proof it serves against the chain's root.
    fragment = out / "fragment-1.safetensors"
    one_fragment = main(["checkpoint", "pull", *args, "--round", "latest", "--fragment", "1", "--out", str(fragment)])
    # ... and samples from it, verified against the chain's root (`load_verified`).
    sampled = main(["checkpoint", "generate", "--checkpoint", str(pulled), *args, "--round", "latest",
                    "--prompt", "de", "--max-new-tokens", "3", "--greedy"]) if pull == 0 else -1
    return {"results": results, "final": final, "votes": _finalize_votes(backend, chain),
            "aggregators": [str(a) for a in chain.get_epoch(epoch).spec.aggregators],
            "latest": chain.latest_round(epoch), "pull": pull, "one_shard": one, "sampled": sampled,
            "pulled": load_checkpoint(pulled).tensors if pull == 0 else {}, "one_fragment": one_fragment,
            "fragment": load_checkpoint(fragment).tensors if one_fragment == 0 else {}}


def test_devnet_with_two_shards_survives_a_killed_shard_and_finalizes_merkle_roots(tmp_path: Path) -> None:
    out = tmp_path / "devnet"
    opts = DevnetOptions(out=out, hosts=2, rounds=2, inner_steps=8, preset="tiny", replay_fraction=1.0,
                         shards=2, timeout_s=400, heldout_windows=8)
    children, seen, failed = Children(), {}, []

    def run() -> None:
        try:
            run_devnet(opts, say=lambda line: None, on_report=lambda r: seen.update(report=r, **_observe(out, r)),
                       children=children)
        except BaseException as exc:  # re-raised by the test below
            failed.append(exc)

    devnet = threading.Thread(target=run, daemon=True)
    devnet.start()
    shard1 = out / aggregator_name(1)
    deadline = time.monotonic() + 300
    while not _accepted(shard1 / "state.sqlite3", 1):  # a host's fragment accepted by shard 1 in round 1
        assert not failed and time.monotonic() < deadline, failed
        time.sleep(0.02)
    with children.lock:  # the devnet's watch must not see the shard between its death and its restart
        proc = children.procs[aggregator_name(1)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        before = _accepted(shard1 / "state.sqlite3", 1)
        _, chain = _chain(out)
        finalized_at_kill = chain.latest_round(chain.epoch_count())
        restart_aggregator(out, children, 1)
    devnet.join(600)
    assert not devnet.is_alive() and not failed, failed

    report, results = seen["report"], seen["results"]
    assert before and finalized_at_kill == 0  # killed mid-round: a fragment accepted, round 1 not on chain
    assert report["shards"] == 2
    for r in report["rewards"].values():  # replayed by shard 0 from the fragments, paid, claimed by proof
        assert r["claimed_ngonka"] == r["earned_ngonka"] > 0
    # Every round once on chain, and its hash is the root over fragments (not the whole model's hash).
    assert seen["latest"] == 2
    votes = sorted((r, s) for r in (1, 2) for s in seen["aggregators"])  # each shard's vote, once per round
    assert len(seen["aggregators"]) == 2 and [(r, s) for r, s, ok in seen["votes"] if ok] == votes
    assert [r.finalized for r in results] == [True, True]
    assert report["checkpoint_hashes"][1:] == [bytes(r.checkpoint_sha256).hex() for r in results]
    final_root = model_root(seen["final"], 2)
    assert bytes(results[-1].checkpoint_sha256) == final_root != bytes.fromhex(canonical_sha256(seen["final"]))
    # `checkpoint pull` wrote the merged model (the chain's recipe says 2 shards); one shard alone is refused.
    assert seen["pull"] == 0 and seen["one_shard"] == 2 and seen["sampled"] == 0
    assert set(seen["pulled"]) == set(seen["final"])
    assert all(torch.equal(seen["pulled"][n], seen["final"][n]) for n in seen["final"])
    # `--fragment 1` wrote fragment 1 of the plan alone, its values the final model's.
    names = plan_fragments({n: tuple(t.shape) for n, t in seen["final"].items()}, 2)[1].names
    assert seen["one_fragment"] == 0 and set(seen["fragment"]) == set(names)
    assert all(torch.equal(seen["fragment"][n], seen["final"][n]) for n in names)
    # The killed shard lost nothing: what it had accepted is in the round, and every host counted.
    assert [r.n_contributors for r in results] == [2, 2]
    aggregated = "SELECT host FROM contributions WHERE round=? AND aggregated=1"
    for shard in (0, 1):
        assert len(_accepted(out / aggregator_name(shard) / "state.sqlite3", 1, aggregated)) == 2
    assert before <= _accepted(shard1 / "state.sqlite3", 1, aggregated)
    # The shards met over the Shard gRPC service (signed messages in each data_dir), not a shared directory.
    assert not (out / "shard-exchange").exists()
    for shard in (0, 1):
        assert sorted(p.name for p in (out / aggregator_name(shard) / "shard-messages" / str(report["epoch"]) / "2").glob(
            "hash-*.msg")) == ["hash-0.msg", "hash-1.msg"]
    log = (out / "logs" / f"{aggregator_name(1)}.log").read_text()
    assert re.search(r"(resumed open round|resuming the finalization of round) \d+/1 ", log)
