"""An overlapped host's saves are written behind its training (gonka_node/host/writer.py): round r + 1
trains while round r's save before its upload is still being written, round r's payload reaches the
aggregator only once that save is on disk, and the epoch still ends with every replay passing and the
chain's model held. The snapshot's worker state is a link to the kept round's file, not a second write."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import test_host_node as base
import torch

from gonka_node.host.events import HostEvents
from gonka_node.host.store import HostStore


class Steps(HostEvents):
    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.round_2_training = threading.Event()

    def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
        if round_ == 2 and not self.round_2_training.is_set():
            self.order.append("round 2 trains")
            self.round_2_training.set()


class SlowStore(HostStore):
    """Round 1's save before its upload finishes only once round 2 trains (at most 60 s: written on the
    daemon's thread it would hold round 2 back, and the order below would say so)."""

    def __init__(self, root: Path, epoch: int, events: Steps, order: list[str]) -> None:
        super().__init__(root, epoch)
        self.events, self.order = events, order

    def save_sent(self, round_: int, *args: Any, **kwargs: Any) -> None:
        if round_ == 1:
            self.events.round_2_training.wait(60)
        super().save_sent(round_, *args, **kwargs)
        self.order.append(f"round {round_} saved")


def test_the_next_round_trains_while_the_round_is_saved_and_its_upload_waits_for_the_save(tmp_path: Path) -> None:
    world = base.build_world(tmp_path, inner_steps=6, n_rounds=3, overlap="delayed",
                             codec="topk:chunk=4096,k=128,bits=2")
    order: list[str] = []
    events = Steps(order)
    with base.AggregatorThread(world, tmp_path / "agg") as target:
        nodes = [base.make_node(world, i, target, tmp_path / f"host{i}", events=events if i == 1 else None)
                 for i in (1, 2)]
        nodes[0].store = SlowStore(tmp_path / "host1", world.epoch, events, order)
        submit = nodes[0]._submit

        def recorded(info: Any, payload: bytes, tokens: int) -> tuple[bool, str]:
            order.append(f"round {info.round} submitted")
            return submit(info, payload, tokens)

        nodes[0]._submit = recorded  # type: ignore[method-assign]
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
    assert order.index("round 2 trains") < order.index("round 1 saved") < order.index("round 1 submitted")
    chain = world.client(0)
    assert chain.latest_round(world.epoch) == 3
    final = chain.round_result(world.epoch, 3).checkpoint_sha256.hex()
    for progress in progresses:
        assert progress.model_sha256 == final
        assert sorted(progress.submitted) == ["1", "2", "3"]  # every round accepted: the replays passed
    # The last snapshot's worker state is the last kept round's file, linked.
    store = nodes[0].store
    snap = tmp_path / "host1" / f"snap-{progresses[0].round_done:06d}" / "worker.pt"
    assert snap.stat().st_ino == store.sent_state_path(3).stat().st_ino


def test_a_round_undone_by_its_verdict_is_not_linked_into_the_snapshot(tmp_path: Path) -> None:
    # Overlap "off", top-k: round 1 is kept (its file holds the state after it) and accepted, then fails its
    # checks: the worker goes back to the state before it. The snapshot saved next must hold that state,
    # not a link to round 1's file (a restart would resume with the failed round's residual).
    world = base.build_world(tmp_path, inner_steps=4, n_rounds=3, codec="topk:chunk=4096,k=128,bits=2")
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1")
    gm, progress = node._prepare()
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    before = node.rounds.snapshot()
    first = node._train(1, gm, progress)
    node._keep(first)
    node._record_accepted(1, first.payload, progress)
    kept = node.store.sent_state_path(1)
    node._save(gm, progress).wait()
    snap = tmp_path / "host1" / "snap-000000" / "worker.pt"
    assert snap.stat().st_ino == kept.stat().st_ino  # the state after round 1: linked

    def failed() -> None:  # what `Challenges._forget_failed` does with a FAILED verdict
        node.rounds.load_state_dict(before)
        progress.submitted.pop("1")

    node._undone_forgets_state_file(failed, progress)
    node._save(gm, progress).wait()
    assert snap.stat().st_ino != kept.stat().st_ino
    saved = torch.load(snap)["feedback"]["residual"]
    assert saved == {} or all(not bool(t.any()) for t in saved.values())  # before round 1: no residual yet
    node.writer.close()
    node.rounds.close()
