"""Score one contribution: does applying its update alone help on unseen text (and on its own data)?

gain(D) = L(θ; D) − L(θ − Δ; D): the loss drop on batch D when the host's own update Δ (DiLoCo's
pseudo-gradient, θ_global − θ_local) is applied alone to the round's base model θ, i.e. the host's
local model is reconstructed. The default rule's score is the mean gain on random held-out windows: a
gate (pay is equal among the hosts that pass, gonka_node/aggregator/close.py), so an update that makes
unseen text worse is not aggregated. The held-out sample is drawn per round from a seed the hosts
cannot know in advance (it includes the base checkpoint hash). The stricter rule compares the gain on
the host's assigned windows with the held-out gain (see `Scorer`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from training.data import window_seed

Batch = tuple[Tensor, Tensor]
CONFIDENCE_Z = 2.0  # one-sided ~97.7%: noise scores > 0 about once in 44


class WindowSource(Protocol):
    """`training.data.Windows`' part that scoring uses."""

    def assignment(
        self, *, epoch_seed: int, round_index: int, slot: int, max_slots: int, windows_per_host: int
    ) -> np.ndarray: ...

    def sample_heldout(self, seed: int, n: int) -> np.ndarray: ...

    def stack(self, ids: np.ndarray) -> Tensor: ...


@dataclass(frozen=True)
class ScoringData:
    """Which windows score a host in a round (the same assignment rule the hosts train on)."""

    windows: WindowSource
    epoch_seed: int
    max_slots: int
    windows_per_host: int
    heldout_windows: int
    beacon: Callable[[], bytes] | None = None  # the assignment's post-sign-in randomness, when the recipe asks

    def assigned(self, round_index: int, slot: int) -> Batch:
        ids = self.windows.assignment(
            epoch_seed=window_seed(self.epoch_seed, self.beacon() if self.beacon else b""),
            round_index=round_index,
            slot=slot,
            max_slots=self.max_slots,
            windows_per_host=self.windows_per_host,
        )
        return _split(self.windows.stack(ids))

    def heldout(self, round_index: int, base_sha256: bytes) -> Batch:
        key = hashlib.sha256(b"gonka-score-heldout-v1" + self.epoch_seed.to_bytes(8, "big"))
        key.update(round_index.to_bytes(8, "big") + base_sha256)
        seed = int.from_bytes(key.digest()[:4], "big")
        return _split(self.windows.stack(self.windows.sample_heldout(seed, self.heldout_windows)))


def _split(windows: Tensor) -> Batch:
    return windows[:, :-1], windows[:, 1:]


SCORE_RULES = ("heldout_gain", "assignment_gap")


@dataclass(frozen=True)
class Score:
    score: float
    gain_assigned: float
    gain_heldout: float
    stderr: float  # of the rule's statistic
    rule: str = "assignment_gap"
    gap_stderr: float = 0.0
    vetoed: bool = False  # heldout_gain only: fits held-out data significantly better than its assignment

    def reasons(self) -> list[str]:
        if self.rule == "heldout_gain":
            gap = self.gain_assigned - self.gain_heldout
            why = [f"score {self.score:+.5f} = mean gain on held-out (stderr {self.stderr:.5f})"]
            if self.vetoed:
                why.append(
                    f"fits held-out data better than its assignment (gap {gap:+.5f}, stderr "
                    f"{self.gap_stderr:.5f}): not trained on its assignment"
                )
            return why
        return [
            f"score {self.score:+.5f} = gain on assignment {self.gain_assigned:+.5f} − gain on held-out "
            f"{self.gain_heldout:+.5f} − {CONFIDENCE_Z:g}×stderr {self.stderr:.5f}"
        ]


class Scorer:
    """One model loaded with the round's base weights; scores updates one at a time (memory: 2 models).

    Two rules (chosen per aggregator, `[aggregation] score_rule`):

    - "heldout_gain" (default): the score is how much the update alone improves unseen text (the mean
      held-out gain), vetoed to 0 when the update fits held-out windows *significantly better* than the
      host's own assignment (unless a replay proved its training). Passes useful work from the first
      round, when single-pass training improves everything alike; cannot tell an update trained on
      other good data from an honest one (the replay check can: docs/SECURITY.md).
    - "assignment_gap": the score is a lower confidence bound of gain(assignment) − gain(held-out):
      proof that the host trained on *its* windows. Sound once memorisation is measurable (many inner
      steps over few windows); in early single-pass rounds honest updates score ≈ 0 and are dropped.
    """

    def __init__(
        self, model: nn.Module, base: Mapping[str, Tensor], heldout: Batch, rule: str = "heldout_gain"
    ) -> None:
        if rule not in SCORE_RULES:
            raise ValueError(f"Scorer: rule must be one of {SCORE_RULES}, got {rule!r}")
        self.model = model
        self.rule = rule
        self.base = {name: t.detach().float().clone() for name, t in base.items()}
        self._params = dict(model.named_parameters())
        if set(self.base) != set(self._params):
            raise ValueError("Scorer: base weights and model parameters have different names")
        self.heldout = heldout
        self._load(None)
        self.heldout_base = self._losses(heldout)

    @torch.no_grad()
    def _losses(self, batch: Batch) -> Tensor:
        """Mean next-token cross-entropy of each window (fp64), so that gains come with a spread."""
        self.model.eval()
        logits = self.model(batch[0]).double()
        per_token = F.cross_entropy(logits.transpose(1, 2), batch[1], reduction="none")
        return per_token.mean(dim=1)

    @torch.no_grad()
    def _load(self, delta: Mapping[str, Tensor] | None) -> None:
        for name, p in self._params.items():
            base = self.base[name]
            # a streamed round's update holds its fragment alone: the other tensors stay at the base
            p.copy_(base if delta is None or name not in delta else base - delta[name].to(base.dtype))

    def score(self, delta: Mapping[str, Tensor], assigned: Batch, veto: bool = True) -> Score:
        """Per-window gains on both sets. heldout_gain: the mean held-out gain (an update that makes unseen
        text worse scores below zero), vetoed to at most 0 when the update fits held-out windows
        significantly (CONFIDENCE_Z standard errors) better than its own assignment; `veto` False skips
        that (a replay has proved what the host trained on). assignment_gap: the lower confidence bound
        of gain(assignment) − gain(held-out)."""
        self._load(None)
        before_a = self._losses(assigned)
        self._load(delta)
        gain_a = before_a - self._losses(assigned)
        gain_h = self.heldout_base - self._losses(self.heldout)
        mean_a, mean_h = float(gain_a.mean()), float(gain_h.mean())
        gap_se = math.sqrt(_var_of_mean(gain_a) + _var_of_mean(gain_h))
        if self.rule == "assignment_gap":
            return Score(mean_a - mean_h - CONFIDENCE_Z * gap_se, mean_a, mean_h, gap_se, self.rule, gap_se)
        se_h = math.sqrt(_var_of_mean(gain_h))
        score = mean_h  # a gate, not a weight (pay is equal): what the update does to unseen text
        vetoed = veto and mean_a - mean_h < -CONFIDENCE_Z * gap_se
        if vetoed:
            score = min(score, 0.0)
        return Score(score, mean_a, mean_h, se_h, self.rule, gap_se, vetoed)


def _var_of_mean(x: Tensor) -> float:
    return float(x.var(unbiased=True)) / x.numel() if x.numel() > 1 else 0.0
