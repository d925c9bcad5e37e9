"""Eager overlap (recipe `overlap = "eager"`) through the real aggregator and two real hosts.

Round r trains from the host's forecast `eager_base(G(r − 2), momentum(r − 2), D_own(r − 1))`
(training/overlap.py). The aggregator rebuilds each picked host's forecast from what it holds (the
round's base checkpoint, its saved outer momentum, the host's accepted payload of round r − 1) and the
replay (p = 1) reproduces every honest round, one host restarting mid-epoch included; the global model
is bit for bit the one `LocalDiLoCo` computes for the same recipe; a host that trains from the plain
delayed base instead fails the replay.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import test_host_node as base
import torch
from test_host_overlap import overlapped_world
from torch import Tensor

from gonka_node.aggregator.store import now_ms
from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import AggregationSettings, RoundSettings
from gonka_node.core.recipe import Recipe, RecipeError, check_network_overlap
from gonka_node.devnet import DevnetError, DevnetOptions, make_recipe, run_devnet
from gonka_node.epoch_setup import EpochTerms, epoch_spec
from gonka_node.host.events import HostEvents
from gonka_node.host.follow import GlobalModel
from gonka_node.host.node import HostError, HostNode, HostSettings
from gonka_node.host.rig_round import LocalRounds, make_worker
from gonka_node.host.store import HostStore, Progress, RollbackPoint
from gonka_node.host.upload import PendingUpload
from proto.gonka.v1 import aggregator_pb2 as pb
from training.checkpoint import load_checkpoint
from training.codecs import get_codec, round_seed
from training.local import LocalDiLoCo, LocalRunConfig
from training.model import ModelConfig
from training.residual_commit import commitment_layout, residual_root, zero_root
from training.worker import Assignment

ROUNDS = (1, 2, 3)
MEAN = AggregationSettings(rule="mean")  # LocalDiLoCo averages plainly (the default clips to the median norm)


class Notes(HostEvents):
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)


class DelayedLiar(HostNode):
    """Trains an eager epoch's rounds from the plain delayed base (the held model after r − 2) instead of
    its forecast: cheaper to get right, not what the recipe prescribes."""

    def _eager_base(self, r: int, gm: GlobalModel, own: bytes | None) -> dict[str, Tensor]:
        return {n: t.clone() for n, t in gm.params.items()}


@dataclass
class Run:
    world: base.World
    progresses: list[Progress]
    reasons: dict[tuple[int, bytes], list[str]]
    models: dict[int, dict[str, Tensor]]  # round -> the aggregator's checkpoint after it
    payloads: dict[tuple[int, bytes], bytes]  # (round, host) -> the stored payload
    slots: dict[bytes, int]
    root: Path  # the hosts' state directories are root/host1, root/host2


def eager_world(tmp_path: Path) -> base.World:
    return overlapped_world(tmp_path, overlap="eager")


def address(world: base.World, i: int) -> bytes:
    return bytes.fromhex(base.host_keys(i, world).evm_address[2:])


def collect(world: base.World, agg: base.AggregatorThread, progresses: list[Progress], root: Path) -> Run:
    store, epoch = agg.store, world.epoch
    return Run(
        world, progresses,
        {(r, c.host): c.reasons for r in ROUNDS for c in store.contributions(epoch, r)},
        {r: load_checkpoint(store.checkpoint_path(epoch, r)).tensors for r in ROUNDS},
        {(r, s.host): Path(s.path).read_bytes() for r in ROUNDS for s in store.submissions(epoch, r)},
        {address(world, i): world.client(0).host_info(epoch, base.host_keys(i, world).evm_address).slot
         for i in (1, 2)},
        root,
    )


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Notes]:
    """A 3-round eager epoch in which host 1 stops after applying round 1 (rounds 1 and 2 trained, round
    2's record not yet saved) and a new process resumes it from its state directory."""
    tmp_path = tmp_path_factory.mktemp("eager")
    world = eager_world(tmp_path)
    notes = Notes()
    agg = base.AggregatorThread(world, tmp_path / "agg", MEAN)
    with agg as target:
        def host1() -> Progress:
            base.make_node(world, 1, target, tmp_path / "host1", stop_after=1).run()
            return base.make_node(world, 1, target, tmp_path / "host1", events=notes).run()

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(host1), pool.submit(base.make_node(world, 2, target, tmp_path / "host2").run)]
            progresses = [f.result(timeout=300) for f in futures]
        return collect(world, agg, progresses, tmp_path), notes


def local_models(run: Run, rounds: Sequence[int] = ROUNDS) -> list[dict[str, Tensor]]:
    """The global model after each of `rounds` as `LocalDiLoCo` computes it for the epoch's recipe, its
    two simulated hosts given the network hosts' slots (the epoch has 4) and rounds numbered from 1.
    `run`: anything with the epoch's `world` and the hosts' `slots` (test_host_stream's runs too)."""
    recipe = run.world.recipe
    local = LocalDiLoCo(LocalRunConfig(recipe=recipe, workers=2, eval_windows=4), recipe.windows(), first_round=1)
    for worker, i in zip(local.hosts, (1, 2), strict=True):
        worker.assignment = Assignment(recipe.epoch_seed, run.slots[address(run.world, i)], 4)
    out = []
    for _ in rounds:
        local.run_round()
        out.append({n: p.detach().clone() for n, p in local.params.items()})
    return out


def test_an_eager_epoch_passes_the_replay_and_its_model_is_local_diloco_s_bit_for_bit(
    restarted: tuple[Run, Notes],
) -> None:
    run, _ = restarted
    chain = run.world.client(0)
    assert chain.latest_round(run.world.epoch) == 3
    final = chain.round_result(run.world.epoch, 3).checkpoint_sha256.hex()
    for progress in run.progresses:
        assert progress.round_done == 3 and progress.model_sha256 == final
        assert all(progress.rewards[str(r)] > 0 for r in ROUNDS)
    assert len(run.reasons) == 6
    for key, why in run.reasons.items():  # every host's every round replayed (p = 1) from its own forecast
        assert any(line.startswith("replay:") for line in why), (key, why)
    for r, model in zip(ROUNDS, local_models(run), strict=True):
        for name, tensor in model.items():
            assert torch.equal(run.models[r][name], tensor), (r, name)


def test_a_restarted_eager_host_forecasts_with_the_payload_it_kept(restarted: tuple[Run, Notes]) -> None:
    run, notes = restarted
    host1 = address(run.world, 1)
    assert any(n.startswith("resumed at round 1") for n in notes.notes), notes.notes
    # The resumed process did not train round 2 again (the aggregator had it) and trained round 3 from
    # the forecast made with round 2's payload as kept on disk before it was sent: the aggregator's,
    # byte for byte; the replay of round 3 from the aggregator's own inputs reproduced it.
    store = HostStore(run.root / "host1")
    assert store.load_payload(2) == run.payloads[(2, host1)] and store.load_payload(1) is None  # older pruned
    assert store.load_payload(3) == run.payloads[(3, host1)]
    # Adopted and resumed from the lean state of a fresh epoch: the residuals and the clock, no moments.
    assert set(store.load_sent_state(3)["inner"]) == {"step"}
    assert run.progresses[0].submitted["3"] == hashlib.sha256(run.payloads[(3, host1)]).hexdigest()
    assert any(line.startswith("replay:") for line in run.reasons[(3, host1)])


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_an_overlapped_top_k_epoch_opens_every_round_and_is_local_diloco_s_bit_for_bit(
    overlap: str, tmp_path: Path,
) -> None:
    # p = 1: every host-round is challenged while the host trains the next round; it opens e_{r−1} and
    # e_r from the state kept with the round (the worker has compressed the next round by then), against
    # the roots it signed, and the replay from the mode's base passes on the opened chunks.
    world = base.build_world(tmp_path, replay_probability=1.0, inner_steps=8, n_rounds=3, overlap=overlap,
                             codec="topk:chunk=4096,k=128,bits=2")
    agg = base.AggregatorThread(world, tmp_path / "agg", replace(MEAN, opening_timeout_s=30.0))
    with agg as target:
        nodes = [base.make_node(world, i, target, tmp_path / f"host{i}") for i in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        run = collect(world, agg, progresses, tmp_path)
        openings = {(r, host): row for r in ROUNDS for host, row in agg.store.openings(world.epoch, r).items()}
    assert all(p.round_done == 3 and p.outer_steps == 3 for p in progresses)
    assert len(run.payloads) == 6 and set(openings) == set(run.reasons)  # both hosts in every round, all opened
    for key, why in run.reasons.items():
        assert any(line.startswith("replay:") and "opened residual chunks" in line for line in why), (key, why)
    for (r, host), row in openings.items():  # e_{r−1}'s root: the host's previous round's, submitted before
        progress = progresses[0 if host == address(world, 1) else 1]
        assert row.residual_root.hex() == progress.residual_roots[str(r)]
        if r > 1:
            assert row.previous_root.hex() == progress.residual_roots[str(r - 1)]
    for r, model in zip(ROUNDS, local_models(run), strict=True):
        for name, tensor in model.items():
            assert torch.equal(run.models[r][name], tensor), (r, name)


class FailsRound1(HostNode):
    """Honest, except that round 1's upload carries a payload far above the aggregator's norm bar: it gets
    a receipt and then FAILS its checks, so the aggregator holds no round 1 of this host's (as after a
    refusal) and its e_{r−1} for round 2 is the zero residual."""

    def _submit(self, info: pb.RoundInfo, payload: bytes, tokens: int) -> tuple[bool, str]:
        if info.round == 1:
            codec = get_codec(self.recipe.codec).for_round(round_seed(self.recipe.epoch_seed, 1))
            payload = codec.encode({n: torch.full(shape, 1e4) for n, shape in self._spec.items()})
        return super()._submit(info, payload, tokens)


class RoundOneDeadline:
    """The aggregator's clock, moved past round 1's deadline once host 1's round 1 is stored (it then
    fails its checks) and host 2's checked: round 1 closes with host 2 alone (quorum 1) instead of
    waiting out the epoch's 120 s."""

    def __init__(self, world: base.World) -> None:
        self.epoch, self.hosts, self.offset_ms = world.epoch, (address(world, 1), address(world, 2)), 0

    def __call__(self) -> int:
        store = base.AggregatorThread.last_store
        if not self.offset_ms and store.submission(self.epoch, 1, self.hosts[0]) is not None and \
                self.hosts[1] in store.submitted_hosts(self.epoch, 1, checked_only=True):
            self.offset_ms = 130_000
        return now_ms() + self.offset_ms


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_an_overlapped_top_k_host_whose_round_failed_trains_the_next_again_and_it_opens_and_is_paid(
    overlap: str, tmp_path: Path,
) -> None:
    # Host 1's round 1 FAILS its checks while host 1 trains round 2 on top of round 1's residual e_1. The
    # aggregator opens round 2 against the zero root (no earlier checked payload of host 1's), so the host
    # trains round 2 again from the residual before round 1 (docs/PROTOCOL.md "Challenge and opening",
    # overlapped hosts): round 2 opens, passes the replay and is paid. (Before: it opened e_1 under round
    # 1's root, ROOT_MISMATCH, unpaid.)
    world = base.build_world(tmp_path, replay_probability=1.0, inner_steps=8, n_rounds=3, overlap=overlap,
                             codec="topk:chunk=4096,k=128,bits=2")
    notes = Notes()
    agg = base.AggregatorThread(world, tmp_path / "agg", replace(MEAN, opening_timeout_s=30.0),
                                RoundSettings(quorum=1), RoundOneDeadline(world))
    with agg as target:
        nodes = [base.make_node(world, 1, target, tmp_path / "host1", events=notes, cls=FailsRound1),
                 base.make_node(world, 2, target, tmp_path / "host2")]
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        rows = {(r, bytes(c.host)): c for r in ROUNDS for c in agg.store.contributions(world.epoch, r)}
        openings = {(r, host): row for r in ROUNDS for host, row in agg.store.openings(world.epoch, r).items()}
    host1 = address(world, 1)
    assert all(p.round_done == 3 for p in progresses)
    for r in (2, 3):
        why = rows[(r, host1)].reasons
        assert any(line.startswith("replay:") and "opened residual chunks" in line for line in why), (r, why)
        assert rows[(r, host1)].reward > 0
        assert openings[(r, host1)].residual_root.hex() == progresses[0].residual_roots[str(r)]
    layout = commitment_layout(nodes[0].challenges.spec, get_codec(world.recipe.codec))
    assert openings[(2, host1)].previous_root == zero_root(layout)  # what round 2 opened e_{r−1} against
    assert "1" not in progresses[0].submitted and (1, host1) not in rows  # round 1: no submission
    again = "from round 0's model" if overlap == "eager" else "from the residual before round 1"
    assert any(f"round 1's upload was refused; training round 2 again {again}" in n for n in notes.notes), notes.notes


def test_a_host_that_trains_from_the_delayed_base_fails_the_eager_replay(tmp_path: Path) -> None:
    world = eager_world(tmp_path)
    agg = base.AggregatorThread(world, tmp_path / "agg", MEAN)
    with agg as target:
        settings = HostSettings(epoch=world.epoch, stake=5 * base.GNK, state_dir=tmp_path / "host1", poll_s=0.05)
        liar = DelayedLiar(settings, world.recipe, world.client(1), AggregatorClient(target, base.TLS.cert_pem, 60.0),
                           base.host_keys(1, world))
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(liar.run), pool.submit(base.make_node(world, 2, target, tmp_path / "host2").run)]
            [f.result(timeout=300) for f in futures]
        run = collect(world, agg, [], tmp_path)
    liar_host, honest = address(world, 1), address(world, 2)
    # Round 1 has no earlier payload: its eager base is the initial model, which the liar trained from too.
    assert any(line.startswith("replay:") for line in run.reasons[(1, liar_host)])
    for r in (2, 3):
        assert any(line.startswith("replay mismatch") for line in run.reasons[(r, liar_host)]), run.reasons[(r, liar_host)]
        assert any(line.startswith("replay:") for line in run.reasons[(r, honest)])


def test_eager_is_an_epoch_s_overlap_rule_unsharded_only() -> None:
    eager = replace(Recipe(model=ModelConfig.preset("tiny")), overlap="eager")
    check_network_overlap(eager)
    sharded = replace(eager, shards=2)
    with pytest.raises(RecipeError, match="overlap: 'eager' with shards = 2: the sharded replay does not compute"):
        check_network_overlap(sharded)
    with pytest.raises(RecipeError, match="overlap: 'eager' with shards = 2"):
        epoch_spec(sharded, bytes(32), EpochTerms(aggregators=[]), "file:recipe.json")


def test_the_devnet_takes_eager_overlap_and_refuses_it_sharded_before_starting(tmp_path: Path) -> None:
    assert make_recipe(DevnetOptions(out=tmp_path / "d", hosts=2, overlap="eager")).overlap == "eager"
    with pytest.raises(DevnetError, match="--shards with --overlap eager: the sharded replay does not compute"):
        run_devnet(DevnetOptions(out=tmp_path / "d", hosts=2, overlap="eager", shards=2))
    assert not (tmp_path / "d").exists()  # refused before anything started


def test_an_eager_host_whose_previous_upload_is_refused_trains_the_round_again_from_the_held_model(
    tmp_path: Path,
) -> None:
    # The aggregator holds no round 1 payload of this host's (refused: LATE), so the replay's base of its
    # round 2 is the held model itself: the round trained from the forecast is dropped, the worker's
    # state taken back, and the round trained again from there.
    world = eager_world(tmp_path)
    notes = Notes()
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=notes)  # no aggregator is asked
    gm, progress = node._prepare()
    assert isinstance(node.rounds, LocalRounds)  # a CPU: the daemon's own worker
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    first = node._train(1, gm, progress, node._eager_base(1, gm, None))
    before = copy.deepcopy(node.rounds.state_dict())
    info = pb.RoundInfo(round=1, base_checkpoint_sha256=gm.sha256)
    refused = PendingUpload(1, gm.sha256, first.payload, first.tokens, lambda: info,
                            lambda *_: (False, "LATE: refused in this test"), 0.01).start()
    second, undo = node._train_overlapped(2, gm, progress, refused, None)

    def round_2_from(own: bytes | None) -> bytes:
        worker = make_worker(world.recipe, node.rounds.worker.assignment, None)
        worker.load_state_dict(copy.deepcopy(before))
        return worker.train_round(2, node._eager_base(2, gm, own)).payload

    assert second.payload == round_2_from(None) != round_2_from(first.payload)
    assert any("round 1's upload was refused; training round 2 again" in n for n in notes.notes)
    assert undo is None  # int8: no round is trained again from further back than the one before it
    # Without the held model's outer momentum (lost to a pulled checkpoint) there is no forecast to train.
    with pytest.raises(HostError, match="round 2: the eager base needs the outer momentum after round 0"):
        node._eager_base(2, replace(gm, outer=None), first.payload)
    node.rounds.close()


def test_a_delayed_top_k_host_whose_previous_upload_is_refused_trains_the_round_again_from_before_it(
    tmp_path: Path,
) -> None:
    # Round 1 refused (LATE) after round 2 trained on top of its residual e_1: round 2 is trained again
    # from the worker state before round 1 (its base, the initial model, is the same), so its e_{r−1} is
    # the zero residual, the one the aggregator opens it against. Round 2 refused as well (a slow link):
    # round 3 is trained again from the same state. Then a host a round behind: round 3 refused while it
    # trained round 5 (round 4 skipped): round 5 too goes back to the state before round 3.
    world = base.build_world(tmp_path, replay_probability=1.0, inner_steps=4, n_rounds=5, overlap="delayed",
                             codec="topk:chunk=4096,k=128,bits=2")
    notes = Notes()
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=notes)  # no aggregator is asked
    gm, progress = node._prepare()
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    first, undo = node._train_overlapped(1, gm, progress, None, None)
    assert undo is not None
    initial = copy.deepcopy(dict(undo.state))
    after_first = copy.deepcopy(node.rounds.state_dict())

    def refused(round_: int, payload: bytes) -> PendingUpload:
        info = pb.RoundInfo(round=round_, base_checkpoint_sha256=gm.sha256)
        return PendingUpload(round_, gm.sha256, payload, 1, lambda: info,
                             lambda *_: (False, "LATE: refused in this test"), 0.01).start()

    def round_from(state: dict[str, Any], round_: int) -> bytes:
        worker = make_worker(world.recipe, node.rounds.worker.assignment, None)
        worker.load_state_dict(copy.deepcopy(state))
        return worker.train_round(round_, gm.params).payload

    layout = commitment_layout(node._spec, get_codec(world.recipe.codec))

    def e_before() -> bytes:  # the root of e_{r−1} of the round the worker trained last
        return residual_root(node.rounds.residuals()[0], layout)

    second, undo_2 = node._train_overlapped(2, gm, progress, refused(1, first.payload), undo)
    assert second.payload == round_from(initial, 2) != round_from(after_first, 2)
    assert e_before() == zero_root(layout) != residual_root(after_first["feedback"]["residual"], layout)  # not e_1
    assert any("training round 2 again from the residual before round 1" in n for n in notes.notes)
    assert undo_2 is not None
    third, undo_3 = node._train_overlapped(3, gm, progress, refused(2, second.payload), undo_2)
    assert third.payload == round_from(initial, 3) and e_before() == zero_root(layout)
    fifth, _ = node._train_overlapped(5, gm, progress, refused(3, third.payload), undo_3)
    assert fifth.payload == round_from(initial, 5) and e_before() == zero_root(layout)
    assert any("round 3's upload was refused; training round 5 again from the residual before round 3" in n
               for n in notes.notes)
    node.rounds.close()


class _Kept:
    """An aggregator that holds the host's kept payload of the rounds in `held`, each with its checks'
    verdict: PENDING first (the checks still running when the host restarted), then `verdict`."""

    target = "127.0.0.1:9"

    def __init__(self, store: HostStore, held: dict[int, int]) -> None:
        self.store, self.held = store, held
        self.asked: list[int] = []

    def _status(self, round_: int, state: int) -> pb.SubmissionStatus:
        payload = self.store.load_payload(round_)
        assert payload is not None
        return pb.SubmissionStatus(state=state, payload_sha256=hashlib.sha256(payload).digest())

    def submission(self, epoch: int, round_: int, host: bytes) -> pb.SubmissionStatus:
        if round_ not in self.held:
            raise _NotFound()
        return self._status(round_, pb.SubmissionStatus.PENDING)

    def checked(self, epoch: int, round_: int, host: bytes, poll_s: float) -> pb.SubmissionStatus:
        self.asked.append(round_)
        return self._status(round_, self.held[round_])


@pytest.mark.parametrize("round_1", ["cut", "failed", "checked"])
def test_a_delayed_top_k_host_killed_before_its_previous_round_was_final_resumes_from_what_the_aggregator_holds(
    tmp_path: Path, round_1: str,
) -> None:
    # Round 1 kept and uploading, round 2 training on top of its residual; then the daemon dies. If the
    # aggregator does not hold round 1 (the upload was cut) or its payload fails the checks still running,
    # the restarted host resumes from the state before round 1, the one whose residual the aggregator's
    # e_{r−1} is, though its snapshot (saved once round 0 was final, as `_apply` does) holds the state
    # after round 1: it trains round 1 again to the same payload. If round 1 passes, the host (killed
    # once round 2 was kept, before recording round 1; no snapshot) resumes after round 1 and trains
    # round 2 to the same payload.
    world = base.build_world(tmp_path, replay_probability=1.0, inner_steps=4, n_rounds=5, overlap="delayed",
                             codec="topk:chunk=4096,k=128,bits=2")
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=Notes())
    gm, progress = node._prepare()
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    first, undo = node._train_overlapped(1, gm, progress, None, None)
    undo = node._keep(first, undo)
    store = node.store
    if round_1 == "checked":
        second, undo_2 = node._train_overlapped(2, gm, progress, None, undo)
        node._keep(second, undo_2)
        # Round 2 trained from the state kept with round 1: linked, not written again.
        assert store.before_path(2).stat().st_ino == store.sent_state_path(1).stat().st_ino
        assert store.sent_rounds() == [1, 2]
    else:
        node._save(gm, progress).wait()
        assert store.sent_rounds() == [1] and store.before_path(1).exists()
    node.rounds.close()

    notes = Notes()
    again = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=notes)
    verdict = {"failed": pb.SubmissionStatus.FAILED, "checked": pb.SubmissionStatus.CHECKED}.get(round_1)
    aggregator = _Kept(store, {} if verdict is None else {1: verdict})
    again.aggregator = aggregator  # type: ignore[assignment]
    gm_2, progress_2 = again._prepare()
    again._spec, again._busy_until = node._spec, time.monotonic()
    assert aggregator.asked == ([] if verdict is None else [1])  # a PENDING verdict is waited for
    if round_1 == "checked":
        assert progress_2.submitted == {"1": hashlib.sha256(first.payload).hexdigest()}
        assert again._train_overlapped(2, gm_2, progress_2, None, None)[0].payload == second.payload
    else:
        assert progress_2.submitted == {}
        assert again._train_overlapped(1, gm_2, progress_2, None, None)[0].payload == first.payload
        assert any("round 1: the aggregator does not hold the payload this host kept; resuming from the state "
                   "the round trained from" in n for n in notes.notes)
        # The snapshot was saved again with that state: a crash while round 1 is kept anew loses nothing.
        snap = HostStore(tmp_path / "host1").load()
        assert snap is not None and snap.worker_state is not None
        assert snap.worker_state["feedback"] == store.load_sent_before(1)["feedback"]  # type: ignore[index]
    again.rounds.close()


def test_kept_rounds_of_another_epoch_are_not_read_as_this_one_s(tmp_path: Path) -> None:
    """A state folder outlives its epoch: the rounds an earlier epoch kept under sent/ are never this
    epoch's payloads or rollback points (one kept before epochs were recorded still is read)."""
    earlier, now = HostStore(tmp_path, epoch=1), HostStore(tmp_path, epoch=2)
    earlier.save_sent(3, b"epoch 1's round 3", b"\x03" * 32, {"step": 3}, before=RollbackPoint({"step": 2}))
    assert earlier.load_sent_before(3) == {"step": 2} and earlier.sent_rounds() == [3]
    assert now.load_sent(3) is None and now.load_payload(3) is None and now.load_sent_before(3) is None
    assert now.sent_rounds() == []
    HostStore(tmp_path).save_sent(4, b"a round kept before epochs were recorded", b"\x04" * 32)
    kept = now.load_sent(4)
    assert kept is not None and kept.payload == b"a round kept before epochs were recorded"
    assert now.sent_rounds() == [4]


def test_a_delayed_top_k_host_of_a_carry_epoch_keeps_no_rollback_point(tmp_path: Path) -> None:
    # A carry epoch is never challenged (not replayable): no round is trained again, so no AdamW state is
    # copied for it each round.
    world = base.build_world(tmp_path, replay_probability=0.0, inner_steps=2, overlap="delayed",
                             codec="topk:chunk=4096,k=128,bits=2", round_state="carry")
    notes = Notes()
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=notes)
    gm, progress = node._prepare()
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    first, undo = node._train_overlapped(1, gm, progress, None, None)
    info = pb.RoundInfo(round=1, base_checkpoint_sha256=gm.sha256)
    refused = PendingUpload(1, gm.sha256, first.payload, first.tokens, lambda: info,
                            lambda *_: (False, "LATE: refused in this test"), 0.01).start()
    _, undo_2 = node._train_overlapped(2, gm, progress, refused, undo)
    assert undo is None and undo_2 is None and not any("again" in n for n in notes.notes)
    node.rounds.close()


class _Checking:
    """An aggregator that receipts every upload and answers its checks' verdict from a script."""

    target = "127.0.0.1:9"

    def __init__(self, verdicts: list[object]) -> None:
        self.verdicts, self.asked = verdicts, 0
        self.roots: list[bytes] = []

    def submit(self, *_: object, residual_root: bytes) -> None:
        self.roots.append(residual_root)

    def checked(self, epoch: int, round_: int, host: bytes, poll_s: float) -> pb.SubmissionStatus:
        self.asked += 1
        verdict = self.verdicts.pop(0)
        if isinstance(verdict, Exception):
            raise verdict
        return verdict  # type: ignore[return-value]


def test_an_eager_host_counts_an_upload_only_once_its_checks_passed(tmp_path: Path) -> None:
    """A receipt says "stored, checks pending": an eager host forecasts its next round with its payload
    only once the aggregator's checks passed; one that fails them is a refused upload (trained again)."""
    world = eager_world(tmp_path)
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=Notes())
    info = pb.RoundInfo(epoch=world.epoch, round=1)
    node.residual_roots[1] = b"\x07" * 32  # what training round 1 recorded
    failed = pb.SubmissionStatus(state=pb.SubmissionStatus.FAILED, reason=16, message="norm 12 above 10")
    node.aggregator = _Checking([TimeoutError("backlog"), failed])  # type: ignore[assignment]
    assert node._submit_checked(info, b"p", 1, lambda: False) == (False, "NORM_TOO_LARGE: norm 12 above 10")
    assert node.aggregator.roots == [b"\x07" * 32]  # type: ignore[attr-defined]  # the round's, signed
    node.aggregator = _Checking([pb.SubmissionStatus(state=pb.SubmissionStatus.CHECKED)])  # type: ignore[assignment]
    assert node._submit_checked(info, b"p", 1, lambda: False) == (True, "")
    assert node.aggregator.asked == 1  # type: ignore[attr-defined]
    # After the receipt the aggregator holds the payload: a verdict that cannot be had counts it as taken
    # (an odd status, or an upload cancelled while the aggregator is unreachable), never as refused.
    node.aggregator = _Checking([_Status(grpc.StatusCode.CANCELLED)])  # type: ignore[assignment]
    assert node._submit_checked(info, b"p", 1, lambda: False) == (
        True, "stored; the checks' verdict unknown (CANCELLED)")
    unreachable = _Checking([_Status(grpc.StatusCode.UNAVAILABLE)] * 3)
    node.aggregator = unreachable  # type: ignore[assignment]
    assert node._submit_checked(info, b"p", 1, lambda: unreachable.asked >= 2) == (
        True, "stored; the checks' verdict unknown (the upload was cancelled)")
    assert unreachable.asked == 2


class _Holding:
    """An aggregator that holds one payload of the host's in round 2 (or none: NOT_FOUND)."""

    target = "127.0.0.1:9"

    def __init__(self, held: bytes | None) -> None:
        self.held = held

    def submission(self, epoch: int, round_: int, host: bytes) -> pb.SubmissionStatus:
        if self.held is None or round_ != 2:
            raise _NotFound()
        return pb.SubmissionStatus(state=pb.SubmissionStatus.CHECKED, payload_sha256=hashlib.sha256(self.held).digest())


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _NotFound(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND


def test_an_eager_host_restarted_after_an_upload_it_did_not_record_keeps_what_the_aggregator_holds(
    tmp_path: Path,
) -> None:
    """The daemon died after round 2's upload and before recording it: on restart it asks the aggregator,
    and if that holds the payload it kept, records it instead of training round 2 again (a second payload
    would replace the only copy of the one round 3's replay base is built from)."""
    world = eager_world(tmp_path)
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=Notes())
    progress = Progress(world.epoch, 1, 1, "00" * 32)
    node.store.save_sent(2, b"round 2 as sent", b"\x05" * 32)
    node.aggregator = _Holding(b"round 2 as sent")  # type: ignore[assignment]
    assert node._recover_upload(2, progress)
    assert progress.submitted == {"2": hashlib.sha256(b"round 2 as sent").hexdigest()}
    assert progress.residual_roots == {"2": "05" * 32} and node.residual_roots[2] == b"\x05" * 32
    for other in (_Holding(b"another payload"), _Holding(None)):  # not what it kept, or nothing: train again
        node.aggregator = other  # type: ignore[assignment]
        fresh = Progress(world.epoch, 1, 1, "00" * 32)
        assert not node._recover_upload(2, fresh) and fresh.submitted == {}
    assert not node._recover_upload(3, progress)  # nothing kept for round 3
