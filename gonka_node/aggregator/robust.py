"""Combine accepted pseudo-gradients, streaming: memory is a few models whatever the host count.

Updates are read through `source()`, a callable returning a fresh iterator of (host key, update) in
strictly increasing key order, so a rule may make several passes (decoding from disk each time)
instead of holding every host's update at once. Rules (chosen per epoch):

- `mean`: the plain average.
- `clip_median`: each update scaled down to at most the median update norm, then averaged: one
  host cannot pull the average further than an honest-sized step.
- `centered_clip`: Byzantine-robust centered clipping (Karimireddy, He & Jaggi, 2021):
  v ← v + mean_i clip(Δ_i − v, τ), τ = median distance ‖Δ_i − v‖, starting from `clip_median`'s
  result; each iteration is two more streaming passes (distances, then the clipped mean). Works on any codec's decoded updates (dense or sparse).

All arithmetic is fp32 element-wise in a fixed (sorted host, sorted name) order, as in
`training.diloco.StreamingAverager`, so the result is reproducible from the same inputs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from training.diloco import StreamingAverager

UpdateSource = Callable[[], Iterator[tuple[str, Mapping[str, Tensor]]]]


@dataclass(frozen=True)
class Aggregate:
    update: dict[str, Tensor]
    rule: str
    clip_norm: float | None


def aggregate(
    rule: str,
    source: UpdateSource,
    norms: Mapping[str, float],
    spec: Mapping[str, tuple[int, ...]],
    centered_clip_iters: int = 3,
) -> Aggregate:
    if not norms:
        raise ValueError("aggregate: no updates to combine")
    if rule == "mean":
        return Aggregate(_mean(source(), spec, None), rule, None)
    tau = float(statistics.median(norms.values()))
    clipped = _mean(source(), spec, tau)
    if rule == "clip_median":
        return Aggregate(clipped, rule, tau)
    if rule == "centered_clip":
        v = clipped
        for _ in range(centered_clip_iters):
            # τ: the median distance to the current centre (one extra pass), so honest updates sit
            # inside the clip ball and far-away ones are pulled in to its edge.
            tau = float(statistics.median(_norm({n: u[n].float() - v[n] for n in spec}) for _, u in source()))
            v = _centered_step(v, source(), spec, tau)
        return Aggregate(v, rule, tau)
    raise ValueError(f"aggregate: unknown rule {rule!r} (mean, clip_median, centered_clip)")


def _norm(update: Mapping[str, Tensor]) -> float:
    return math.sqrt(sum(float(update[n].double().square().sum()) for n in sorted(update)))


def _scale(update: Mapping[str, Tensor], tau: float | None) -> Mapping[str, Tensor]:
    if tau is None:
        return update
    norm = _norm(update)
    if norm <= tau or norm == 0.0:
        return update
    factor = torch.tensor(tau / norm, dtype=torch.float32)
    return {n: t.float() * factor for n, t in update.items()}


def _mean(
    updates: Iterator[tuple[str, Mapping[str, Tensor]]],
    spec: Mapping[str, tuple[int, ...]],
    tau: float | None,
) -> dict[str, Tensor]:
    avg = StreamingAverager(spec)
    for key, update in updates:
        avg.add(key, _scale(update, tau))
    return avg.result()


def _centered_step(
    v: Mapping[str, Tensor],
    updates: Iterator[tuple[str, Mapping[str, Tensor]]],
    spec: Mapping[str, tuple[int, ...]],
    tau: float,
) -> dict[str, Tensor]:
    avg = StreamingAverager(spec)
    for key, update in updates:
        diff = {n: update[n].float() - v[n] for n in sorted(spec)}
        avg.add(key, _scale(diff, tau))
    step = avg.result()
    return {n: v[n] + step[n] for n in sorted(spec)}
