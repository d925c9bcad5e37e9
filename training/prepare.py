"""Prepare a dataset once: read text, jsonl or parquet, tokenize on all cores, write shards and a manifest.

The input is cut into *units* of about `unit_bytes` of text, in input order (files in the order
given). Unit i becomes shards `train/i.tok` and `heldout/i.tok` (training/dataset.py describes the
layout and the split), written by a worker process each. Memory stays bounded: the reader holds at
most `2 × workers` units at a time and a text file is read in pieces (a piece longer than a unit is
cut at a line break and continued in the next unit; its end-of-text token follows the last piece).

Resumable: a unit's record (`train/i.json`) is written only after both of its shards are stored, so a
second run after a crash skips every recorded unit (the input is re-read to find unit boundaries, but
not re-tokenized) and redoes the rest. The manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool, ThreadPool
from pathlib import Path
from typing import Protocol

import numpy as np

from training.dataset import (
    MANIFEST_KEY,
    TOKENIZER_KEY,
    DatasetError,
    Manifest,
    Shard,
    parse_record,
    shard_record,
    token_dtype,
)
from training.tokenizer import Bytes, HFTokenizer

DEFAULT_UNIT_BYTES = 32 << 20
Piece = tuple[str, bool]  # (text, ends a document)


class ShardSink(Protocol):
    """The part of `gonka_node.core.storage.ObjectStore` that preparation writes through."""

    uri: str

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, path: Path) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...


@dataclass(frozen=True)
class Progress:
    units_done: int
    units_skipped: int
    tokens: int
    seconds: float


# ---- reading ---------------------------------------------------------------------------------------


def _text_pieces(path: Path, unit_bytes: int) -> Iterator[Piece]:
    """A text file is one document, read in line-aligned pieces of at most ~unit_bytes."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        buf: list[str] = []
        size = 0
        for line in handle:
            buf.append(line)
            size += len(line)
            if size >= unit_bytes:
                yield "".join(buf), False
                buf, size = [], 0
        yield "".join(buf), True


def _jsonl_pieces(path: Path, field: str) -> Iterator[Piece]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError):
                raise DatasetError(f"{path}:{number}: not a JSON object with a string field {field!r}") from None
            if not isinstance(text, str):
                raise DatasetError(f"{path}:{number}: field {field!r} is not a string")
            yield text, True


def _parquet_pieces(path: Path, field: str) -> Iterator[Piece]:
    import pyarrow.parquet as pq  # only parquet input needs it

    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError variants
        raise DatasetError(f"{path}: not a parquet file: {exc}") from None
    if field not in reader.schema_arrow.names:
        raise DatasetError(f"{path}: no column {field!r}; columns: {reader.schema_arrow.names}")
    for batch in reader.iter_batches(batch_size=1024, columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text), True


def input_pieces(paths: Sequence[Path], unit_bytes: int, field: str = "text") -> Iterator[Piece]:
    """Every document of the inputs in order; `.jsonl`/`.parquet` by suffix, anything else is text."""
    for path in paths:
        if not path.is_file():
            raise DatasetError(f"input {path} is not a file")
        if path.suffix == ".jsonl":
            yield from _jsonl_pieces(path, field)
        elif path.suffix == ".parquet":
            yield from _parquet_pieces(path, field)
        else:
            yield from _text_pieces(path, unit_bytes)


def units(pieces: Iterator[Piece], unit_bytes: int) -> Iterator[list[Piece]]:
    unit: list[Piece] = []
    size = 0
    for piece in pieces:
        unit.append(piece)
        size += len(piece[0])
        if size >= unit_bytes:
            yield unit
            unit, size = [], 0
    if unit:
        yield unit


# ---- tokenizing (worker processes) -------------------------------------------------------------------

_WORKER: dict[str, object] = {}


def _init_worker(tokenizer_json: bytes, dtype: str, folder: str) -> None:
    _WORKER["tokenizer"] = HFTokenizer(tokenizer_json) if tokenizer_json else Bytes()
    _WORKER["dtype"] = dtype
    _WORKER["folder"] = folder


def is_heldout(text: str, fraction: float) -> bool:
    """Content decides: the first 8 bytes of sha256(text) below fraction × 2^64."""
    draw = int.from_bytes(hashlib.sha256(text.encode("utf-8", errors="replace")).digest()[:8], "big")
    return draw < int(fraction * 2**64)


def _tokenize_unit(index: int, pieces: list[Piece], fraction: float) -> tuple[Shard, Shard]:
    tok = _WORKER["tokenizer"]
    assert isinstance(tok, Bytes | HFTokenizer)
    dtype = str(_WORKER["dtype"])
    encoded = _encode(tok, [text for text, _ in pieces], dtype)
    eot = np.asarray([tok.eot_id], dtype=dtype)
    splits: dict[str, list[np.ndarray]] = {"train": [], "heldout": []}
    for (text, ends), ids in zip(pieces, encoded, strict=True):
        arr = np.concatenate([ids, eot]) if ends else ids
        splits["heldout" if is_heldout(text, fraction) else "train"].append(arr)
    out = []
    for split in ("train", "heldout"):
        tokens = np.concatenate(splits[split]) if splits[split] else np.empty(0, dtype=dtype)
        out.append(_write_shard(f"{split}/{index:05d}.tok", tokens.astype(np.dtype(dtype).newbyteorder("<"))))
    return out[0], out[1]


def _encode(tok: Bytes | HFTokenizer, texts: list[str], dtype: str) -> list[np.ndarray]:
    if isinstance(tok, Bytes):  # a list of Python ints per byte would cost 30x the memory
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]
    return [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch(texts)]


def _write_shard(key: str, tokens: np.ndarray) -> Shard:
    path = Path(str(_WORKER["folder"])) / key
    path.parent.mkdir(parents=True, exist_ok=True)
    data = tokens.tobytes()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return Shard(key, hashlib.sha256(data).hexdigest(), len(tokens))


# ---- the driver --------------------------------------------------------------------------------------


def _recorded(sink: ShardSink, index: int) -> tuple[Shard, Shard] | None:
    try:
        body = json.loads(sink.get_bytes(f"train/{index:05d}.json"))
        train = parse_record(json.dumps(body["train"]).encode())
        heldout = parse_record(json.dumps(body["heldout"]).encode())
    except (KeyError, ValueError, TypeError):
        return None
    return (train, heldout) if train is not None and heldout is not None else None


def _store_unit(sink: ShardSink, staging: Path, index: int, shards: tuple[Shard, Shard], local: bool) -> None:
    for shard in shards:
        if not local:
            sink.put_file(shard.key, staging / shard.key)
            (staging / shard.key).unlink()
    record = {"train": json.loads(shard_record(shards[0])), "heldout": json.loads(shard_record(shards[1]))}
    sink.put_bytes(f"train/{index:05d}.json", json.dumps(record, sort_keys=True).encode())


def prepare(
    inputs: Sequence[Path],
    sink: ShardSink,
    tokenizer_json: bytes = b"",
    *,
    local_root: Path | None = None,
    heldout_fraction: float = 0.01,
    unit_bytes: int = DEFAULT_UNIT_BYTES,
    workers: int | None = None,
    field: str = "text",
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[Manifest, str]:
    """Tokenize `inputs` into `sink`; return the manifest and its sha256 (the dataset's name).

    `local_root`: the sink's own folder when it is a local directory (workers then write in place);
    otherwise shards are staged in a temporary folder and uploaded one unit at a time."""
    if not 0.0 < heldout_fraction < 1.0:
        raise DatasetError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    tok = HFTokenizer(tokenizer_json) if tokenizer_json else Bytes()
    dtype = token_dtype(tok.vocab_size)
    workers = workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="gonka-prepare-") as tmp:
        staging = local_root if local_root is not None else Path(tmp)
        done = _run(inputs, sink, staging, local_root is not None, (tokenizer_json, dtype, heldout_fraction),
                    unit_bytes, workers, field, on_progress)
    manifest = Manifest(tok.sha256, tok.vocab_size, tok.eot_id, dtype, heldout_fraction,
                        tuple(d[0] for d in done if d[0].tokens), tuple(d[1] for d in done if d[1].tokens))
    if tokenizer_json:
        sink.put_bytes(TOKENIZER_KEY, tokenizer_json)
    raw = manifest.to_json()
    sink.put_bytes(MANIFEST_KEY, raw)
    return manifest, hashlib.sha256(raw).hexdigest()


def _run(
    inputs: Sequence[Path],
    sink: ShardSink,
    staging: Path,
    local: bool,
    setup: tuple[bytes, str, float],
    unit_bytes: int,
    workers: int,
    field: str,
    on_progress: Callable[[Progress], None] | None,
) -> list[tuple[Shard, Shard]]:
    tokenizer_json, dtype, fraction = setup
    results: dict[int, tuple[Shard, Shard]] = {}
    pending: deque[tuple[int, AsyncResult[tuple[Shard, Shard]]]] = deque()
    started, skipped, tokens = time.monotonic(), 0, 0

    def finish_one() -> None:
        nonlocal tokens
        index, job = pending.popleft()
        shards = job.get()
        _store_unit(sink, staging, index, shards, local)
        results[index] = shards
        tokens += shards[0].tokens + shards[1].tokens
        if on_progress is not None:
            on_progress(Progress(len(results) - skipped, skipped, tokens, time.monotonic() - started))

    pool = _pool(workers, (tokenizer_json, dtype, str(staging)))
    try:
        for index, unit in enumerate(units(input_pieces(list(inputs), unit_bytes, field), unit_bytes)):
            while len(pending) >= 2 * workers:
                finish_one()
            recorded = _recorded(sink, index)
            if recorded is not None:
                results[index] = recorded
                skipped += 1
                continue
            pending.append((index, pool.apply_async(_tokenize_unit, (index, unit, fraction))))
        while pending:
            finish_one()
    finally:
        pool.terminate()
    return [results[i] for i in sorted(results)]


def _pool(workers: int, setup: tuple[bytes, str, str]) -> Pool:
    """Worker processes, or (one worker) this process itself: a spawned worker re-imports torch."""
    if workers == 1:
        _init_worker(*setup)
        return ThreadPool(1)
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent that may hold torch's threads
    return ctx.Pool(workers, _init_worker, setup)
