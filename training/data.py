"""Tokens, corpora, windows, and who trains on which window.

A corpus is a sorted list of files, tokenised byte by byte and joined with a NUL byte between
documents. Its identity is `manifest_sha256`: sha256 over a text manifest naming the tokenizer and,
per file, its content sha256, size and relative path. That hash goes on chain as the epoch's data
manifest hash; the token array is cached on disk under it.

The token array is cut into non-overlapping windows of `seq_len + 1` tokens (inputs are the first
`seq_len`, targets the last `seq_len`), so no token appears in two windows. A fixed pseudo-random
subset of windows is held out for evaluation; the rest are training windows.

Assignment: training windows are visited in a pseudo-random order (one permutation per pass over
the data, seeded by the epoch seed and the pass number). Round r, host slot s takes positions
[(r * max_slots + s) * k, ... + k) of that endless sequence (k = windows per host). Hosts and rounds
never share a window until the data is exhausted; then the sequence continues with pass + 1, a new
permutation. All randomness comes from numpy's legacy `RandomState` (MT19937), whose streams numpy
guarantees never to change, seeded from sha256 of a text key: anyone can recompute an assignment.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import torch

from training.durable import atomic_write

CORPUS_FORMAT = "gonka-corpus-v1"
DOCUMENT_SEPARATOR = 0  # NUL never occurs in text, so it marks document boundaries unambiguously
DEFAULT_HELDOUT_FRACTION = 0.02
BUILTIN_MAX_BYTES = 8_000_000

Batch = tuple[torch.Tensor, torch.Tensor]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, lossless."""

    name = "byte-v1"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8; show it rather than fail.
        return bytes(tokens).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class CorpusFile:
    relpath: str  # posix, relative to the folder given (or the bare name for a file)
    path: Path
    size: int
    sha256: str


def _seeded_state(key: str) -> np.random.RandomState:
    words = np.frombuffer(hashlib.sha256(key.encode()).digest(), dtype="<u4")
    return np.random.RandomState(words)


def _walk(folder: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # skip .git and friends
        found += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    return found


def _describe(path: Path, relpath: str) -> CorpusFile:
    if "\n" in relpath or "\r" in relpath:
        raise ValueError(f"corpus file name {relpath!r} contains a line break; rename it")
    data = path.read_bytes()
    return CorpusFile(relpath, path, len(data), hashlib.sha256(data).hexdigest())


def corpus_files(paths: Sequence[str | Path]) -> list[CorpusFile]:
    """Files named directly or found (recursively, hidden entries skipped) in folders, sorted by relpath.

    A file's relpath is its name; a folder's files are `<folder name>/<path inside it>`.
    """
    entries: dict[str, Path] = {}
    for given in map(Path, paths):
        if given.is_file():
            pairs = [(given.name, given)]
        elif given.is_dir():
            pairs = [(f"{given.name}/{p.relative_to(given).as_posix()}", p) for p in _walk(given)]
        else:
            raise FileNotFoundError(f"corpus path {given} is neither a file nor a folder")
        for relpath, path in pairs:
            if relpath in entries:
                raise ValueError(
                    f"two corpus files share the relative path {relpath!r}: {entries[relpath]}, {path}"
                )
            entries[relpath] = path
    if not entries:
        raise ValueError(f"no corpus files found in {[str(p) for p in paths]}")
    return [_describe(entries[rel], rel) for rel in sorted(entries, key=lambda r: r.encode())]


def builtin_corpus_files(max_bytes: int = BUILTIN_MAX_BYTES) -> list[CorpusFile]:
    """The running Python's standard-library `.py` sources, sorted, the first `max_bytes` of them.

    The set depends on the Python version; the manifest hash on chain pins which one an epoch used.
    Installed packages (`site-packages`) are not part of it.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(
        (p.relative_to(stdlib).as_posix(), p)
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )
    chosen, total = [], 0
    for relpath, path in candidates:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(_describe(path, relpath))
        total += size
    return chosen


def manifest_text(files: Sequence[CorpusFile], tokenizer: ByteTokenizer | None = None) -> str:
    """The canonical manifest: a header line, a tokenizer line, then `sha256 size relpath` per file."""
    tok = tokenizer or ByteTokenizer()
    lines = [CORPUS_FORMAT, f"tokenizer {tok.name} separator {DOCUMENT_SEPARATOR}"]
    lines += [f"{f.sha256} {f.size} {f.relpath}" for f in files]
    return "\n".join(lines) + "\n"


def _write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Concurrent builders (the processes of a rig) each write a temporary file and rename it."""

    def to_file(tmp: Path) -> None:
        with tmp.open("wb") as handle:
            write(handle)

    atomic_write(path, to_file)


class TokenCorpus:
    """The token array of a list of files, cached on disk under the manifest hash."""

    def __init__(self, files: Sequence[CorpusFile], tokens: np.ndarray, cache_hit: bool) -> None:
        self.files = tuple(files)
        self.tokens = tokens
        self.cache_hit = cache_hit
        self.manifest = manifest_text(self.files)
        self.manifest_sha256 = hashlib.sha256(self.manifest.encode()).hexdigest()

    @classmethod
    def from_files(cls, files: Sequence[CorpusFile], cache_dir: str | Path | None = None) -> TokenCorpus:
        if not files:
            raise ValueError("a corpus needs at least one file")
        expected_len = sum(f.size for f in files) + len(files)
        digest = hashlib.sha256(manifest_text(files).encode()).hexdigest()
        cache = Path(cache_dir) / f"{digest}.tokens.npy" if cache_dir is not None else None
        if cache is not None and cache.exists():
            try:
                tokens = np.load(cache, mmap_mode="r")
            except (ValueError, OSError):
                tokens = None  # a damaged cache file is rebuilt below
            if tokens is not None and tokens.dtype == np.uint8 and tokens.shape == (expected_len,):
                return cls(files, tokens, cache_hit=True)
        tokens = cls._tokenize(files, expected_len)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            manifest = manifest_text(files).encode()
            _write_atomically(cache.parent / f"{digest}.manifest.txt", lambda handle: handle.write(manifest))
            _write_atomically(cache, lambda handle: np.save(handle, tokens))
        return cls(files, tokens, cache_hit=False)

    @staticmethod
    def _tokenize(files: Sequence[CorpusFile], expected_len: int) -> np.ndarray:
        tokens = np.empty(expected_len, dtype=np.uint8)
        offset = 0
        for f in files:
            data = f.path.read_bytes()
            if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
                raise ValueError(f"corpus file {f.path} changed while the corpus was being built; retry")
            tokens[offset : offset + f.size] = np.frombuffer(data, dtype=np.uint8)
            tokens[offset + f.size] = DOCUMENT_SEPARATOR
            offset += f.size + 1
        return tokens

    @classmethod
    def from_paths(cls, paths: Sequence[str | Path], cache_dir: str | Path | None = None) -> TokenCorpus:
        return cls.from_files(corpus_files(paths), cache_dir)

    @classmethod
    def builtin(cls, cache_dir: str | Path | None = None, max_bytes: int = BUILTIN_MAX_BYTES) -> TokenCorpus:
        return cls.from_files(builtin_corpus_files(max_bytes), cache_dir)

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, seq_len: int, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> Windows:
        return Windows(self.tokens, seq_len, heldout_fraction)


def window_seed(epoch_seed: int, beacon: bytes = b"") -> int:
    """The seed of the window assignment: the epoch seed alone, or mixed with a beacon (randomness that
    exists only after sign-in closed, e.g. a block hash), so nobody can compute an assignment earlier."""
    if not beacon:
        return epoch_seed
    digest = hashlib.sha256(b"gonka-window-seed-v1" + epoch_seed.to_bytes(8, "big") + bytes(beacon)).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # non-negative, as assign_positions requires


@functools.lru_cache(maxsize=8)
def _pass_permutation(epoch_seed: int, pass_index: int, n: int) -> np.ndarray:
    return _seeded_state(f"gonka-assign-v1:{epoch_seed}:{pass_index}:{n}").permutation(n)


def assign_positions(
    n_train: int, *, epoch_seed: int, round_index: int, slot: int, max_slots: int, windows_per_host: int,
    block: int = 1,
) -> np.ndarray:
    """Indices into the sorted training windows for (epoch seed, round, host slot); see the module doc.

    Pure: depends on its arguments only. Slots run 0 .. max_slots-1 (the host's place in the epoch's
    sign-in order); an unused slot's windows are simply not trained on that round.

    `block` > 1 permutes blocks of that many consecutive windows instead of single windows (a prepared
    dataset: a host's windows then fall in a few shards, which it fetches whole), and shuffles the
    host's windows of the round among themselves so a micro-batch does not hold one document's run.
    """
    if n_train <= 0:
        raise ValueError("there are no training windows to assign")
    if max_slots <= 0 or windows_per_host <= 0 or round_index < 0 or epoch_seed < 0:
        raise ValueError(
            f"need max_slots > 0, windows_per_host > 0, round >= 0, epoch_seed >= 0; got "
            f"{max_slots=}, {windows_per_host=}, {round_index=}, {epoch_seed=}"
        )
    if not 0 <= slot < max_slots:
        raise ValueError(f"host slot {slot} is outside 0..{max_slots - 1}")
    start = (round_index * max_slots + slot) * windows_per_host
    positions = np.arange(start, start + windows_per_host, dtype=np.int64)
    passes, offsets = np.divmod(positions, n_train)
    out = np.empty(windows_per_host, dtype=np.int64)
    for pass_index in np.unique(passes):
        mask = passes == pass_index
        if block <= 1:
            out[mask] = _pass_permutation(epoch_seed, int(pass_index), n_train)[offsets[mask]]
        else:
            out[mask] = _block_order(epoch_seed, int(pass_index), n_train, block)[offsets[mask]]
    if block > 1:
        key = f"gonka-assign-order-v1:{epoch_seed}:{round_index}:{slot}:{max_slots}"
        out = out[_seeded_state(key).permutation(windows_per_host)]
    return out


def _block_order(epoch_seed: int, pass_index: int, n: int, block: int) -> _BlockOrder:
    return _BlockOrder(_pass_permutation(epoch_seed, pass_index, -(-n // block)), n, block)


class _BlockOrder:
    """Pass order of windows when blocks of `block` consecutive windows are permuted: position → window
    without materialising the n-window sequence (only the block permutation, n / block entries)."""

    def __init__(self, block_perm: np.ndarray, n: int, block: int) -> None:
        sizes = np.minimum(block, n - block_perm * block)  # the last block may be short
        self.block_perm, self.block = block_perm, block
        self.starts = np.concatenate([[0], np.cumsum(sizes)])

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        which = np.searchsorted(self.starts, positions, side="right") - 1
        return self.block_perm[which] * self.block + (positions - self.starts[which])


class TokenArray(Protocol):
    """What `Windows` reads tokens from: an in-memory array, or shards fetched on demand
    (training/dataset.py's ShardedTokens), sliced by window."""

    def __len__(self) -> int: ...

    def __getitem__(self, where: slice, /) -> np.ndarray: ...


class Windows:
    """Non-overlapping `seq_len + 1`-token windows of a token array, split into train and held-out."""

    def __init__(
        self,
        tokens: TokenArray,
        seq_len: int,
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
        heldout_start: int | None = None,
        assignment_block: int = 1,
    ):
        """`heldout_start`: a prepared dataset's split (windows from that id on are held out, see
        training/dataset.py); without it a pseudo-random `heldout_fraction` of the windows is.
        `assignment_block`: consecutive windows assigned together (`assign_positions`' block)."""
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.assignment_block = assignment_block
        self.n_windows = len(tokens) // (seq_len + 1)
        if self.n_windows < 2:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens: fewer than 2 windows of {seq_len + 1}; "
                "add data or shorten seq_len"
            )
        if heldout_start is not None:
            self.train_ids = np.arange(heldout_start, dtype=np.int64)
            self.heldout_ids = np.arange(heldout_start, self.n_windows, dtype=np.int64)
            return
        n_heldout = min(max(1, round(self.n_windows * heldout_fraction)), self.n_windows - 1)
        # The split depends on the corpus and seq_len only, so every epoch on the same data shares it.
        order = _seeded_state(f"gonka-heldout-v1:{self.n_windows}").permutation(self.n_windows)
        self.heldout_ids = np.sort(order[:n_heldout])
        self.train_ids = np.sort(order[n_heldout:])

    def assignment(
        self, *, epoch_seed: int, round_index: int, slot: int, max_slots: int, windows_per_host: int
    ) -> np.ndarray:
        """Window ids (into this array) a host slot trains on in a round."""
        positions = assign_positions(
            len(self.train_ids),
            epoch_seed=epoch_seed,
            round_index=round_index,
            slot=slot,
            max_slots=max_slots,
            windows_per_host=windows_per_host,
            block=self.assignment_block,
        )
        return self.train_ids[positions]

    def sample_heldout(self, seed: int, n: int) -> np.ndarray:
        """`n` held-out window ids drawn from `seed` (with replacement only if n exceeds the split)."""
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        state = _seeded_state(f"gonka-heldout-sample-v1:{seed}")
        picks = state.choice(len(self.heldout_ids), size=n, replace=n > len(self.heldout_ids))
        return self.heldout_ids[picks]

    def stack(self, ids: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Windows as a (len(ids), seq_len + 1) int64 tensor."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_windows):
            raise IndexError(f"window ids must lie in 0..{self.n_windows - 1}")
        width = self.seq_len + 1
        rows = [np.asarray(self.tokens[i * width : (i + 1) * width]) for i in ids.tolist()]
        return (
            torch.from_numpy(np.stack(rows).astype(np.int64))
            if rows
            else torch.empty(0, width, dtype=torch.long)
        )

    def batches(self, ids: Sequence[int] | np.ndarray, micro_batch: int) -> Iterator[Batch]:
        """(inputs, targets) micro-batches over `ids` in order; a short last batch is kept."""
        if micro_batch <= 0:
            raise ValueError(f"micro_batch must be positive, got {micro_batch}")
        ids = np.asarray(ids, dtype=np.int64)
        for start in range(0, len(ids), micro_batch):
            window = self.stack(ids[start : start + micro_batch])
            yield window[:, :-1], window[:, 1:]
