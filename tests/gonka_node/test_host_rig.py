"""`gonka-node run --gpus N`: a round's inner steps across N local processes (gloo on CPU here).

The daemon's worker hands its state (inner AdamW, error-feedback residual) to a rig of 2 processes
that rendezvous through a FileStore; rank 0 hands back the trained state and the payload. With
grad_accum == processes each process backpropagates one micro-batch per step and the all-reduce sums
the same two gradients a single process accumulates, so the payload is byte for byte the one-process
payload, and so is the next round's (the state came back intact).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from gonka_node.host.rig_round import RigError, RigRound, check_rig_size, make_worker
from gonka_node.recipe import Recipe
from training.model import ModelConfig, build_model
from training.worker import Assignment


def tiny_recipe(tmp: Path, grad_accum: int = 2) -> Recipe:
    corpus = tmp / "corpus.txt"
    corpus.write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes())
    return Recipe(
        model=ModelConfig.preset("tiny"), corpus=str(corpus), seq_len=32, micro_batch=2, grad_accum=grad_accum,
        inner_steps=4, inner_lr=3e-3, warmup_steps=1, n_rounds=2, codec="int8",
    ).with_data_manifest()


@pytest.mark.slow  # starts two Python processes per round
@pytest.mark.multiprocess
def test_two_process_rig_rounds_send_the_one_process_payloads(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    recipe = tiny_recipe(tmp_path)
    assignment = Assignment(recipe.epoch_seed, slot=1, max_slots=4)
    cache = tmp_path / "cache"
    init = {n: p.detach().clone() for n, p in build_model(recipe.model, recipe.init_seed).named_parameters()}
    alone = make_worker(recipe, assignment, cache)
    on_rig = make_worker(recipe, assignment, cache)
    rig = RigRound(2, recipe, assignment, cache, tmp_path / "rig")
    steps: list[int] = []
    for r in (1, 2):
        want = alone.train_round(r, init)
        got = rig.train_round(on_rig, r, init, lambda step, loss: steps.append(step))
        assert got.payload == want.payload, f"round {r}"
        assert got.last_loss == pytest.approx(want.last_loss, abs=1e-6)
    assert steps == list(range(1, 9))  # the rig's steps, replayed to the daemon's progress events
    assert on_rig.trainer.step == alone.trainer.step == 8
    for name, t in alone.feedback.residual.items():  # the residual came back from the rig intact
        assert torch.equal(on_rig.feedback.residual[name], t), name
    assert sorted(p.name for p in (tmp_path / "rig").iterdir()) == []  # nothing left behind


def test_rig_size_must_split_the_recipes_batch(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, grad_accum=2)
    check_rig_size(recipe, 1)
    check_rig_size(recipe, 2)
    with pytest.raises(RigError, match=r"--gpus 3: .* 2 micro-batches per step, .* divisor of 2"):
        check_rig_size(recipe, 3)
    with pytest.raises(RigError, match="at least one process"):
        check_rig_size(recipe, 0)
