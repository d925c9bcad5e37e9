"""A rig round's moves onto other bases partway (an eager round's late forecast and merge, training/overlap.py),
from the rig's side: after a move's step the rig's processes wait for the target the daemon writes into
the mailbox (`training.rig_service.Mailbox.move_path`) once it has seen that step reported."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class OrderReplaced(Exception):
    """The daemon posted another order while this round waited for a move: the round is given up."""


@dataclass(frozen=True)
class RigMove:
    """One of a round's moves, from the rig's side: after `step` inner steps, wait for the daemon's files."""

    step: int
    target: Path
    shift: Path
    replaced: Callable[[], bool]  # whether the daemon posted another order meanwhile
    poll_s: float = 0.05

    def wait(self) -> tuple[Path, Path | None]:
        """(the target's file, the shift's when the daemon wrote one), once the target's is there
        (written last); OrderReplaced when the daemon gave the round up."""
        while not self.target.exists():
            if self.replaced():
                raise OrderReplaced(f"the round's move at step {self.step} was given up by the daemon")
            time.sleep(self.poll_s)
        return self.target, self.shift if self.shift.exists() else None
