"""A real host process SIGKILLed mid-epoch, restarted on the same state directory, finishes the epoch.

Built from the devnet's pieces (embedded chain served on loopback, Governor-scheduled epoch, aggregator
and hosts as `gonka-node` processes). Host 1 is killed twice:

1. after its round-1 upload was accepted, before the round closed (host 2 is signed in but its process
   has not started, so the round cannot close): nothing was applied, but round 1 was kept before its
   upload (payload, signed residual root, worker state), so the restarted process finds the aggregator
   holding that payload and resumes from the kept state without training round 1 again (on a GPU a
   second training would leave another residual than the one whose root it signed);
2. once round 1 is applied (progress.json names it), somewhere in round 2: the restart resumes from the
   round-1 snapshot, inner AdamW state and error-feedback residual included.

Checks: the epoch finishes, each round has exactly one contribution per host, pulled checkpoints match
the chain, claimed GNK equals the Merkle reward, and host 1's recorded payloads for rounds 1 and 2 are
byte for byte what an uninterrupted worker produces (so its residual survived both kills).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from chain.client import ChainClient
from gonka_node.core.keys import load_keys
from gonka_node.devnet import DevnetOptions, deploy_and_schedule
from gonka_node.devnet_chain import GOVERNANCE, close_signin, start_chain
from gonka_node.devnet_procs import Children, aggregator_client, start_aggregator, start_host
from gonka_node.devnet_report import claim_rewards, make_report
from gonka_node.host.store import HostStore
from training.codecs import get_codec
from training.model import build_model
from training.worker import Assignment, DiLoCoWorker


def wait_for(what: str, ready: Callable[[], bool], children: Children, logs: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        children.check(logs)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sigkill(children: Children, name: str) -> None:
    proc = children.procs[name]
    proc.kill()  # SIGKILL: no handler runs, nothing is flushed or cleaned up
    assert proc.wait(10) == -9


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_host_process_rejoins_and_finishes_the_epoch(tmp_path: Path) -> None:
    opts = DevnetOptions(out=tmp_path / "devnet", hosts=2, rounds=2, inner_steps=8, preset="tiny", timeout_s=300)
    out, logs = opts.out, opts.out / "logs"
    logs.mkdir(parents=True)
    host1_log = logs / "host1.log"
    chain = start_chain()
    children = Children()
    try:
        sched = deploy_and_schedule(opts, chain, say=lambda line: None)
        # Host 2 signs in now (its process finds itself signed in later) and the sign-in window closes:
        # round 1 then waits for host 2's upload, which only comes after host 1's restart.
        accounts = chain.backend.dev_accounts()
        host2 = ChainClient(chain.backend, accounts[2], sched.deployment).connect()
        stake = host2.get_epoch(sched.epoch).spec.min_stake  # what the stake rule asks of every host
        host2.join(sched.epoch, stake, load_keys(out / "keys" / "host2", None).node_public_key)
        target = start_aggregator(out, children)
        start_host(out, 1, target, children)
        close_signin(chain, sched, 2, children, out)
        wait_for("host 1's round-1 upload", lambda: "round 1: submission accepted" in host1_log.read_text(),
                 children, logs)
        sigkill(children, "host1")
        assert not (out / "host1" / "progress.json").exists()  # nothing applied: only the kept round 1
        kept = HostStore(out / "host1").load_sent(1)
        assert kept is not None and kept.has_state

        start_host(out, 1, target, children)
        wait_for("the kept round's recovery",
                 lambda: "round 1: the aggregator holds the payload this host kept" in host1_log.read_text(),
                 children, logs)
        start_host(out, 2, target, children)

        def applied_round_1() -> bool:
            snap = HostStore(out / "host1").load() if (out / "host1" / "progress.json").exists() else None
            return snap is not None and snap.progress.round_done >= 1

        wait_for("host 1 to apply round 1", applied_round_1, children, logs)
        sigkill(children, "host1")
        killed = HostStore(out / "host1").load()  # final now: it may have gone past round 1 meanwhile
        assert killed is not None and killed.progress.round_done >= 1
        start_host(out, 1, target, children)
        for name in ("host1", "host2"):
            assert children.procs[name].wait(240) == 0, (logs / f"{name}.log").read_text()[-2000:]
        assert f"resumed at round {killed.progress.round_done}" in host1_log.read_text()
        assert host1_log.read_text().count("round 1: trained") == 1  # not trained again after the first kill
        claimed = claim_rewards(opts, chain.backend, sched.deployment, sched.epoch, target)
        report = make_report(
            opts, chain.backend, sched.deployment, sched.recipe, sched.epoch, target, sched.init_sha, claimed
        )

        reader = ChainClient(chain.backend, chain.backend.dev_accounts()[GOVERNANCE], sched.deployment).connect()
        assert reader.latest_round(sched.epoch) == 2
        # The devnet seeds the assignment after sign-in (recipe assignment_seed "signin-block").
        beacon = reader.signin_beacon(sched.epoch) if sched.recipe.assignment_seed == "signin-block" else b""
        with aggregator_client(out, target) as agg:
            for r in (1, 2):
                hosts = [bytes(c.host) for c in agg.round_result(sched.epoch, r).contributions]
                assert len(hosts) == len(set(hosts)) == 2  # one submission per host, despite the restarts
            round1 = load_safetensors(agg.checkpoint(sched.epoch, 1).data)
    finally:
        children.stop()
        chain.stop()

    for r in report["rewards"].values():
        assert all(amount > 0 for amount in r["per_round"].values())
        assert r["claimed_ngonka"] == r["earned_ngonka"]  # claimed by Merkle proof
    progress = HostStore(out / "host1").load()
    assert progress is not None and progress.progress.round_done == 2
    assert progress.progress.model_sha256 == report["checkpoint_hashes"][-1]

    # An uninterrupted worker for host 1's slot sends exactly the payloads host 1 recorded.
    recipe = sched.recipe
    torch.set_num_threads(1)  # as in the host processes (OMP_NUM_THREADS=1)
    model = build_model(recipe.model, recipe.init_seed)
    worker = DiLoCoWorker(model, recipe.inner_config(), get_codec(recipe.codec), recipe.windows(out / "cache"),
                          Assignment(recipe.epoch_seed, progress.progress.slot, 8, beacon), recipe.ef_decay)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    for r, params in ((1, init), (2, round1)):
        payload = worker.train_round(r, params).payload
        assert hashlib.sha256(payload).hexdigest() == progress.progress.submitted[str(r)], f"round {r}"
