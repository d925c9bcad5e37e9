"""Durable file writes: a reader sees the old file or the new one, never half of one, even after a crash.

The one sequence: write a temporary file in the target's folder, fsync it, rename it onto the target,
fsync the folder (a rename is durable only once its directory entry is). Standard library only, so
the modules that must not load torch (keys, TLS) use it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder: a rename is durable only once its directory entry is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(tmp: Path, path: Path) -> None:
    """Move the finished file `tmp` (in `path`'s folder) onto `path`: fsync it, rename, fsync the folder."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a new 0600 temporary file beside `path`, then `durable_replace` it onto `path`;
    the temporary file is removed if anything fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        durable_replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with exactly `mode` (whatever the umask) holding `data`, fsync'd; refused if it
    exists or is a link, and removed again if writing fails (keys, TLS identities)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # the file is still empty here: never a moment with wider permissions
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
