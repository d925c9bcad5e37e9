"""training.durable: the one temp -> fsync -> rename -> fsync-dir sequence, and new files of an exact mode."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from training.durable import atomic_write, durable_replace, write_new_file


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.json"
    atomic_write(target, lambda tmp: tmp.write_text("one"))
    atomic_write(target, lambda tmp: tmp.write_text("two"))
    assert target.read_text() == "two" and os.listdir(target.parent) == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_durable_replace_moves_a_finished_file_or_folder(tmp_path: Path) -> None:
    (tmp_path / "part").write_bytes(b"payload")
    durable_replace(tmp_path / "part", tmp_path / "final")
    (tmp_path / "staged").mkdir()
    (tmp_path / "staged" / "f").write_text("x")
    durable_replace(tmp_path / "staged", tmp_path / "snap")
    assert (tmp_path / "final").read_bytes() == b"payload" and (tmp_path / "snap" / "f").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["final", "snap"]


def test_write_new_file_has_exactly_its_mode_whatever_the_umask_and_refuses_an_existing_file(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_new_file(tmp_path / "key.pem", b"secret", 0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "key.pem").stat().st_mode) == 0o600
    assert (tmp_path / "key.pem").read_bytes() == b"secret"
    with pytest.raises(FileExistsError):
        write_new_file(tmp_path / "key.pem", b"other", 0o600)
    assert (tmp_path / "key.pem").read_bytes() == b"secret"
