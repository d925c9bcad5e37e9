"""The compressed download (recipe `broadcast = "codec"`): the aggregated update is broadcast encoded with
the epoch's codec plus the aggregator's error feedback, and the global model is defined by the decoded
broadcast, so hosts that download a quarter of the dense bytes still hold the chain's model bit for bit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_host_node as base
import torch
from safetensors.torch import load_file, save_file
from test_host_overlap import overlapped_world

from gonka_node.aggregator.broadcast import compress_broadcast, residual_path
from training.checkpoint import canonical_sha256, load_checkpoint
from training.codecs import get_codec, round_seed
from training.diloco import OuterOptimizer


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
