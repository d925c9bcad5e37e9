import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from training import data
from training.data import (
    ByteTokenizer,
    TokenCorpus,
    Windows,
    assign_positions,
    builtin_corpus_files,
    corpus_files,
)


def _write_corpus(root: Path, n_files: int = 3, size: int = 3000) -> Path:
    folder = root / "texts"
    (folder / "sub").mkdir(parents=True)
    rng = np.random.RandomState(0)
    for i in range(n_files):
        target = folder / ("sub" if i % 2 else "") / f"doc{i}.txt"
        target.write_bytes(bytes(rng.randint(32, 127, size=size).astype(np.uint8)))
    (folder / ".hidden").write_text("never read")
    return folder


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = ByteTokenizer()
    text = "naïve → 日本"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 is shown, not raised


def test_corpus_files_are_sorted_relative_and_skip_hidden(tmp_path: Path) -> None:
    folder = _write_corpus(tmp_path)
    extra = tmp_path / "extra.txt"
    extra.write_text("hello")
    files = corpus_files([folder, extra])
    assert [f.relpath for f in files] == [
        "extra.txt",
        "texts/doc0.txt",
        "texts/doc2.txt",
        "texts/sub/doc1.txt",
    ]
    assert files[0].size == 5 and files[0].sha256 == hashlib.sha256(b"hello").hexdigest()


def test_corpus_files_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        corpus_files([tmp_path / "missing"])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.txt").write_text("1")
    (tmp_path / "x.txt").write_text("2")
    with pytest.raises(ValueError, match=r"share the relative path 'x\.txt'"):
        corpus_files([tmp_path / "a" / "x.txt", tmp_path / "x.txt"])
    with pytest.raises(ValueError, match="no corpus files"):
        corpus_files([tmp_path / "b"])


def test_tokens_join_documents_with_a_separator(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"ab")
    (tmp_path / "b.txt").write_bytes(b"cde")
    corpus = TokenCorpus.from_paths([tmp_path / "a.txt", tmp_path / "b.txt"])
    assert corpus.tokens.tolist() == [97, 98, 0, 99, 100, 101, 0]
    assert corpus.manifest.splitlines()[:2] == ["gonka-corpus-v1", "tokenizer byte-v1 separator 0"]
    assert corpus.manifest_sha256 == hashlib.sha256(corpus.manifest.encode()).hexdigest()


def test_manifest_hash_tracks_content_not_location(tmp_path: Path) -> None:
    first = _write_corpus(tmp_path / "one")
    second = _write_corpus(tmp_path / "two")
    hash_one = TokenCorpus.from_paths([first]).manifest_sha256
    assert TokenCorpus.from_paths([second]).manifest_sha256 == hash_one
    (second / "doc0.txt").write_bytes(b"X" + (second / "doc0.txt").read_bytes()[1:])  # same size
    assert TokenCorpus.from_paths([second]).manifest_sha256 != hash_one


def test_token_cache_is_reused_and_rebuilt_when_damaged(tmp_path: Path) -> None:
    folder, cache = _write_corpus(tmp_path), tmp_path / "cache"
    first = TokenCorpus.from_paths([folder], cache_dir=cache)
    cache_file = cache / f"{first.manifest_sha256}.tokens.npy"
    written = cache_file.stat().st_mtime_ns
    second = TokenCorpus.from_paths([folder], cache_dir=cache)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert isinstance(second.tokens, np.memmap) and cache_file.stat().st_mtime_ns == written
    assert np.array_equal(first.tokens, second.tokens)
    cache_file.write_bytes(cache_file.read_bytes()[:100])  # truncated
    third = TokenCorpus.from_paths([folder], cache_dir=cache)
    assert not third.cache_hit and np.array_equal(third.tokens, first.tokens)
    assert [p.name for p in cache.iterdir() if p.suffix == ".tmp"] == []


def test_windows_are_disjoint_slices_with_shifted_targets() -> None:
    tokens = np.arange(50, dtype=np.uint8)
    windows = Windows(tokens, seq_len=4, heldout_fraction=0.2)
    assert windows.n_windows == 10  # 50 // 5
    assert windows.stack([0, 3]).tolist() == [[0, 1, 2, 3, 4], [15, 16, 17, 18, 19]]
    inputs, targets = next(windows.batches([3], micro_batch=1))
    assert inputs.dtype == targets.dtype == torch.long
    assert inputs.tolist() == [[15, 16, 17, 18]] and targets.tolist() == [[16, 17, 18, 19]]
    with pytest.raises(IndexError):
        windows.stack([10])


def test_heldout_split_is_disjoint_and_fixed() -> None:
    windows = Windows(np.zeros(10_000, dtype=np.uint8), seq_len=9, heldout_fraction=0.05)
    held, train = set(windows.heldout_ids.tolist()), set(windows.train_ids.tolist())
    assert len(held) == 50 and held.isdisjoint(train) and held | train == set(range(1000))
    assert max(held) - min(held) > 500  # spread over the corpus, not a tail block
    again = Windows(np.zeros(10_000, dtype=np.uint8), seq_len=9, heldout_fraction=0.05)
    assert np.array_equal(again.heldout_ids, windows.heldout_ids)


def test_both_splits_keep_at_least_one_window() -> None:
    tiny = Windows(np.zeros(20, dtype=np.uint8), seq_len=9, heldout_fraction=0.9)  # 2 windows
    assert (len(tiny.train_ids), len(tiny.heldout_ids)) == (1, 1)
    assert len(Windows(np.zeros(200, dtype=np.uint8), seq_len=9, heldout_fraction=0.01).heldout_ids) == 1


def test_too_small_corpus_is_rejected() -> None:
    with pytest.raises(ValueError, match="fewer than 2 windows of 65"):
        Windows(np.zeros(100, dtype=np.uint8), seq_len=64)


def test_assignment_is_disjoint_across_hosts_and_rounds() -> None:
    windows = Windows(np.zeros(100_000, dtype=np.uint8), seq_len=9, heldout_fraction=0.1)  # 9000 train
    seen: set[int] = set()
    for round_index in range(5):
        for slot in range(4):
            ids = windows.assignment(
                epoch_seed=11, round_index=round_index, slot=slot, max_slots=4, windows_per_host=400
            )
            assert len(set(ids.tolist())) == 400
            assert seen.isdisjoint(ids.tolist())
            assert set(ids.tolist()) <= set(windows.train_ids.tolist())
            seen.update(ids.tolist())
    assert len(seen) == 8000


def test_assignment_is_reproducible_from_scratch() -> None:
    kwargs = {"epoch_seed": 3, "round_index": 2, "slot": 1, "max_slots": 3, "windows_per_host": 16}
    first = Windows(np.zeros(20_000, dtype=np.uint8), seq_len=9).assignment(**kwargs)
    data._pass_permutation.cache_clear()
    second = Windows(np.zeros(20_000, dtype=np.uint8), seq_len=9).assignment(**kwargs)
    assert np.array_equal(first, second)
    other_seed = Windows(np.zeros(20_000, dtype=np.uint8), seq_len=9).assignment(
        **{**kwargs, "epoch_seed": 4}
    )
    assert not np.array_equal(first, other_seed)
    # Golden: the assignment is part of the protocol; anyone must get these same positions.
    golden = assign_positions(1000, epoch_seed=1, round_index=0, slot=0, max_slots=2, windows_per_host=4)
    assert golden.tolist() == [249, 207, 717, 644]


def test_assignment_wraps_to_a_new_permutation_after_a_pass() -> None:
    n_train = 10
    chunks = [
        assign_positions(
            n_train, epoch_seed=5, round_index=r, slot=s, max_slots=2, windows_per_host=5
        ).tolist()
        for r in range(2)
        for s in range(2)
    ]
    first_pass, second_pass = chunks[0] + chunks[1], chunks[2] + chunks[3]
    assert sorted(first_pass) == sorted(second_pass) == list(range(10))  # each pass visits every window once
    assert first_pass != second_pass  # ...in a new order


def test_assignment_rejects_bad_slots() -> None:
    with pytest.raises(ValueError, match=r"host slot 4 is outside 0\.\.3"):
        assign_positions(100, epoch_seed=0, round_index=0, slot=4, max_slots=4, windows_per_host=1)
    with pytest.raises(ValueError, match="round_index=-1"):
        assign_positions(100, epoch_seed=0, round_index=-1, slot=0, max_slots=4, windows_per_host=1)


def test_heldout_samples_come_from_the_heldout_split() -> None:
    windows = Windows(np.zeros(20_000, dtype=np.uint8), seq_len=9, heldout_fraction=0.05)
    sample = windows.sample_heldout(seed=9, n=30)
    assert set(sample.tolist()) <= set(windows.heldout_ids.tolist()) and len(set(sample.tolist())) == 30
    assert np.array_equal(sample, windows.sample_heldout(seed=9, n=30))
    assert not np.array_equal(sample, windows.sample_heldout(seed=10, n=30))


def test_builtin_corpus_is_the_sorted_stdlib_up_to_the_cap() -> None:
    files = builtin_corpus_files(max_bytes=300_000)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relpaths = [f.relpath for f in files]
    assert relpaths == sorted(relpaths) and relpaths[0] == "__future__.py"
    assert all(r.endswith(".py") and "site-packages" not in r for r in relpaths)
    total = sum(f.size for f in files)
    assert 50_000 < total <= 300_000
    next_file = sorted(p.relative_to(stdlib).as_posix() for p in stdlib.rglob("*.py"))[len(files)]
    assert total + (stdlib / next_file).stat().st_size > 300_000  # stopped at the first file over the cap
    assert [f.sha256 for f in builtin_corpus_files(max_bytes=300_000)] == [f.sha256 for f in files]
