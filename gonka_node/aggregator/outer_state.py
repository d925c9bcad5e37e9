"""The outer optimizer's state a close leaves beside each finalized round (`Store.outer_state_path`): the
momentum buffers as safetensors, the step count in its metadata (`close._save_durably` writes it)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor


def read_outer_state(path: Path) -> tuple[int, dict[str, Tensor]]:
    """(outer steps taken, momentum buffers) as saved after a round: `OuterOptimizer.restore`'s arguments."""
    with safe_open(str(path), "pt") as f:
        steps = int((f.metadata() or {}).get("steps", "0"))
    return steps, load_file(str(path))
