"""An eager epoch with the recipe's `forecast_step` through the real aggregator and two real hosts.

Round r starts from the outer step's all +0 part (no payload needed) and moves onto the host's forecast
after `forecast_step` steps, so the host seals round r − 1 beside round r's first steps
(gonka_node/host/sealing.py) instead of before them. The aggregator's replay makes the same move: every
round of both hosts passes at p = 1 and the global model is `LocalDiLoCo`'s bit for bit. A seal made
to wait for the next round's first step proves it runs beside that step (sealed on the training path,
it would wait for a step that never comes).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import test_host_node as base
import torch
from test_host_eager import MEAN, ROUNDS, Notes, Run, collect, local_models
from torch import Tensor

from gonka_node.core.client import AggregatorClient
from gonka_node.host.events import HostEvents
from gonka_node.host.follow import GlobalModel
from gonka_node.host.node import HostNode, HostSettings
from gonka_node.host.rig_round import LocalRounds, make_worker
from gonka_node.host.sealing import Beside, SealedRound, StateAfterSeal
from gonka_node.host.store import Progress
from gonka_node.host.upload import PendingUpload
from proto.gonka.v1 import aggregator_pb2 as pb
from training.diloco import OuterOptimizer, SpeculativeStep
from training.overlap import eager_base
from training.worker import Rebase, Shifted, WorkerRound, shift_by, shift_onto

FORECAST, MERGE = 2, 5  # of 8 inner steps
TOPK = "topk:chunk=4096,k=128,bits=2"


class Steps(HostEvents):
    """Sets an event when each round's first inner step is taken."""

    def __init__(self) -> None:
        self.first_step: dict[int, threading.Event] = {r: threading.Event() for r in (*ROUNDS, 4)}

    def inner_step(self, round_: int, step: int, total: int, loss: float) -> None:
        if step == 1:
            self.first_step[round_].set()


class SealsLate(HostNode):
    """Its seal of each round but the last finishes only once the next round took its first step (60 s
    at most); records, per round, whether that step came, and what each training returned."""

    sealed_after_next_step: dict[int, bool]
    trained: list[str]
    zero_steps: list[tuple[int, bool, bool]]

    def _prepare(self) -> tuple[GlobalModel, Progress]:
        out = super()._prepare()
        assert isinstance(self.rounds, LocalRounds) and self.rounds.seal_behind
        worker, steps = self.rounds.worker, self.events
        assert isinstance(steps, Steps)
        seal = worker.seal

        def waits(round_index: int, *args: Any, **kwargs: Any) -> WorkerRound:
            if round_index < ROUNDS[-1]:
                self.sealed_after_next_step[round_index] = steps.first_step[round_index + 1].wait(60)
            return seal(round_index, *args, **kwargs)

        worker.seal = waits  # type: ignore[method-assign]
        return out

    def _zero_step(self, r: int, gm: GlobalModel) -> SpeculativeStep:
        """Records, per round, whether its +0 step was one taken ahead (beside round 1, or before the update
        by the upload thread) and whether it is, bit for bit, the one taken from the held model now."""
        ready = self._next_step
        step = super()._zero_step(r, gm)
        assert gm.outer is not None
        fresh = SpeculativeStep(gm.outer, gm.params)
        fresh.run()
        same = all(torch.equal(step.params[n].view(torch.int32), t.view(torch.int32)) for n, t in fresh.params.items()) \
            and all(torch.equal(step.outer.buffers[n].view(torch.int32), t.view(torch.int32))
                    for n, t in fresh.outer.buffers.items()) and step.outer.steps == fresh.outer.steps
        self.zero_steps.append((r, ready is not None and step is ready[1], same))
        return step

    def _train(self, round_: int, gm: GlobalModel, progress: Progress, base_: Mapping[str, Tensor] | None = None,
               *args: Any) -> WorkerRound | SealedRound:
        result = super()._train(round_, gm, progress, base_, *args)
        self.trained.append(type(result).__name__)
        return result


def _epoch(tmp_path: Path, cls: type[HostNode], **recipe: object) -> tuple[Run, list[HostNode]]:
    world = base.build_world(tmp_path, inner_steps=8, n_rounds=3, overlap="eager", forecast_step=FORECAST, **recipe)
    agg = base.AggregatorThread(world, tmp_path / "agg", replace(MEAN, opening_timeout_s=30.0))
    with agg as target:
        nodes = []
        for i in (1, 2):
            settings = HostSettings(epoch=world.epoch, stake=5 * base.GNK, state_dir=tmp_path / f"host{i}", poll_s=0.05)
            node = cls(settings, world.recipe, world.client(i), AggregatorClient(target, base.TLS.cert_pem, 60.0),
                       base.host_keys(i, world), Steps())
            node.sealed_after_next_step, node.trained, node.zero_steps = {}, [], []  # type: ignore[attr-defined]
            nodes.append(node)
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        return collect(world, agg, progresses, tmp_path), nodes


@pytest.mark.parametrize("recipe", [
    {"codec": "int8"},  # the forecast taken whole: a plain move onto it
    {"codec": TOPK},
    # written over the step taken ahead (a sparse broadcast): the move added as its shift (`Shifted`)
    {"codec": TOPK, "broadcast": "codec"},
    {"codec": TOPK, "broadcast": "codec", "merge_step": MERGE},  # then the merge onto the model after r − 1
], ids=["int8", "topk", "topk-broadcast", "topk-broadcast-merge"])
def test_a_late_forecast_epoch_seals_beside_the_next_round_and_passes_the_replay(
    tmp_path: Path, recipe: dict[str, object], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every round of both hosts replayed (p = 1) and paid; the global model `LocalDiLoCo`'s bit for bit
    (which has no compressed broadcast: there, the replay and the chain's hash are the check)."""
    shifts: list[int] = []
    forecast_shift, after_finish = SpeculativeStep.forecast_shift, SpeculativeStep.after_finish
    monkeypatch.setattr(SpeculativeStep, "forecast_shift", lambda self: shifts.append(1) or forecast_shift(self))
    fixed: list[int] = []  # the next step taken ahead of an update, fixed after it

    def fix(self: SpeculativeStep) -> SpeculativeStep | None:
        after = after_finish(self)
        fixed.extend([1] if after is not None else [])
        return after

    monkeypatch.setattr(SpeculativeStep, "after_finish", fix)
    run, nodes = _epoch(tmp_path, SealsLate, **recipe)
    final = run.world.client(0).round_result(run.world.epoch, 3).checkpoint_sha256.hex()
    for progress, node in zip(run.progresses, nodes, strict=True):
        assert progress.round_done == 3 and progress.model_sha256 == final
        assert all(progress.rewards[str(r)] > 0 for r in ROUNDS)
        # Rounds 1 and 2 were sealed after the next round had taken its first step: beside it.
        assert node.sealed_after_next_step == {1: True, 2: True}  # type: ignore[attr-defined]
        assert node.trained == ["SealedRound"] * 3  # type: ignore[attr-defined]
        # Rounds 2 and 3 started from the +0 step, bit for bit the one taken from the held model then: with a
        # sparse broadcast taken ahead (round 2's beside round 1, round 3's before round 1's update, fixed).
        ahead = recipe.get("broadcast") == "codec"
        assert node.zero_steps == [(2, ahead, True), (3, ahead, True)]  # type: ignore[attr-defined]
    for key, why in run.reasons.items():  # replayed (p = 1) with the same moves, every round of both hosts
        assert any(line.startswith("replay:") for line in why), (key, why)
    # Rounds 2 and 3 of each host moved onto a forecast written over the +0 step taken ahead (a sparse
    # broadcast only), which the upload thread of the round before then finished with the update.
    assert len(shifts) == (4 if recipe.get("broadcast") == "codec" else 0)
    # Rounds 1 and 2's upload threads, handed that step, took the next one's +0 part beside the upload and
    # fixed it after the update (`take_after`): round 3 started from the first; the second (from the model
    # after round 2) would start a round 4, which this epoch does not have. Every model adopted ahead
    # hashed to the chain's, so each was the step bit for bit.
    assert len(fixed) == (4 if recipe.get("broadcast") == "codec" else 0)
    if recipe.get("broadcast") != "codec":
        for r, model in zip(ROUNDS, local_models(run), strict=True):
            for name, tensor in model.items():
                assert torch.equal(run.models[r][name], tensor), (r, name)


def _model(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g)}


def test_a_forecast_written_over_the_step_ahead_moves_a_model_as_the_replay_s_difference_does_bit_for_bit() -> None:
    """The shift a host adds (`forecast_shift`: the entries' differences, +0 elsewhere) moves the local
    model exactly as `shift_onto(forecast − zero step)` does in the replay, negative zeros included."""
    anchor, outer = _model(1), OuterOptimizer(0.7, 0.9)
    outer.step({n: t.clone() for n, t in anchor.items()}, _model(2))  # a momentum to step with
    step = SpeculativeStep(outer, anchor)
    step.run()
    zero = {n: t.clone() for n, t in step.params.items()}
    entries = {"a": (torch.tensor([0, 5, 2047]), torch.tensor([0.5, -0.25, 1e-3])), "b": (torch.tensor([7]), torch.tensor([2.0]))}
    forecast = step.forecast(entries)
    shift = step.forecast_shift()
    assert {n: int((s != 0).sum()) for n, s in shift.items()} == {"a": 3, "b": 1}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(300))

    host, replay = Model(), Model()
    with torch.no_grad():
        host.a.view(-1)[100] = replay.a.view(-1)[100] = -0.0  # the dense +0 turns it into +0 in both
        replay.load_state_dict(host.state_dict())
    shift_by(host, Shifted(forecast, shift))  # type: ignore[arg-type]
    shift_onto(replay, zero, forecast)  # type: ignore[arg-type]
    for name in ("a", "b"):
        assert torch.equal(getattr(host, name).view(torch.int32), getattr(replay, name).view(torch.int32)), name
    assert host.a.view(-1)[100].item() == 0.0 and not torch.signbit(host.a.view(-1)[100])


class _Worker:
    """Seals on a gate: what a state read while the seal runs sees."""

    def __init__(self, fail: bool = False) -> None:
        self.gate, self.fail = threading.Event(), fail
        self.feedback = type("F", (), {"state_dict": lambda _self: {"residual": {"x": torch.ones(2)}}})()

    def seal(self, round_: int, *args: object, **kwargs: object) -> WorkerRound:
        self.gate.wait(30)
        if self.fail:
            raise ValueError("non-finite pseudo-gradient")
        return WorkerRound(round_, b"payload", 1.0, 2.0, 2.0, 10, 0.5, None)


def _sealing(worker: _Worker, told: list[int]) -> SealedRound:
    from training.inner import InnerResult

    result = InnerResult(2.0, 2.0, [2.0], 10, 0.5)
    return SealedRound(worker, 3, {}, result, False, lambda r: told.append(r.round))  # type: ignore[arg-type]


def test_a_round_sealed_behind_reads_at_once_what_its_training_made_and_waits_for_what_its_seal_makes() -> None:
    worker, told = _Worker(), []
    sealing = _sealing(worker, told)
    state = StateAfterSeal({"step": 24}, sealing)
    assert (sealing.round, sealing.tokens, sealing.last_loss) == (3, 10, 2.0)
    assert state["inner"] == {"step": 24} and not sealing.done and told == []  # no wait for these
    worker.gate.set()
    assert sealing.payload == b"payload" and told == [3]
    assert dict(state)["feedback"]["residual"]["x"].tolist() == [1.0, 1.0] and sealing.done


def test_a_seal_that_failed_raises_its_error_where_the_round_is_read() -> None:
    worker, told = _Worker(fail=True), []
    sealing = _sealing(worker, told)
    worker.gate.set()
    with pytest.raises(RuntimeError, match=r"^round 3: its seal failed: ValueError: non-finite pseudo-gradient$"):
        sealing.read_payload()
    assert told == []


def test_a_late_forecast_host_whose_previous_upload_is_refused_trains_the_round_again_from_the_held_model(
    tmp_path: Path,
) -> None:
    """Round 2 starts from the +0 step and moves onto its forecast with round 1's payload at the forecast
    step; the aggregator then refuses that payload (LATE), so the replay's round 2 starts from the held
    model and makes no move: the round is trained again so, from the worker state before it."""
    world = base.build_world(tmp_path, inner_steps=8, n_rounds=3, overlap="eager", forecast_step=FORECAST)
    notes = Notes()
    node = base.make_node(world, 1, "127.0.0.1:9", tmp_path / "host1", events=notes)  # no aggregator is asked
    gm, progress = node._prepare()
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    first = node._train(1, gm, progress, node._eager_base(1, gm, None))
    assert isinstance(first, SealedRound)
    before = copy.deepcopy(node.rounds.state_dict())  # once round 1 is sealed
    info = pb.RoundInfo(round=1, base_checkpoint_sha256=gm.sha256)
    refused = PendingUpload(1, gm.sha256, first.read_payload, first.tokens, lambda: info,
                            lambda *_: (False, "LATE: refused in this test"), 0.01).start()
    steps: list[int] = []
    released: list[int] = []
    node.events.inner_step = lambda r, step, total, loss: steps.append(step)  # type: ignore[method-assign]
    second, _ = node._train_overlapped(2, gm, progress, refused, None, release=lambda: released.append(1))
    assert steps == [*range(1, 9)] * 2 and released == [1, 1]  # the forecast taken (and released) in the first

    def round_2(start: Mapping[str, Tensor], rebases: list[Rebase]) -> bytes:
        worker = make_worker(world.recipe, node.rounds.worker.assignment, None)  # type: ignore[attr-defined]
        worker.load_state_dict(copy.deepcopy(before))
        return worker.train_round(2, start, rebases=rebases).payload

    assert gm.outer is not None
    zero = eager_base(gm.params, gm.outer, {n: torch.zeros_like(t) for n, t in gm.params.items()})
    late = round_2(zero, [Rebase(FORECAST, lambda: node._eager_base(2, gm, first.payload))])
    assert second.payload == round_2(node._eager_base(2, gm, None), []) != late
    assert any("round 1's upload was refused; training round 2 again" in n for n in notes.notes)
    node.rounds.close()


def test_a_restarted_late_forecast_host_moves_onto_the_forecast_with_the_payload_it_kept(tmp_path: Path) -> None:
    """Host 1 stops after applying round 1 (rounds 1 and 2 trained, round 2 sealed behind and uploaded) and
    a new process resumes it: its round 3 starts from the +0 step and moves onto the forecast with round
    2's payload read from disk; the replay passes and the model is `LocalDiLoCo`'s bit for bit."""
    world = base.build_world(tmp_path, inner_steps=8, n_rounds=3, overlap="eager", forecast_step=FORECAST)
    agg = base.AggregatorThread(world, tmp_path / "agg", MEAN)
    moves: list[int] = []
    late_forecast = HostNode._late_forecast

    def recorded(self: HostNode, r: int, gm: GlobalModel, own: Any, release: Any) -> Any:
        plan = late_forecast(self, r, gm, own, release)
        if plan.moves:
            moves.append(r)
        return plan

    with agg as target, pytest.MonkeyPatch.context() as patch:
        patch.setattr(HostNode, "_late_forecast", recorded)

        def host1() -> Progress:
            base.make_node(world, 1, target, tmp_path / "host1", stop_after=1).run()
            return base.make_node(world, 1, target, tmp_path / "host1").run()

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(host1), pool.submit(base.make_node(world, 2, target, tmp_path / "host2").run)]
            progresses = [f.result(timeout=300) for f in futures]
        run = collect(world, agg, progresses, tmp_path)
    assert sorted(moves) == [2, 2, 3, 3]  # rounds 2 and 3 of both hosts, the restarted one's round 3 included
    assert all(p.round_done == 3 and all(p.rewards[str(r)] > 0 for r in ROUNDS) for p in progresses)
    for r, model in zip(ROUNDS, local_models(run), strict=True):
        for name, tensor in model.items():
            assert torch.equal(run.models[r][name], tensor), (r, name)


def test_a_failing_report_of_a_sealed_round_does_not_undo_it() -> None:
    from training.inner import InnerResult

    worker = _Worker()
    worker.gate.set()

    def broken_sink(_round: WorkerRound) -> None:
        raise OSError("the log's disk is full")

    sealing = SealedRound(worker, 3, {}, InnerResult(2.0, 2.0, [2.0], 10, 0.5), False, broken_sink)  # type: ignore[arg-type]
    assert sealing.read_payload() == b"payload"


def test_work_beside_the_first_steps_starts_at_the_first_step_and_is_not_done_once_the_round_is_over() -> None:
    done: list[int] = []
    beside = Beside("test", lambda: done.append(1) or 7)
    time.sleep(0.05)
    assert done == []  # before the round's first step: it may not write over the start yet
    beside.begin()
    assert beside.result() == 7 and done == [1]
    over = Beside("test", lambda: done.append(2) or 8)
    over.cancel()  # the round failed before its forecast step
    over._thread.join(5)
    assert done == [1] and not over._thread.is_alive()
