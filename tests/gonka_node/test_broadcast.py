"""The compressed download (recipe `broadcast = "codec"`): the aggregated update is broadcast encoded with
the epoch's codec plus the aggregator's error feedback, and the global model is defined by the decoded
broadcast, so hosts that download a quarter of the dense bytes still hold the chain's model bit for bit."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_host_node as base
import torch
from safetensors.torch import load_file, save_file
from test_host_overlap import Applied, overlapped_world

from gonka_node.aggregator.broadcast import compress_broadcast, residual_path
from gonka_node.host.follow import GlobalModel, NextModel
from gonka_node.host.node import HostNode
from training.checkpoint import canonical_sha256, load_checkpoint
from training.codecs import get_codec, round_seed
from training.diloco import OuterOptimizer, SpeculativeStep


def test_an_epoch_with_a_compressed_download_ends_on_the_chains_model(tmp_path: Path) -> None:
    world = overlapped_world(tmp_path, overlap="off", broadcast="codec")
    agg = base.AggregatorThread(world, tmp_path / "agg")
    with agg as target:
        nodes = [base.make_node(world, i, target, tmp_path / f"host{i}") for i in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        updates = {r: agg.store.update_path(world.epoch, r).read_bytes() for r in (1, 2, 3)}
        residuals = {r: load_file(str(residual_path(agg.store.update_path(world.epoch, r)))) for r in (1, 2, 3)}
        models = {r: load_checkpoint(agg.store.checkpoint_path(world.epoch, r)).tensors for r in (1, 2, 3)}
    models[0] = load_checkpoint(world.init_path).tensors
    chain = world.client(0)
    spec = {n: tuple(t.shape) for n, t in models[0].items()}
    codec = get_codec(world.recipe.codec)
    final = chain.round_result(world.epoch, 3).checkpoint_sha256.hex()
    for progress in progresses:
        assert progress.model_sha256 == final and progress.outer_steps == 3  # stepped its own copy each round
        assert progress.bytes_received == sum(len(u) for u in updates.values())
    # The broadcast is the codec's payload: int8, about a quarter of the dense fp32 update.
    dense = get_codec("fp32").encoded_size(spec)
    assert all(len(u) == codec.encoded_size(spec) < dense / 3 for u in updates.values())
    # The model is the outer step with the *decoded* broadcast, from the chain's previous model.
    outer = OuterOptimizer(world.recipe.outer_lr, world.recipe.outer_momentum)
    params = {n: t.float().clone() for n, t in models[0].items()}
    for r in (1, 2, 3):
        outer.step(params, codec.for_round(round_seed(world.recipe.epoch_seed, r)).decode(updates[r], spec))
        assert canonical_sha256(params) == canonical_sha256(models[r]) == chain.round_result(world.epoch, r).checkpoint_sha256.hex()
    # The aggregator kept what int8 left out (its error feedback), to send in the next round.
    assert all(float(sum(t.abs().sum() for t in res.values())) > 0 for res in residuals.values())


class Speculating(HostNode):
    """Records, for each round the upload thread steps ahead, whether it finished a speculated step, and
    which models computed ahead of earlier rounds are still alive then (each is a model and its momentum:
    one kept per round would exhaust a host's memory within an epoch)."""

    finished: list[tuple[int, bool]]
    models: dict[int, weakref.ref[NextModel]]
    alive: dict[int, list[int]]
    prefetched: dict[int, list[int]]  # per round stepped ahead: the rounds whose updates the daemon still holds
    chained: dict[int, bool]  # per round: whether the next round's step was taken right after its model

    own_entries: list[bool]  # per forecast: whether it took its payload's entries as the encoder kept them

    def _own_entries(self, round_: int, own: bytes) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if not hasattr(self, "own_entries"):
            self.own_entries = []
        self.own_entries.append(self._own is not None and self._own.payload is own)
        return super()._own_entries(round_, own)

    def _step_ahead(self, gm: GlobalModel, round_: int, data: bytes, speculated: SpeculativeStep | None,
                    cancelled: Callable[[], bool]) -> NextModel | None:
        if not hasattr(self, "finished"):
            self.finished, self.models, self.alive, self.prefetched, self.chained = [], {}, {}, {}, {}
        self.finished.append((round_, speculated is not None))
        gc.collect()
        self.alive[round_] = sorted(r for r, ref in self.models.items() if ref() is not None)
        self.prefetched[round_] = sorted(self._prefetched)
        ahead = super()._step_ahead(gm, round_, data, speculated, cancelled)
        if ahead is not None:
            self.models[round_] = weakref.ref(ahead)
            self.chained[round_] = ahead.next_step is not None
        return ahead


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_an_overlapped_top_k_epoch_takes_the_outer_step_ahead_of_the_compressed_update(
    overlap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a sparse broadcast the host steps the model as if the update were +0 before the update exists,
    # and finishes on the update's nonzero entries when it arrives: the models it hands the daemon are
    # the chain's, bit for bit (the daemon adopts them only if they hash to what it records). An eager
    # host's forecast is the same speculation finished with its own payload (written over it, undone for
    # the round's finish), and the replay (p = 1), which recomputes the forecast from public inputs,
    # reproduces every round.
    forecasts: list[int] = []
    forecast = SpeculativeStep.forecast
    monkeypatch.setattr(SpeculativeStep, "forecast", lambda self, update: forecasts.append(1) or forecast(self, update))
    world = base.build_world(tmp_path, inner_steps=8, n_rounds=4, overlap=overlap, broadcast="codec",
                             codec="topk:chunk=4096,k=128,bits=2")
    agg = base.AggregatorThread(world, tmp_path / "agg")
    with agg as target:
        events = [Applied(), Applied()]
        nodes = [base.make_node(world, i, target, tmp_path / f"host{i}", events=events[i - 1], cls=Speculating)
                 for i in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        updates = {r: agg.store.update_path(world.epoch, r).read_bytes() for r in (1, 2, 3, 4)}
        reasons = {(r, c.host): c.reasons for r in (1, 2, 3, 4) for c in agg.store.contributions(world.epoch, r)}
    final = world.client(0).round_result(world.epoch, 4).checkpoint_sha256.hex()
    spec = {n: tuple(t.shape) for n, t in load_checkpoint(world.init_path).tensors.items()}
    for node, progress, seen in zip(nodes, progresses, events, strict=True):
        assert progress.model_sha256 == final and progress.outer_steps == 4
        assert all(progress.rewards[str(r)] > 0 for r in (1, 2, 3, 4))
        # Each round's step was taken ahead, finished with the update and the result adopted: by the upload
        # thread from the base's release, or (eager, from round 2) right after the model before it, by
        # the thread that computed that model (its `next_step`), and handed to the next upload thread.
        assert node.finished[:2] == [(1, True), (2, True)]
        assert [how for _, how in seen.seen[:2]] == ["ahead", "ahead"]
        assert node.chained and all(chained == (overlap == "eager") for chained in node.chained.values())
        # An eager host forecasts with its payload's entries as its encoder kept them, not decoded again:
        # every replay below recomputes that forecast from the payload's bytes and gets the same model.
        assert node.rounds.sparse == (overlap == "eager") and getattr(node, "own_entries", []) == (
            [True, True] if overlap == "eager" else [])
        # When round 3's model is computed, round 1's (adopted before round 3 trained) is gone, and so is
        # the update it was computed from.
        assert 1 not in node.alive[3], node.alive
        assert 1 not in node.prefetched[3], node.prefetched
    # Eager: rounds 3 and 4 forecast over the adopted model's step taken ahead, once per host-round.
    assert len(forecasts) == (4 if overlap == "eager" else 0)
    assert len(reasons) == 8
    for key, why in reasons.items():
        assert any(line.startswith("replay:") for line in why), (key, why)
    # The broadcast is sparse: a top-k payload, a few percent of the dense update's bytes.
    assert all(len(u) < get_codec("fp32").encoded_size(spec) / 10 for u in updates.values())


def test_the_broadcast_residual_carries_what_the_codec_left_out(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    rounds = [{"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen) * 1e-3} for _ in range(2)]
    previous, sent = None, {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    for r, update in enumerate(rounds, start=1):
        payload, decoded, residual = compress_broadcast(update, "int8", round_seed(0, r), previous)
        assert len(payload) == get_codec("int8").encoded_size({"w": (64, 64), "b": (64,)})
        sent = {n: sent[n] + decoded[n] for n in sent}
        previous = tmp_path / f"r{r}.residual"
        save_file(residual, str(previous))
    # Everything aggregated over the rounds = everything broadcast + what is still held back.
    for name in sent:
        total = rounds[0][name] + rounds[1][name]
        assert torch.allclose(sent[name] + residual[name], total, atol=1e-6)
        assert not torch.equal(sent[name], total)  # lossy: the residual is not zero
    with pytest.raises(ValueError, match="tensor names differ"):
        compress_broadcast({"w": rounds[0]["w"]}, "int8", round_seed(0, 3), previous)
