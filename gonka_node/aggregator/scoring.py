"""Score one contribution: does applying its update alone help on *its* data more than on anyone's?

gain(D) = L(θ; D) − L(θ − Δ; D): the loss drop on batch D when the host's own update Δ (DiLoCo's
pseudo-gradient, θ_global − θ_local) is applied alone to the round's base model θ, i.e. the host's
local model is reconstructed. The score is

    score = mean gain(assigned windows of the host's slot) − mean gain(random held-out windows)
            − 2 · (standard error of that difference, from the per-window gains)

A host that trained on its assignment fits those windows better than unseen text: score > 0. A host
that trained on other data improves both alike (score ≈ 0), and noise hurts both alike (≈ 0) or
hurts its assignment (< 0). The held-out sample is drawn per round from a seed the hosts cannot know
in advance (it includes the base checkpoint hash), so it cannot be trained on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

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

    def assigned(self, round_index: int, slot: int) -> Batch:
        ids = self.windows.assignment(
            epoch_seed=self.epoch_seed,
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


@dataclass(frozen=True)
class Score:
    score: float  # lower confidence bound of gain_assigned − gain_heldout
    gain_assigned: float
    gain_heldout: float
    stderr: float

    def reasons(self) -> list[str]:
        return [
            f"score {self.score:+.5f} = gain on assignment {self.gain_assigned:+.5f} − gain on held-out "
            f"{self.gain_heldout:+.5f} − {CONFIDENCE_Z:g}×stderr {self.stderr:.5f}"
        ]


class Scorer:
    """One model loaded with the round's base weights; scores updates one at a time (memory: 2 models)."""

    def __init__(self, model: nn.Module, base: Mapping[str, Tensor], heldout: Batch) -> None:
        self.model = model
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
            p.copy_(base if delta is None else base - delta[name].to(base.dtype))

    def score(self, delta: Mapping[str, Tensor], assigned: Batch) -> Score:
        """Per-window gains on both sets; the score is the difference of their means minus
        CONFIDENCE_Z standard errors, so an update whose apparent advantage is within what window-to-window
        variation explains (noise, training on other data) scores at or below zero."""
        self._load(None)
        before_a = self._losses(assigned)
        self._load(delta)
        gain_a = before_a - self._losses(assigned)
        gain_h = self.heldout_base - self._losses(self.heldout)
        stderr = math.sqrt(_var_of_mean(gain_a) + _var_of_mean(gain_h))
        diff = float(gain_a.mean() - gain_h.mean())
        return Score(diff - CONFIDENCE_Z * stderr, float(gain_a.mean()), float(gain_h.mean()), stderr)


def _var_of_mean(x: Tensor) -> float:
    return float(x.var(unbiased=True)) / x.numel() if x.numel() > 1 else 0.0
