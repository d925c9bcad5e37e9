"""The tests' small real corpus: ~160 KB of the running Python's own sources (no download, the same
on every machine with this Python). Importable from every test folder: pytest puts `tests/` on
sys.path for `tests/conftest.py`."""

from __future__ import annotations

import sysconfig
from pathlib import Path

FILES = ("argparse.py", "textwrap.py", "shlex.py")


def small_corpus_bytes() -> bytes:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return b"".join((lib / name).read_bytes() for name in FILES)


def write_small_corpus(folder: Path) -> Path:
    """The corpus as `folder/corpus.txt` (what a recipe's `corpus` path names)."""
    path = folder / "corpus.txt"
    path.write_bytes(small_corpus_bytes())
    return path
