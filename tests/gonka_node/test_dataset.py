"""Prepared datasets (training/prepare.py, training/dataset.py) in a directory and on an S3 server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gonka_node.core.storage import LocalStore, StoreError, StoreUnavailable, open_store
from training import dataset
from training.dataset import (
    DatasetError,
    ManifestMismatch,
    ShardCache,
    ShardCorrupt,
    ShardMissing,
    open_windows,
    read_manifest,
    verify_all,
)
from training.prepare import Progress, is_heldout, prepare
from training.tokenizer import HFTokenizer, train_bpe

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(600)]


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    return train_bpe(iter(DOCS), vocab_size=320)


@pytest.fixture
def inputs(tmp_path: Path) -> list[Path]:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:300]))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": DOCS[300:500]}), parquet)
    text = tmp_path / "c.txt"
    text.write_text("\n".join(DOCS[500:]))
    return [jsonl, parquet, text]


def _prepared(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> LocalStore:
    store = LocalStore(tmp_path / "ds")
    prepare(inputs, store, tokenizer_json, local_root=store.root, heldout_fraction=0.1, unit_bytes=4000, workers=1)
    return store


def test_shards_hold_every_document_then_end_of_text(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    tok = HFTokenizer(tokenizer_json)
    assert manifest.tokenizer_sha256 == tok.sha256 and manifest.dtype == "uint16" and manifest.eot_id == 0
    assert store.get_bytes("tokenizer.json") == tokenizer_json
    assert len(manifest.train) > 3  # several units
    docs = [*DOCS[:500], "\n".join(DOCS[500:])]
    expected = {"train": [], "heldout": []}
    for doc in docs:
        expected["heldout" if is_heldout(doc, 0.1) else "train"] += [*tok.encode(doc), 0]
    for split in ("train", "heldout"):
        shards = getattr(manifest, split)
        got = np.concatenate([np.frombuffer(store.get_bytes(s.key), dtype="<u2") for s in shards])
        assert got.tolist() == expected[split]
        assert manifest.tokens(split) == len(expected[split])
    assert 0 < len(expected["heldout"]) < len(expected["train"])


def test_windows_read_the_shards_in_order(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    train = np.concatenate([np.frombuffer(store.get_bytes(s.key), dtype="<u2") for s in manifest.train])
    held = np.concatenate([np.frombuffer(store.get_bytes(s.key), dtype="<u2") for s in manifest.heldout])
    windows = open_windows(manifest, ShardCache(store, tmp_path / "cache"), seq_len=15)
    n_train = len(train) // 16
    assert list(windows.train_ids) == list(range(n_train))
    assert list(windows.heldout_ids) == list(range(n_train, n_train + len(held) // 16))
    ids = [0, n_train - 1, n_train, windows.n_windows - 1, 7]
    rows = windows.stack(ids).numpy()
    assert rows[1].tolist() == train[(n_train - 1) * 16 : n_train * 16].tolist()  # may span two shards
    assert rows[2].tolist() == held[:16].tolist()
    assert rows[4].tolist() == train[7 * 16 : 8 * 16].tolist()


def test_a_host_fetches_only_the_shards_its_windows_fall_in(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    cache = ShardCache(store, tmp_path / "cache")
    windows = open_windows(manifest, cache, seq_len=15)
    windows.stack([0])
    assert cache.downloads == 1
    assert sorted(p.stem for p in (tmp_path / "cache").glob("*.tok")) == [manifest.train[0].sha256]


def test_cache_keeps_within_its_size_limit(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    biggest = max(s.tokens for s in manifest.train) * 2
    cache = ShardCache(store, tmp_path / "cache", max_bytes=2 * biggest)
    windows = open_windows(manifest, cache, seq_len=15)
    for i in windows.train_ids:
        windows.stack([i])
        assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.tok")) <= 2 * biggest
    train_pieces = [s for s, _ in windows.tokens.pieces if s.key.startswith("train/")]  # type: ignore[attr-defined]
    assert cache.downloads == len(train_pieces) > len(list((tmp_path / "cache").glob("*.tok")))


def test_manifest_detects_a_corrupted_shard(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    victim = store.root / manifest.train[1].key
    data = bytearray(victim.read_bytes())
    data[3] ^= 1
    victim.write_bytes(bytes(data))
    windows = open_windows(manifest, ShardCache(store, tmp_path / "cache"), seq_len=15)
    first_of_victim = manifest.train[0].tokens // 16 + 1
    windows.stack([0])  # shard 0 is intact
    with pytest.raises(ShardCorrupt, match=f"shard {manifest.train[1].key} has sha256"):
        windows.stack([first_of_victim])
    assert not list((tmp_path / "cache").glob(f"{manifest.train[1].sha256}*"))  # nothing unverified kept
    assert verify_all(manifest, store, tmp_path / "v") == [
        f"{store.uri}: shard {manifest.train[1].key} has sha256 {_sha(bytes(data))} and {len(data)} bytes; the "
        f"manifest records {manifest.train[1].sha256} and {len(data)} bytes: re-upload it (gonka-node data prepare resumes)"
    ]


def test_manifest_detects_a_missing_shard(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    store.delete(manifest.heldout[0].key)
    windows = open_windows(manifest, ShardCache(store, tmp_path / "cache"), seq_len=15)
    with pytest.raises(ShardMissing, match=f"shard {manifest.heldout[0].key} named by the manifest is missing"):
        windows.stack([windows.heldout_ids[0]])
    assert len(verify_all(manifest, store, tmp_path / "v")) == 1


def test_manifest_hash_is_checked(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    _, digest = read_manifest(store)
    assert read_manifest(store, digest)[1] == digest
    with pytest.raises(ManifestMismatch, match="this store holds another dataset"):
        read_manifest(store, "0" * 64)
    with pytest.raises(DatasetError, match="prepare the dataset first"):
        read_manifest(LocalStore(tmp_path / "empty"))


def test_prepare_resumes_skipping_finished_units(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    first, digest = read_manifest(store)
    store.delete("manifest.json")
    store.delete(first.train[-1].key.replace(".tok", ".json"))  # the last unit's record: as if it crashed there
    seen: list[Progress] = []
    _, again = prepare(inputs, store, tokenizer_json, local_root=store.root, heldout_fraction=0.1,
                       unit_bytes=4000, workers=1, on_progress=seen.append)
    assert again == digest
    assert (seen[-1].units_done, seen[-1].units_skipped) == (1, len(first.train) - 1)


def test_prepare_on_all_cores_equals_one_core(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes) -> None:
    _, one = read_manifest(_prepared(tmp_path, inputs, tokenizer_json))
    store = LocalStore(tmp_path / "multi")
    _, many = prepare(inputs, store, tokenizer_json, local_root=store.root, heldout_fraction=0.1,
                      unit_bytes=4000, workers=2)
    assert many == one


def test_prepare_into_s3_and_stream_from_it(tmp_path: Path, inputs: list[Path], tokenizer_json: bytes,
                                            s3_endpoint: str, s3_bucket: str) -> None:
    _, local_digest = read_manifest(_prepared(tmp_path, inputs, tokenizer_json))
    store = open_store(f"s3://{s3_bucket}/ds?endpoint={s3_endpoint}")
    _, digest = prepare(inputs, store, tokenizer_json, heldout_fraction=0.1, unit_bytes=4000, workers=1)
    assert digest == local_digest
    manifest, _ = read_manifest(store, digest)
    windows = open_windows(manifest, ShardCache(store, tmp_path / "cache"), seq_len=15)
    local = open_windows(manifest, ShardCache(LocalStore(tmp_path / "ds"), tmp_path / "c2"), seq_len=15)
    assert windows.stack([3, windows.n_windows - 1]).tolist() == local.stack([3, local.n_windows - 1]).tolist()


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    store = LocalStore(tmp_path / "ds")
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not a JSON object with a string field 'text'"):
        prepare([bad], store, workers=1)
    assert not store.exists("manifest.json")
    with pytest.raises(DatasetError, match="is not a file"):
        prepare([tmp_path / "absent.txt"], store, workers=1)


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


class Flaky:
    """A real LocalStore behind a link that fails: each download raises `errors` in turn, then goes through
    (a network fault, which cannot be produced on demand against a store here)."""

    def __init__(self, store: LocalStore, errors: list[Exception]) -> None:
        self.store, self.errors, self.uri, self.calls = store, errors, store.uri, 0

    def get_bytes(self, key: str) -> bytes:
        return self.store.get_bytes(key)

    def download(self, key: str, path: Path) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        self.store.download(key, path)


def test_a_transient_store_failure_is_retried_with_backoff(tmp_path: Path, inputs: list[Path],
                                                           tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    flaky = Flaky(store, [StoreUnavailable("s3: get_object failed: read timeout"), TimeoutError("timed out")])
    waits: list[float] = []
    cache = ShardCache(flaky, tmp_path / "cache", backoff_s=0.25, sleep=waits.append)
    row = open_windows(manifest, cache, seq_len=15).stack([0])
    assert row[0].tolist() == np.frombuffer(store.get_bytes(manifest.train[0].key), dtype="<u2")[:16].tolist()
    assert (waits, cache.retries, cache.downloads, flaky.calls) == ([0.25, 0.5], 2, 1, 3)


def test_retries_are_bounded_and_only_for_transient_failures(tmp_path: Path, inputs: list[Path],
                                                             tokenizer_json: bytes) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    down = Flaky(store, [StoreUnavailable(f"s3: attempt {i}") for i in range(10)])
    waits: list[float] = []
    cache = ShardCache(down, tmp_path / "cache", attempts=3, backoff_s=1.0, sleep=waits.append)
    with pytest.raises(StoreUnavailable, match="attempt 2"):
        open_windows(manifest, cache, seq_len=15).stack([0])
    assert (down.calls, waits) == (3, [1.0, 2.0])
    assert not list((tmp_path / "cache").iterdir())  # nothing half-fetched left behind
    refused = Flaky(store, [StoreError("s3: get_object refused: AccessDenied")])
    cache = ShardCache(refused, tmp_path / "cache", sleep=waits.append)
    with pytest.raises(StoreError, match="AccessDenied"):
        open_windows(manifest, cache, seq_len=15).stack([0])
    assert refused.calls == 1  # a refusal does not pass by waiting: not retried


def test_an_unreachable_s3_endpoint_is_a_transient_failure(tmp_path: Path, s3_endpoint: str) -> None:
    store = open_store("s3://bucket/ds?endpoint=http://127.0.0.1:1")  # nothing listens on port 1
    with pytest.raises(StoreUnavailable, match="Could not connect"):
        store.download("train/00000.tok", tmp_path / "x")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_cached_shard_is_fetched_again_after_a_restart(
    tmp_path: Path, inputs: list[Path], tokenizer_json: bytes, damage: str
) -> None:
    store = _prepared(tmp_path, inputs, tokenizer_json)
    manifest, _ = read_manifest(store)
    truth = np.frombuffer(store.get_bytes(manifest.train[0].key), dtype="<u2")[:16].tolist()
    open_windows(manifest, ShardCache(store, tmp_path / "cache"), seq_len=15).stack([0])
    cached = tmp_path / "cache" / f"{manifest.train[0].sha256}.tok"
    data = bytearray(cached.read_bytes())
    if damage == "flip":
        data[5] ^= 0xFF
    else:
        del data[-2:]
    cached.unlink()  # another inode: what a new process would see; and the process's memory of it is gone
    cached.write_bytes(bytes(data))
    dataset._verified.clear()  # the restart
    cache = ShardCache(store, tmp_path / "cache")
    assert open_windows(manifest, cache, seq_len=15).stack([0])[0].tolist() == truth
    assert cache.downloads == 1 and _sha(cached.read_bytes()) == manifest.train[0].sha256
    again = ShardCache(store, tmp_path / "cache")  # verified once in this process: opened without a fetch
    assert open_windows(manifest, again, seq_len=15).stack([0])[0].tolist() == truth and again.downloads == 0
