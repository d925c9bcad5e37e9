"""A top-k epoch replayed end to end (docs/PROTOCOL.md "Challenge and opening"): real host nodes and a real
aggregator on the embedded chain, p = 1. Every host of every round is challenged; an honest host opens its
residual and passes the replay on the opened chunks (the dense comparison failed every honest top-k host);
a host that stays silent is left out of the round, unpaid, not slashed, and the round still closes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import test_host_node as base

from gonka_node.core.config import AggregationSettings
from gonka_node.host.challenge import Challenges
from gonka_node.host.node import HostNode
from gonka_node.host.store import Progress
from proto.gonka.v1 import aggregator_pb2 as pb

TOPK = "topk:chunk=4096,k=128,bits=2"


class SilentChallenges(Challenges):
    def answer(self, info: pb.RoundInfo, progress: Progress) -> bool:
        if info.round == 2:
            return True
        return super().answer(info, progress)


class SilentInRound2(HostNode):
    """Trains and uploads honestly, but does not open its residual when round 2 challenges it."""

    challenges_type = SilentChallenges


def test_honest_top_k_hosts_open_and_are_paid_and_a_silent_one_is_left_out(tmp_path: Path) -> None:
    world = base.build_world(tmp_path, replay_probability=1.0, codec=TOPK, inner_steps=8, n_rounds=2)
    aggregation = AggregationSettings(opening_timeout_s=4.0)
    with base.AggregatorThread(world, tmp_path / "agg", aggregation) as target:
        honest = base.make_node(world, 1, target, tmp_path / "host1")
        silent = base.make_node(world, 2, target, tmp_path / "host2", cls=SilentInRound2)
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=600) for f in [pool.submit(n.run) for n in (honest, silent)]]
        store = base.AggregatorThread.last_store
        rows = {(r, bytes(c.host)): c for r in (1, 2) for c in store.contributions(world.epoch, r)}
        openings = {(r, host) for r in (1, 2) for host in store.openings(world.epoch, r)}
    host1, host2 = (bytes.fromhex(world.accounts[i].address[2:]) for i in (1, 2))
    assert all(p.round_done == 2 for p in progresses)
    # Every honest host-round opened and passed the replay on its opening, and was paid.
    for key in ((1, host1), (1, host2), (2, host1)):
        assert key in openings, key
        assert any(line.startswith("replay:") for line in rows[key].reasons), rows[key].reasons
        assert rows[key].reward > 0
    # The silent host uploaded round 2 but did not open: excluded, unpaid, not a mismatch (no evidence).
    assert (2, host2) not in openings
    reasons = rows[(2, host2)].reasons
    assert rows[(2, host2)].reward == 0 and any(line.startswith("no opening") for line in reasons), reasons
    assert not any(line.startswith("replay mismatch") for line in reasons)
    assert not world.client(0).host_info(world.epoch, world.accounts[2].address).slashed
