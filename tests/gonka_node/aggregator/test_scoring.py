"""The held-out score (gonka_node/aggregator/scoring.py): a gate on what an update does to unseen text,
and its veto on updates that fit held-out windows better than their own assignment."""

from __future__ import annotations

import torch
from agg_harness import MODEL_SEED, corpus_windows
from torch.nn import functional as F

from gonka_node.aggregator.scoring import Scorer
from training.diloco import pseudo_gradient
from training.model import ModelConfig, build_model

TINY = ModelConfig.preset("tiny")


def trained_on(base: dict[str, torch.Tensor], batch: torch.Tensor, steps: int = 30) -> dict[str, torch.Tensor]:
    model = build_model(TINY, MODEL_SEED)
    model.load_state_dict(base)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        model.loss(batch[:, :-1], batch[:, 1:]).backward()
        opt.step()
    return pseudo_gradient(base, dict(model.named_parameters()))


def per_window_loss(params: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    model = build_model(TINY, MODEL_SEED)
    model.load_state_dict(params)
    model.eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).double()
    return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(dim=1)


def test_the_score_is_the_mean_held_out_gain_and_the_veto_takes_it_to_zero(one_thread) -> None:
    windows = corpus_windows()
    base = {n: p.detach().clone() for n, p in build_model(TINY, MODEL_SEED).named_parameters()}
    heldout = windows.stack(windows.sample_heldout(3, 8))
    assigned = windows.stack(windows.assignment(epoch_seed=1, round_index=1, slot=0, max_slots=8, windows_per_host=8))
    scorer = Scorer(build_model(TINY, MODEL_SEED), base, (heldout[:, :-1], heldout[:, 1:]))

    honest = trained_on(base, assigned)
    got = scorer.score(honest, (assigned[:, :-1], assigned[:, 1:]))
    moved = {n: base[n] - honest[n] for n in base}
    expect = float((per_window_loss(base, heldout) - per_window_loss(moved, heldout)).mean())
    assert abs(got.score - expect) < 1e-9 and got.score > 0 and not got.vetoed
    assert got.reasons() == [f"score {got.score:+.5f} = mean gain on held-out (stderr {got.stderr:.5f})"]

    # Trained on the held-out windows themselves: it fits them far better than its assignment.
    cheat = trained_on(base, heldout)
    vetoed = scorer.score(cheat, (assigned[:, :-1], assigned[:, 1:]))
    assert vetoed.vetoed and vetoed.score == 0.0 and vetoed.gain_heldout > got.gain_heldout
    assert "fits held-out data better than its assignment" in vetoed.reasons()[1]
    # Once a replay has proved what a host trained on, the veto does not apply.
    proved = scorer.score(cheat, (assigned[:, :-1], assigned[:, 1:]), veto=False)
    assert not proved.vetoed and proved.score == vetoed.gain_heldout > 0
