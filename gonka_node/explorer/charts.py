"""Charts as server-made SVG: no JavaScript library, nothing fetched at run time, text escaped like
the rest of the page (`markup.el`). They scale to the width of the screen (viewBox, width 100%)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gonka_node.explorer.markup import Markup, el

W, H = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 36


def short(address: str) -> str:
    return f"{address[:6]}…{address[-4:]}" if len(address) > 12 else address


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / count for i in range(count + 1)]


def loss_chart(points: Sequence[Mapping[str, Any]]) -> Markup:
    """Held-out loss against round: one circle per point (class loss-point), joined by a line."""
    if not points:
        return el("p", "No held-out loss reported yet.", class_="empty")
    rounds = [int(p["round"]) for p in points]
    losses = [float(p["loss"]) for p in points]
    lo, hi = min(losses), max(losses)
    pad = (hi - lo) * 0.1 or 0.05
    lo, hi = lo - pad, hi + pad
    span = max(rounds) or 1

    def x(r: float) -> float:
        return LEFT + (W - LEFT - RIGHT) * r / span

    def y(v: float) -> float:
        return TOP + (H - TOP - BOTTOM) * (hi - v) / (hi - lo)

    grid = [
        [el("line", x1=LEFT, x2=W - RIGHT, y1=f"{y(t):.1f}", y2=f"{y(t):.1f}", class_="grid"),
         el("text", f"{t:.3f}", x=LEFT - 6, y=f"{y(t) + 4:.1f}", class_="tick", text_anchor="end")]
        for t in _ticks(lo, hi)
    ]
    step = max(1, math.ceil(span / 10))
    xticks = [el("text", r, x=f"{x(r):.1f}", y=H - BOTTOM + 16, class_="tick", text_anchor="middle")
              for r in range(0, span + 1, step)]
    line = el("polyline", points=" ".join(f"{x(r):.1f},{y(v):.1f}" for r, v in zip(rounds, losses, strict=True)),
              class_="series")
    dots = [el("circle", el("title", f"round {r}: {v:.4f}"), cx=f"{x(r):.1f}", cy=f"{y(v):.1f}", r=4,
               class_="loss-point", data_round=r, data_loss=f"{v:.6f}")
            for r, v in zip(rounds, losses, strict=True)]
    label = el("text", "round (0 = initial model)", x=(LEFT + W - RIGHT) / 2, y=H - 4, class_="axis",
               text_anchor="middle")
    return el("svg", grid, xticks, line, dots, label, viewBox=f"0 0 {W} {H}", class_="chart", id="loss-chart",
              role="img", aria_label="held-out loss by round")


def bytes_chart(per_host: Mapping[str, int], allreduce: int | None) -> Markup:
    """Bytes each host uploaded over the epoch against all-reduce of every inner step (log scale)."""
    if not per_host:
        return el("p", "No uploads reported yet.", class_="empty")
    bars = [(short(h), n, "bar") for h, n in per_host.items()]
    if allreduce:
        bars.append(("all-reduce", allreduce, "bar baseline"))
    top = math.log10(max(1, *(n for _, n, _ in bars)) * 10)
    row_h, label_w = 26, 110
    height = row_h * len(bars) + 8

    def width(n: int) -> float:
        return max(1.0, (W - label_w - 90) * math.log10(max(n, 1)) / top)

    rows = [
        [el("text", name, x=label_w - 6, y=i * row_h + 18, class_="tick", text_anchor="end"),
         el("rect", x=label_w, y=i * row_h + 5, width=f"{width(n):.1f}", height=row_h - 10, class_=kind,
            data_bytes=n),
         el("text", human_bytes(n), x=f"{label_w + width(n) + 6:.1f}", y=i * row_h + 18, class_="tick")]
        for i, (name, n, kind) in enumerate(bars)
    ]
    return el("svg", rows, viewBox=f"0 0 {W} {height}", class_="chart", id="bytes-chart", role="img",
              aria_label="bytes per host against all-reduce (log scale)")
