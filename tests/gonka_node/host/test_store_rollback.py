"""`HostStore.save_sent`'s rollback points (`before.pt`): linked to the file already holding the state,
kept as long as their round, and a file linked from the folder being replaced keeps its content."""

from __future__ import annotations

from pathlib import Path

import torch

from gonka_node.host.store import HostStore, RollbackPoint


def _state(x: float) -> dict[str, torch.Tensor]:
    return {"e": torch.full((4,), x)}


def test_a_rollback_point_is_a_link_to_the_state_file_it_names_and_survives_that_folder(tmp_path: Path) -> None:
    store = HostStore(tmp_path, epoch=1)
    store.save_sent(1, b"r1", b"\x01" * 32, _state(1.0), keep_previous=True, before=RollbackPoint(_state(0.0)))
    # Round 2 trained from the state round 1 left: linked, not written again.
    store.save_sent(2, b"r2", b"\x02" * 32, _state(2.0), keep_previous=True,
                    before=RollbackPoint(_state(1.0), store.sent_state_path(1)))
    assert store.before_path(2).stat().st_ino == store.sent_state_path(1).stat().st_ino
    # Round 2 refused: round 3 trained again from the state before round 2, linked from round 2's point.
    store.save_sent(3, b"r3", b"\x03" * 32, _state(3.0), keep_previous=True,
                    before=RollbackPoint(_state(1.0), store.before_path(2)))
    store.save_sent(4, b"r4", b"\x04" * 32, _state(4.0), keep_previous=True,
                    before=RollbackPoint(_state(3.0), store.sent_state_path(3)))
    assert store.sent_rounds() == [3, 4]  # rounds 1 and 2 dropped: their files' links still hold the state
    assert torch.equal(store.load_sent_before(3)["e"], _state(1.0)["e"])  # type: ignore[index]
    assert torch.equal(store.load_sent_before(4)["e"], _state(3.0)["e"])  # type: ignore[index]


def test_a_round_kept_again_from_its_own_rollback_point_keeps_it(tmp_path: Path) -> None:
    # A restarted host resumes from round 2's point (`before.pt`) and keeps round 2 again, trained from it:
    # the link is made before the old folder goes.
    store = HostStore(tmp_path, epoch=1)
    store.save_sent(2, b"first", b"\x02" * 32, _state(2.0), keep_previous=True, before=RollbackPoint(_state(1.0)))
    store.save_sent(2, b"again", b"\x02" * 32, _state(5.0), keep_previous=True,
                    before=RollbackPoint(_state(9.0), store.before_path(2)))  # the file, not the stand-in
    kept = store.load_sent(2)
    assert kept is not None and kept.payload == b"again"
    assert torch.equal(store.load_sent_before(2)["e"], _state(1.0)["e"])  # type: ignore[index]


def test_a_rollback_point_without_a_file_is_written(tmp_path: Path) -> None:
    store = HostStore(tmp_path, epoch=1)
    gone = tmp_path / "no-such-file.pt"
    store.save_sent(1, b"r1", b"\x01" * 32, _state(1.0), before=RollbackPoint(_state(0.5), gone))
    assert torch.equal(store.load_sent_before(1)["e"], _state(0.5)["e"])  # type: ignore[index]
    store.save_sent(2, b"r2", b"\x02" * 32, _state(2.0))
    assert store.load_sent_before(2) is None  # none given: none kept
