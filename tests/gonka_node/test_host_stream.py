"""Streamed epochs (recipe `stream_fragments`, training/streaming.py) through the real aggregator and two
real hosts.

Each round carries one fragment of the model: the hosts upload its pseudo-gradient alone, the aggregator
checks, averages and steps that fragment and serves its update, and every host follows the chain's model
by that update (never by a checkpoint pulled instead) and lands the synced fragments in its own model. The
global model is `LocalDiLoCo`'s bit for bit, one host stopping and resuming mid-epoch included.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_host_node as base
import torch
from test_host_eager import MEAN, Notes, address, local_models
from torch import Tensor

from gonka_node.host.rig_round import LocalRounds, host_rounds
from gonka_node.host.store import Progress
from training.checkpoint import load_checkpoint
from training.codecs import get_codec, round_seed
from training.streaming import StreamSchedule
from training.worker import Assignment

ROUNDS = (1, 2, 3, 4, 5)
FRAGMENTS = 2
TOPK = "topk:chunk=4096,k=128,bits=2"


class Applied(Notes):
    """Records how each round's model was reached (`follow_to`: "updates", "ahead", "checkpoint", …)."""

    def __init__(self) -> None:
        super().__init__()
        self.how: dict[int, str] = {}

    def round_applied(self, round_: int, how: str, sha256: bytes, reward: int, latency_s: float) -> None:
        self.how[round_] = how


@dataclass
class Streamed:
    world: base.World
    progresses: list[Progress]
    applied: list[Applied]  # host 1 (both of its processes), host 2
    models: dict[int, dict[str, Tensor]]  # round -> the aggregator's checkpoint after it
    payloads: dict[tuple[int, bytes], bytes]
    updates: dict[int, bytes]  # round -> the update file the aggregator serves
    reasons: dict[tuple[int, bytes], list[str]]
    aggregated: dict[tuple[int, bytes], bool]
    slots: dict[bytes, int]


def streamed_epoch(root: Path, **recipe: object) -> Streamed:
    """A 5-round streamed epoch of two fragments in which host 1 stops after applying round 2 and a new
    process resumes it from its state directory."""
    world = base.build_world(root, replay_probability=0.0, round_state="carry", inner_steps=4,
                             n_rounds=len(ROUNDS), stream_fragments=FRAGMENTS, **recipe)
    applied = [Applied(), Applied()]
    agg = base.AggregatorThread(world, root / "agg", MEAN)
    with agg as target:
        def host1() -> Progress:
            base.make_node(world, 1, target, root / "host1", stop_after=2, events=applied[0]).run()
            return base.make_node(world, 1, target, root / "host1", events=applied[0]).run()

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(host1),
                       pool.submit(base.make_node(world, 2, target, root / "host2", events=applied[1]).run)]
            progresses = [f.result(timeout=300) for f in futures]
        store, epoch = agg.store, world.epoch
        return Streamed(
            world, progresses, applied,
            {r: load_checkpoint(store.checkpoint_path(epoch, r)).tensors for r in ROUNDS},
            {(r, s.host): Path(s.path).read_bytes() for r in ROUNDS for s in store.submissions(epoch, r)},
            {r: store.update_path(epoch, r).read_bytes() for r in ROUNDS},
            {(r, c.host): c.reasons for r in ROUNDS for c in store.contributions(epoch, r)},
            {(r, c.host): c.aggregated for r in ROUNDS for c in store.contributions(epoch, r)},
            {address(world, i): world.client(0).host_info(epoch, base.host_keys(i, world).evm_address).slot
             for i in (1, 2)},
        )


def _schedule(run: Streamed) -> StreamSchedule:
    spec = {n: tuple(t.shape) for n, t in run.models[1].items()}
    return StreamSchedule.plan(spec, FRAGMENTS, run.world.recipe.stream_mix, first_round=1)


def _same(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module", params=[
    # mix 0.5: a fragment merged twice would not land where LocalDiLoCo's does
    {"overlap": "off", "codec": "int8", "stream_mix": 0.5},
    {"overlap": "delayed", "codec": TOPK},
], ids=["off-int8-mix", "delayed-topk"])
def dense(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Streamed:
    return streamed_epoch(tmp_path_factory.mktemp("stream"), **request.param)


def test_a_streamed_epoch_s_model_is_local_diloco_s_bit_for_bit(dense: Streamed) -> None:
    chain = dense.world.client(0)
    assert chain.latest_round(dense.world.epoch) == len(ROUNDS)
    for r, want in zip(ROUNDS, local_models(dense, ROUNDS), strict=True):  # type: ignore[arg-type]
        got = dense.models[r]
        assert set(got) == set(want)
        differ = [n for n in want if not _same(got[n], want[n])]
        assert not differ, f"round {r}: {differ[:3]} differ from LocalDiLoCo's"
    final = chain.round_result(dense.world.epoch, len(ROUNDS)).checkpoint_sha256.hex()
    assert [p.model_sha256 for p in dense.progresses] == [final, final]


def test_each_round_moves_its_fragment_alone_and_every_host_follows_it_by_its_update(dense: Streamed) -> None:
    """Round r's payloads, update and outer step hold fragment (r − 1) mod P; no host ever pulled a
    checkpoint to follow (a fragment update applied as a whole model's would have failed the hash)."""
    stream = _schedule(dense)
    codec = get_codec(dense.world.recipe.codec)
    before = dense.models[1]
    for r in ROUNDS[1:]:
        names = set(stream.fragment_of(r).names)
        after = dense.models[r]
        moved = {n for n in after if not _same(after[n], before[n])}
        assert moved == names, f"round {r} moved {sorted(moved - names)[:3]} outside its fragment"
        spec = stream.fragment_of(r).spec(dict((n, tuple(t.shape)) for n, t in after.items()))
        for host in dense.slots:
            payload = dense.payloads[(r, host)]
            assert len(payload) == codec.encoded_size(spec)
            assert set(codec.for_round(round_seed(dense.world.recipe.epoch_seed, r)).decode(payload, spec)) == names
        assert set(load_update_names(dense.updates[r])) == names
        before = after
    _followed_by_updates(dense)
    assert any(n.startswith("resumed at round 2") for n in dense.applied[0].notes)


def _followed_by_updates(run: Streamed) -> None:
    """Every round each host applied between trainings came by its update (or the model computed ahead
    from it), and its outer momentum is still the aggregator's at the end: a pulled checkpoint drops it
    for good (`follow_to`), so no round, the final catch-up's included, was followed by one."""
    for applied in run.applied:
        assert applied.how and set(applied.how.values()) <= {"updates", "ahead"}, applied.how
    assert [p.outer_steps for p in run.progresses] == [len(ROUNDS)] * 2


def load_update_names(data: bytes) -> list[str]:
    from training.checkpoint import tensors_view

    return list(tensors_view(data))


def test_honest_streamed_hosts_pass_every_check(dense: Streamed) -> None:
    """Sketches of a fragment sit at its tensors' places in the whole model, and the base model is sketched
    as the round's fragment: neither the copy, the resubmission nor the mixture check mistakes one host's
    fragment updates P rounds apart, or its fragment of the base, for reuse, and the score gate passes."""
    for r in ROUNDS:
        for host in dense.slots:
            assert dense.aggregated[(r, host)], (r, dense.reasons[(r, host)])
            mix = [float(w.split()[4]) for w in dense.reasons[(r, host)] if w.startswith("mix check: sketch residual")]
            assert mix and mix[0] > 0.2, (r, dense.reasons[(r, host)])  # far above the bar (0.05)


def test_a_streamed_epoch_with_a_compressed_broadcast_follows_every_round_by_its_update(tmp_path: Path) -> None:
    """The aggregator's own error feedback runs on each round's fragment (its other residuals carried), and
    each host decodes the fragment's broadcast and reaches the chain's hash by it, every round."""
    run = streamed_epoch(tmp_path, overlap="delayed", codec=TOPK, broadcast="codec", stream_mix=0.5)
    chain = run.world.client(0)
    final = chain.round_result(run.world.epoch, len(ROUNDS)).checkpoint_sha256.hex()
    assert [p.model_sha256 for p in run.progresses] == [final, final]
    _followed_by_updates(run)
    stream, codec = _schedule(run), get_codec(TOPK)
    spec = {n: tuple(t.shape) for n, t in run.models[1].items()}
    for r in ROUNDS:
        fragment = stream.fragment_of(r).spec(spec)
        assert len(run.updates[r]) == codec.encoded_size(fragment)  # the fragment's broadcast alone
    whole = codec.encoded_size(spec)
    assert all(len(p) < 0.75 * whole for p in run.payloads.values())


def test_a_round_the_chain_skipped_lands_nothing_and_a_refused_first_round_begins_again(tmp_path: Path) -> None:
    """A host's streamed round lands from its held model the syncs since its last landing, less the rounds
    the chain skipped (told by `LocalRounds.skipped`, the daemon's `ChainHashes.skipped`); a first round
    rolled back (refused) leaves no own model, so the next one loads the global model whole again."""
    world = base.build_world(tmp_path, replay_probability=0.0, round_state="carry", inner_steps=2, n_rounds=4,
                             stream_fragments=FRAGMENTS, stream_mix=0.5)
    rounds = host_rounds(world.recipe, Assignment(world.recipe.epoch_seed, 1, 4), None, None, tmp_path / "rig")
    assert isinstance(rounds, LocalRounds) and rounds.stream is not None
    worker = rounds.worker
    landings: list[tuple[int, list[int]]] = []
    land = worker.land

    def spy(schedule: StreamSchedule, synced: Mapping[str, Tensor], upto: int, held: int | None = None,
            skipped: Collection[int] = ()) -> None:
        landings.append((upto, sorted(skipped)))
        land(schedule, synced, upto, held, skipped)

    worker.land = spy  # type: ignore[method-assign]
    rounds.skipped = lambda r: r == 2
    params = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    path = tmp_path / "unused"
    before_first = rounds.snapshot()
    rounds.train_round(1, params, lambda: path, lambda s, loss: None)
    rounds.load_state_dict(before_first)  # refused: as if it never ran
    assert worker.landed is None
    rounds.train_round(1, params, lambda: path, lambda s, loss: None)  # begins again from the global model
    assert worker.landed == 0 and landings == []
    rounds.train_round(2, params, lambda: path, lambda s, loss: None)
    rounds.train_round(3, params, lambda: path, lambda s, loss: None)  # round 2 skipped: its fragment stays
    assert landings == [(1, []), (2, [2])] and worker.landed == 2
    own = dict(worker.model.named_parameters())
    assert not all(torch.equal(own[n], params[n]) for n in rounds.stream.fragment_of(2).names)
