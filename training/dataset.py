"""Prepared datasets: pre-tokenized shards in an object store, named by the sha256 of their manifest.

Layout under a store prefix (a directory or `s3://bucket/prefix`):

    manifest.json            canonical JSON (sorted keys, no spaces); its sha256 is the dataset's name
    tokenizer.json           the tokenizer's file (absent for the byte tokenizer)
    train/00000.tok ...      training tokens of input unit 0, 1, ...: raw little-endian uint16 or uint32
    heldout/00000.tok ...    held-out tokens of the same units
    train/00000.json ...     a finished shard's record (resume); not part of the dataset's identity

Each document is followed by the tokenizer's end-of-text token. A document is held out when the first
8 bytes of sha256(its UTF-8 text) fall below `heldout_fraction` × 2^64: the split depends on content
only, so duplicated documents never straddle it. Windows are read over the concatenation of the train
shards (in manifest order), then of the held-out shards; see `open_windows`.

A host reads only the shards its windows fall in (`ShardCache`): each is downloaded once (a transient
store failure, a `ConnectionError` or `TimeoutError`, is retried a bounded number of times with
doubling waits), checked against the manifest's sha256 before it is used, and kept in a local folder
with a size limit (least recently used shards leave first). A file already in the folder (from an
earlier process) is hashed again the first time this process opens it; one that no longer matches is
deleted and fetched again, never read. The window ids and the assignment are the same pure functions as
for an in-memory corpus (`training.data.Windows`), so anyone can recompute who trains on what.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from training.data import Windows

DATASET_FORMAT = "gonka-dataset-v1"
MANIFEST_KEY = "manifest.json"
TOKENIZER_KEY = "tokenizer.json"
DEFAULT_CACHE_BYTES = 4 << 30
# Windows are assigned in blocks of about this many consecutive tokens (at least 64 blocks in all), so a
# host's round touches a few shards rather than every one (training.data.assign_positions).
ASSIGNMENT_BLOCK_TOKENS = 1 << 20
FETCH_ATTEMPTS = 4  # downloads of one shard before a transient failure is raised
FETCH_BACKOFF_S = 0.5  # wait before the second attempt; doubles after each failure

log = logging.getLogger(__name__)
# Cached files this process has hashed (path, inode, size): each is checked once, then trusted.
_verified: set[tuple[str, int, int]] = set()
_verified_lock = threading.Lock()


class DatasetError(ValueError):
    """A prepared dataset that cannot be used as it is; the message names the store and the shard."""


class ShardMissing(DatasetError):
    """The manifest names a shard the store does not hold."""


class ShardCorrupt(DatasetError):
    """A shard whose bytes do not hash to the manifest's sha256 (or whose size is wrong)."""


class ManifestMismatch(DatasetError):
    """The store's manifest is not the one the recipe names."""


class ShardSource(Protocol):
    """The part of `gonka_node.core.storage.ObjectStore` a reader needs (a missing key raises KeyError)."""

    uri: str

    def get_bytes(self, key: str) -> bytes: ...

    def download(self, key: str, path: Path) -> None: ...


@dataclass(frozen=True)
class Shard:
    key: str
    sha256: str
    tokens: int


@dataclass(frozen=True)
class Manifest:
    tokenizer_sha256: str  # "" for the byte tokenizer
    vocab_size: int
    eot_id: int
    dtype: str  # "uint16" or "uint32"
    heldout_fraction: float
    train: tuple[Shard, ...]
    heldout: tuple[Shard, ...]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in getattr(self, split))

    def to_json(self) -> bytes:
        body = {
            "format": DATASET_FORMAT,
            "tokenizer": {"sha256": self.tokenizer_sha256, "vocab_size": self.vocab_size, "eot_id": self.eot_id},
            "dtype": self.dtype,
            "heldout_fraction": self.heldout_fraction,
            "train": [s.__dict__ for s in self.train],
            "heldout": [s.__dict__ for s in self.heldout],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json()).hexdigest()

    @classmethod
    def from_json(cls, data: bytes, where: str = MANIFEST_KEY) -> Manifest:
        try:
            body = json.loads(data)
            if body.get("format") != DATASET_FORMAT:
                raise DatasetError(f"{where}: format {body.get('format')!r}, this node reads {DATASET_FORMAT!r}")
            tok = body["tokenizer"]
            return cls(
                str(tok["sha256"]), int(tok["vocab_size"]), int(tok["eot_id"]), _dtype(body["dtype"], where),
                float(body["heldout_fraction"]),
                tuple(Shard(str(s["key"]), str(s["sha256"]), int(s["tokens"])) for s in body["train"]),
                tuple(Shard(str(s["key"]), str(s["sha256"]), int(s["tokens"])) for s in body["heldout"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, DatasetError):
                raise
            raise DatasetError(f"{where}: not a {DATASET_FORMAT} manifest ({exc!r})") from None


def token_dtype(vocab_size: int) -> str:
    """The narrowest fixed width that holds every token id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _dtype(name: str, where: str) -> str:
    if name not in ("uint16", "uint32"):
        raise DatasetError(f"{where}: token dtype {name!r}; expected uint16 or uint32")
    return name


def read_manifest(source: ShardSource, expected_sha256: str = "") -> tuple[Manifest, str]:
    """The store's manifest and its sha256, refused when it differs from `expected_sha256` (if given)."""
    try:
        raw = source.get_bytes(MANIFEST_KEY)
    except KeyError:
        raise DatasetError(f"{source.uri}: no {MANIFEST_KEY}; prepare the dataset first (gonka-node data prepare)") from None
    digest = hashlib.sha256(raw).hexdigest()
    if expected_sha256 and digest != expected_sha256:
        raise ManifestMismatch(
            f"{source.uri}/{MANIFEST_KEY} has sha256 {digest}, the recipe records {expected_sha256}: "
            "this store holds another dataset"
        )
    return Manifest.from_json(raw, f"{source.uri}/{MANIFEST_KEY}"), digest


class ShardCache:
    """Verified local copies of shards, named by their sha256, at most `max_bytes` in all (LRU)."""

    def __init__(self, source: ShardSource, folder: Path, max_bytes: int = DEFAULT_CACHE_BYTES, *,
                 attempts: int = FETCH_ATTEMPTS, backoff_s: float = FETCH_BACKOFF_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.source = source
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.attempts, self.backoff_s, self._sleep = attempts, backoff_s, sleep
        self._open: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.downloads = 0
        self.retries = 0  # downloads retried after a transient failure

    def tokens(self, shard: Shard, dtype: str) -> np.ndarray:
        """The shard as a read-only memory map, fetched and verified first if not cached."""
        with self._lock:
            if shard.sha256 in self._open:
                self._open.move_to_end(shard.sha256)
                return self._open[shard.sha256]
            path = self.folder / f"{shard.sha256}.tok"
            itemsize = np.dtype(dtype).itemsize
            if not path.exists() or not self._still_valid(path, shard, itemsize):
                self._fetch(shard, path, itemsize)
            os.utime(path)  # recency for the eviction of files left by an earlier process
            mapped = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
            self._open[shard.sha256] = mapped
            self._evict(keep=shard.sha256)
            return mapped

    def _still_valid(self, path: Path, shard: Shard, itemsize: int) -> bool:
        """Whether a cached file is still the shard (hashed once per process; the disk may have rotted,
        or someone written to it, since it was verified); a file that is not is deleted."""
        stat = path.stat()
        key = (str(path.resolve()), stat.st_ino, stat.st_size)
        with _verified_lock:
            if key in _verified:
                return True
        try:
            _verify_file(path, shard, itemsize, str(path))
        except ShardCorrupt as exc:
            log.warning("%s; fetching it again", exc)
            path.unlink(missing_ok=True)
            return False
        _remember(path)
        return True

    def _fetch(self, shard: Shard, path: Path, itemsize: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".fetch.", suffix=".tmp")
        os.close(fd)
        try:
            self._download(shard, Path(tmp))
            _verify_file(Path(tmp), shard, itemsize, self.source.uri)
            os.replace(tmp, path)  # only a verified file ever carries the sha256 name
            _remember(path)
            self.downloads += 1
        finally:
            Path(tmp).unlink(missing_ok=True)

    def _download(self, shard: Shard, tmp: Path) -> None:
        """One shard into `tmp`, retried on transient failures (bounded, doubling waits)."""
        for attempt in range(self.attempts):
            try:
                self.source.download(shard.key, tmp)
                return
            except KeyError:
                raise ShardMissing(f"{self.source.uri}: shard {shard.key} named by the manifest is missing") from None
            except (ConnectionError, TimeoutError) as exc:
                if attempt + 1 == self.attempts:
                    raise
                wait = self.backoff_s * 2**attempt
                log.warning("%s: shard %s: %s; retrying in %.1f s (%d of %d)", self.source.uri, shard.key, exc,
                            wait, attempt + 2, self.attempts)
                self.retries += 1
                self._sleep(wait)

    def _evict(self, keep: str) -> None:
        files = sorted(self.folder.glob("*.tok"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                break
            if path.stem == keep:
                continue
            total -= path.stat().st_size
            self._open.pop(path.stem, None)  # an array still in use keeps its pages (unlinked inode)
            path.unlink(missing_ok=True)


def _remember(path: Path) -> None:
    stat = path.stat()
    with _verified_lock:
        _verified.add((str(path.resolve()), stat.st_ino, stat.st_size))


def _verify_file(path: Path, shard: Shard, itemsize: int, where: str) -> None:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    if size != shard.tokens * itemsize or digest.hexdigest() != shard.sha256:
        raise ShardCorrupt(
            f"{where}: shard {shard.key} has sha256 {digest.hexdigest()} and {size} bytes; the manifest "
            f"records {shard.sha256} and {shard.tokens * itemsize} bytes: re-upload it (gonka-node data prepare resumes)"
        )


class ShardedTokens:
    """A read-only token sequence over pieces of shards, sliced like an array, fetched on demand."""

    def __init__(self, cache: ShardCache, dtype: str, pieces: Sequence[tuple[Shard, int]]) -> None:
        # pieces: (shard, how many of its leading tokens belong to the sequence)
        self.cache = cache
        self.dtype = dtype
        self.pieces = [(s, n) for s, n in pieces if n > 0]
        self.starts = np.cumsum([0] + [n for _, n in self.pieces]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, where: slice) -> np.ndarray:
        start, stop, step = where.indices(len(self))
        if step != 1:
            raise IndexError("ShardedTokens reads contiguous ranges only")
        parts = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            shard, _ = self.pieces[i]
            offset = start - int(self.starts[i])
            take = min(stop, int(self.starts[i + 1])) - start
            parts.append(self.cache.tokens(shard, self.dtype)[offset : offset + take])
            start += take
            i += 1
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])


def _trimmed(shards: Sequence[Shard], keep: int) -> list[tuple[Shard, int]]:
    """The shards' first `keep` tokens, as (shard, count) pieces."""
    pieces = []
    for shard in shards:
        take = min(shard.tokens, keep)
        pieces.append((shard, take))
        keep -= take
    return pieces


def open_windows(manifest: Manifest, cache: ShardCache, seq_len: int) -> Windows:
    """`Windows` over a prepared dataset: training windows are ids 0..n_train-1 (the train shards),
    held-out windows follow (the held-out shards); nothing is read until a window is stacked."""
    width = seq_len + 1
    n_train = manifest.tokens("train") // width
    n_heldout = manifest.tokens("heldout") // width
    if n_train < 1 or n_heldout < 1:
        raise DatasetError(
            f"the dataset has {n_train} training and {n_heldout} held-out windows of {width} tokens; each "
            "split needs at least one: add data, raise --heldout-fraction or shorten seq_len"
        )
    pieces = _trimmed(manifest.train, n_train * width) + _trimmed(manifest.heldout, n_heldout * width)
    tokens = ShardedTokens(cache, manifest.dtype, pieces)
    block = max(1, min(ASSIGNMENT_BLOCK_TOKENS // width, n_train // 64))
    return Windows(tokens, seq_len, heldout_start=n_train, assignment_block=block)


def verify_all(manifest: Manifest, source: ShardSource, folder: Path) -> list[str]:
    """Fetch and check every shard once (no cache limit applies); the problems found, one line each."""
    problems = []
    cache = ShardCache(source, folder, max_bytes=0)
    for shard in (*manifest.train, *manifest.heldout):
        try:
            cache.tokens(shard, manifest.dtype)
        except DatasetError as exc:
            problems.append(str(exc))
    return problems


def shard_record(shard: Shard) -> bytes:
    return json.dumps(shard.__dict__, sort_keys=True).encode()


def parse_record(raw: bytes) -> Shard | None:
    try:
        body: dict[str, Any] = json.loads(raw)
        return Shard(str(body["key"]), str(body["sha256"]), int(body["tokens"]))
    except (ValueError, KeyError, TypeError):
        return None
