"""Streamed epochs (training/streaming.py): one fragment of the model synced a round, in turn."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gonka_node.cli.train import local_recipe
from gonka_node.core.recipe import Recipe, RecipeError, check_network_overlap
from training.codecs import ErrorFeedback, get_codec, spec_of
from training.data import Windows
from training.diloco import OuterOptimizer, StreamingAverager
from training.fragments import FragmentError
from training.local import LocalDiLoCo, LocalRunConfig
from training.model import ModelConfig, build_model
from training.streaming import StreamSchedule, merge_fragment

TINY = ModelConfig.preset("tiny")


def _run(windows: Windows, codec: str = "fp32", **fields: Any) -> LocalDiLoCo:
    recipe = local_recipe(TINY, micro_batch=4, seq_len=32, codec=codec,
                          **{"n_rounds": 6, "inner_steps": 2, "stream_fragments": 3, **fields})
    return LocalDiLoCo(LocalRunConfig(recipe=recipe, workers=2, eval_windows=4), windows)


def _copy(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in params.items()}


def test_the_schedule_syncs_each_fragment_in_turn_from_the_first_round_and_covers_the_model() -> None:
    spec = spec_of(dict(build_model(TINY, seed=0).named_parameters()))
    schedule = StreamSchedule.plan(spec, 3, first_round=5)
    assert [schedule.fragment_of(r).index for r in range(5, 12)] == [0, 1, 2, 0, 1, 2, 0]
    names = [n for f in schedule.fragments for n in f.names]
    assert sorted(names) == sorted(spec) and len(names) == len(set(names))
    sizes = [f.numel for f in schedule.fragments]
    assert max(sizes) - min(sizes) <= max(torch.Size(s).numel() for s in spec.values())
    with pytest.raises(ValueError, match="precedes the epoch's first round 5"):
        schedule.fragment_of(4)
    index = lambda fragments: [f.index for f in fragments]  # noqa: E731
    assert index(schedule.landing(4, 5)) == [0] and index(schedule.landing(5, 7)) == [1, 2]
    assert index(schedule.landing(4, 9)) == [2, 0, 1]  # rounds 5 … 9: each fragment once, by its latest sync
    assert schedule.landing(9, 9) == schedule.landing(9, 8) == []
    assert index(schedule.landing(0, 6)) == [0, 1] and schedule.landing(0, 3) == []  # nothing before round 5
    # a held model already past `upto` shows a later sync of a fragment: that one lands with it, once
    assert index(schedule.landing(6, 9, held=10)) == [0, 1] and index(schedule.landing(9, 10)) == [2]
    # a round the chain skipped synced nothing: no fragment lands from it, the one before it counts
    assert index(schedule.landing(4, 9, skipped={9})) == [1, 2, 0]  # f1 from round 6, not round 9
    assert index(schedule.landing(4, 10, skipped={9, 10})) == [1, 2, 0]  # older than the last P rounds
    assert index(schedule.landing(6, 9, held=10, skipped={10})) == [2, 0, 1]  # round 10 showed no later sync
    assert schedule.landing(8, 9, skipped={9}) == []
    with pytest.raises(ValueError, match=r"the held model \(round 8\) precedes the syncs to land \(through 9\)"):
        schedule.landing(6, 9, held=8)
    with pytest.raises(FragmentError, match="stream_fragments must be between 1 and the model's"):
        StreamSchedule.plan(spec, len(spec) + 1)
    with pytest.raises(ValueError, match=r"stream mix must be in \[0, 1\)"):
        StreamSchedule.plan(spec, 2, mix=1.0)


@pytest.mark.parametrize("mix", [0.0, 0.25])
def test_a_synced_fragment_lands_by_the_mix_and_nothing_else_moves(mix: float) -> None:
    model = build_model(TINY, seed=1)
    before = _copy(dict(model.named_parameters()))
    synced = {name: torch.full_like(p, 2.0) for name, p in before.items()}
    names = sorted(before)[:3]
    merge_fragment(model, synced, names, mix)
    after = dict(model.named_parameters())
    for name in before:
        if name in names:
            expected = synced[name] if mix == 0.0 else synced[name] + mix * (before[name] - synced[name])
            torch.testing.assert_close(after[name].detach(), expected, rtol=0, atol=1e-6)
        else:
            assert torch.equal(after[name], before[name])
    with pytest.raises(ValueError, match="not in both the model and the synced fragment"):
        merge_fragment(model, synced, ["nope"], 0.0)


def test_error_feedback_compresses_a_fragment_and_leaves_the_other_residuals() -> None:
    feedback = ErrorFeedback(get_codec("int8:block=4"))
    delta = {"a": torch.linspace(-1, 1, 8), "b": torch.linspace(0, 3, 8)}
    feedback.compress({k: v.clone() for k, v in delta.items()})
    residual_b = feedback.residual["b"]
    payload = feedback.compress({"a": delta["a"].clone()}, part=True)
    assert feedback.residual["b"] is residual_b  # untouched
    assert get_codec("int8:block=4").decode(payload, {"a": (8,)}).keys() == {"a"}
    with pytest.raises(ValueError, match="tensor names differ"):
        feedback.compress({"a": delta["a"].clone()})


def test_a_streamed_round_steps_its_fragment_alone_from_the_hosts_own_models(small_windows: Windows) -> None:
    """fp32 payloads, so the outer step is checked bit for bit against one taken by hand on the hosts'
    models (overlap "delayed": round 0's fragment has not landed when the round ends)."""
    run = _run(small_windows, overlap="delayed")
    assert run.stream is not None
    fragment = run.stream.fragment_of(0)
    before = _copy(run.params)
    report = run.run_round()
    after = _copy(run.params)
    for name in before:
        assert torch.equal(after[name], before[name]) == (name not in fragment.names), name
    # by hand: the mean of θ_global,f − θ_local,f over the hosts, Nesterov's first step
    averager = StreamingAverager(fragment.spec(run.spec))
    for slot, host in enumerate(run.hosts):
        local = dict(host.model.named_parameters())
        averager.add(f"host-{slot:05d}", {n: before[n] - local[n].detach() for n in fragment.names})
    expected = {n: before[n].clone() for n in fragment.names}
    OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True).step(expected, averager.result())
    for name in fragment.names:
        assert torch.equal(after[name], expected[name]), name
    assert report.bytes_per_worker == len(get_codec("fp32").encode(expected))  # the fragment's payload, 1/3
    assert 4 * fragment.numel < report.bytes_per_worker < 4 * fragment.numel + 1024


def test_hosts_train_on_from_their_own_models_and_a_second_sync_steps_from_the_fragment_s_momentum(
    small_windows: Windows, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four rounds of three fragments, "delayed", mix 0.25: each round trains from the model the host's
    last round left (after the landing), never reloaded; round 3, fragment 0's second sync, is checked bit
    for bit against the outer step by hand from the momentum its first sync left."""
    import training.worker

    run = _run(small_windows, overlap="delayed", stream_mix=0.25, n_rounds=4)
    assert run.stream is not None
    starts: list[list[dict[str, torch.Tensor]]] = [[] for _ in run.hosts]
    for slot, host in enumerate(run.hosts):
        def recording(batches: Any, *args: Any, _run: Any = host.trainer.run, _slot: int = slot, **kw: Any) -> Any:
            starts[_slot].append(_copy(dict(run.hosts[_slot].model.named_parameters())))
            return _run(batches, *args, **kw)
        monkeypatch.setattr(host.trainer, "run", recording)
    landed: list[tuple[int, tuple[str, ...], float]] = []
    real_merge = training.worker.merge_fragment
    monkeypatch.setattr(training.worker, "merge_fragment", lambda model, synced, names, mix: (
        landed.append((run.round, tuple(names), mix)), real_merge(model, synced, names, mix))[1])
    ends: list[list[dict[str, torch.Tensor]]] = []
    for _ in range(3):
        run.run_round()
        ends.append([_copy(dict(h.model.named_parameters())) for h in run.hosts])
    for slot in range(len(run.hosts)):
        for r in (1, 2):  # trained on from the model the last round (and its landing) left
            assert all(torch.equal(starts[slot][r][n], ends[r - 1][slot][n]) for n in run.params)
        assert not all(torch.equal(starts[slot][1][n], run.params[n]) for n in run.params)  # not the global model
    fragments = [run.stream.fragment_of(r).names for r in range(4)]
    # delayed: round r's fragment lands on each host as round r + 1 ends (round 0's in round 1, ...)
    assert landed == [(1, fragments[0], 0.25)] * 2 + [(2, fragments[1], 0.25)] * 2
    before = {n: run.params[n].detach().clone() for n in fragments[3]}
    outer = run.outer.copy()  # the momentum fragment 0's first sync left
    run.run_round()
    averager = StreamingAverager({n: run.spec[n] for n in fragments[3]})
    for slot, host in enumerate(run.hosts):
        local = dict(host.model.named_parameters())  # fragment 0 not landed yet: as round 3 trained it
        averager.add(f"host-{slot:05d}", {n: before[n] - local[n].detach() for n in fragments[3]})
    outer.step(before, averager.result())
    assert fragments[3] == fragments[0] and all(torch.equal(run.params[n], before[n]) for n in fragments[3])


@pytest.mark.parametrize("overlap", ["off", "delayed"])
def test_a_streamed_host_resumed_from_its_state_trains_on_bit_for_bit(small_windows: Windows, overlap: str) -> None:
    """The worker's state carries its own model and the round it landed last: a host killed after a
    landing and resumed from its saved state trains and lands the next round as if it had not stopped."""
    run = _run(small_windows, codec="topk:chunk=64,k=8,bits=2", stream_mix=0.25, overlap=overlap)
    assert run.stream is not None
    run.run_round()
    run.run_round()
    host = run.hosts[0]
    saved = torch.load(_roundtrip(host.state_dict()), weights_only=True)  # as a host's store keeps it: a file
    resumed = LocalDiLoCo(run.config, small_windows).hosts[0]
    resumed.load_state_dict(saved)
    assert resumed.landed == host.landed == (1 if overlap == "off" else 0)
    fragment = run.stream.fragment_of(2)
    sent = [w.stream_round(2, run.params, fragment.names).payload for w in (host, resumed)]
    for worker in (host, resumed):
        worker.land(run.stream, run.params, 2 if overlap == "off" else 1)
    assert sent[0] == sent[1] and host.landed == resumed.landed
    theirs = dict(resumed.model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in host.model.named_parameters())
    with pytest.raises(ValueError, match="begin_stream first"):
        LocalDiLoCo(run.config, small_windows).hosts[0].stream_round(2, run.params, fragment.names)


def test_a_snapshot_undoes_a_streamed_round_whole_and_a_plain_worker_s_state_is_unchanged(
    small_windows: Windows
) -> None:
    run = _run(small_windows)
    assert run.stream is not None
    run.run_round()
    host = run.hosts[0]
    point = host.snapshot()
    before = _copy(dict(host.model.named_parameters()))
    host.stream_round(1, run.params, run.stream.fragment_of(1).names)
    host.land(run.stream, run.params, 1)
    host.load_state_dict(point)  # a refused round: back to the state before it, model included
    assert host.landed == 0 and all(torch.equal(p, before[n]) for n, p in host.model.named_parameters())
    # A refused first streamed round (a late joiner's, say): its state before holds no own model, so the
    # worker forgets the one it began and trained, and its next round loads the global model whole again.
    fresh = LocalDiLoCo(run.config, small_windows).hosts[0]
    first = fresh.snapshot()
    fresh.begin_stream(run.params, 0)
    fresh.stream_round(1, run.params, run.stream.fragment_of(1).names)
    fresh.load_state_dict(first)
    assert fresh.landed is None
    other = LocalDiLoCo(run.config, small_windows).hosts[0]
    bad = {**point, "stream": {"landed": 0, "model": {"nope": torch.zeros(1)}}}
    with pytest.raises(ValueError, match="the streamed state's model is not this worker's model"):
        other.load_state_dict(bad)
    assert other.landed is None  # nothing loaded
    plain = LocalDiLoCo(LocalRunConfig(recipe=local_recipe(TINY, micro_batch=4, seq_len=32), workers=1,
                                       eval_windows=4), small_windows).hosts[0]
    assert set(plain.state_dict()) == set(plain.snapshot()) == {"inner", "feedback"}  # no new keys


def _roundtrip(state: dict[str, Any]) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("overlap", ["off", "delayed"])
def test_hosts_train_on_their_own_models_and_take_each_synced_fragment_back_when_it_lands(
    small_windows: Windows, overlap: str
) -> None:
    run = _run(small_windows, codec="topk:chunk=64,k=8,bits=2", overlap=overlap)
    assert run.stream is not None
    first = run.stream.fragment_of(0)
    host_before = _copy(dict(run.hosts[0].model.named_parameters()))
    run.run_round()
    run.run_round()  # round 1: its fragment's sync lands now ("off"), or after round 2 ("delayed")
    synced, landed = run.stream.fragment_of(1), (run.stream.fragment_of(1) if overlap == "off" else first)
    waiting = run.stream.fragment_of(1) if overlap == "delayed" else None
    for host in run.hosts:
        local = dict(host.model.named_parameters())
        for name in run.params:
            same = torch.equal(local[name], run.params[name])
            if name in landed.names:
                assert same, name  # mix 0: the synced values exactly
            elif name in synced.names or (waiting is not None and name in waiting.names):
                assert not same, name  # trained on since, and not landed yet
        assert not any(torch.equal(local[n], host_before[n]) for n in run.stream.fragment_of(2).names)
    # the error feedback keeps a residual for the fragments synced so far, and none for the others
    assert set(run.hosts[0].feedback.residual) == set(first.names) | set(synced.names)


def test_streaming_lowers_every_round_s_upload_and_still_trains(small_windows: Windows) -> None:
    codec = "int8:block=256"
    run = _run(small_windows, codec=codec, n_rounds=3, warmup_steps=2, stream_mix=0.5, overlap="delayed")
    whole = len(get_codec(codec).encode({n: torch.zeros_like(p) for n, p in run.params.items()}))
    start = run.heldout_loss()
    reports = [run.run_round() for _ in range(3)]
    assert max(r.bytes_per_worker for r in reports) < 0.45 * whole  # 3 fragments, balanced
    assert sum(r.bytes_per_worker for r in reports) < 1.01 * whole  # every tensor once in 3 rounds
    assert reports[-1].heldout_loss < start - 0.3


@pytest.mark.parametrize(("fields", "message"), [
    ({"stream_fragments": 0}, "stream_fragments: must be a positive integer"),
    ({"stream_fragments": 2, "round_state": "fresh"}, 'needs round_state = "carry"'),
    ({"stream_fragments": 2, "overlap": "eager"}, "streamed rounds overlap as"),
    ({"stream_fragments": 2, "shards": 2}, "stream one or the other"),
    ({"stream_fragments": 2, "codec": "mask:stride=2"}, "with the mask codec: its phase follows the round"),
    ({"stream_fragments": 2, "shards": "2"}, "shards: must be a positive integer"),
    ({"stream_mix": 0.5}, "needs stream_fragments > 1"),
    ({"stream_fragments": 2, "stream_mix": 1.0}, r"stream_mix: must be a fraction in \[0, 1\)"),
])
def test_the_recipe_refuses_streaming_it_cannot_run(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        Recipe(model=TINY, **fields)


def test_streaming_stays_out_of_the_canonical_recipe_when_off_and_is_served_in_the_network() -> None:
    assert Recipe(model=TINY).sha256() == Recipe(model=TINY, stream_fragments=1, stream_mix=0.0).sha256()
    streamed = Recipe(model=TINY, stream_fragments=4, stream_mix=0.5)
    assert (streamed.to_dict()["stream_fragments"], streamed.to_dict()["stream_mix"]) == (4, 0.5)
    assert Recipe.from_dict(streamed.to_dict()).sha256() == streamed.sha256()
    check_network_overlap(streamed)  # the host daemon and the aggregator serve it (tests/gonka_node/test_host_stream.py)
