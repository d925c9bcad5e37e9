"""Tokenizers named by hash: a BPE trained here round-trips text and is refused under another hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from training.tokenizer import (
    END_OF_TEXT,
    Bytes,
    HFTokenizer,
    TokenizerError,
    TokenizerHashError,
    load_tokenizer,
    train_bpe,
)

CORPUS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog\n"] * 200


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(train_bpe(iter(CORPUS), vocab_size=300))
    return path


def test_bpe_round_trips_text_and_merges(bpe_file: Path) -> None:
    tok = HFTokenizer.from_file(bpe_file)
    text = "def add(a, b):\n    return a + b\nünïcødé ✓ and bytes \x01 never seen"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(tok.encode("the quick brown fox")) < len(b"the quick brown fox")  # merges were learnt
    assert tok.vocab_size == 300
    assert tok.eot_id == 0 and tok.inner.id_to_token(0) == END_OF_TEXT


def test_training_is_deterministic(bpe_file: Path) -> None:
    assert train_bpe(iter(CORPUS), vocab_size=300) == bpe_file.read_bytes()


def test_named_by_sha256_and_refused_when_it_differs(bpe_file: Path, tmp_path: Path) -> None:
    digest = hashlib.sha256(bpe_file.read_bytes()).hexdigest()
    assert HFTokenizer.from_file(bpe_file, digest).sha256 == digest
    other = tmp_path / "tokenizer.json"
    other.write_bytes(bpe_file.read_bytes() + b"\n")  # the same tokenizer, another file: another name
    with pytest.raises(TokenizerHashError, match=f"differs from the recipe's tokenizer {digest}"):
        load_tokenizer(other, digest)


def test_byte_tokenizer_is_the_default() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, Bytes)
    assert (tok.vocab_size, tok.eot_id, tok.sha256) == (256, 0, "")
    assert tok.decode(tok.encode("é")) == "é"


def test_mistakes_get_specific_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"give its tokenizer\.json"):
        load_tokenizer(None, "ab" * 32)
    with pytest.raises(TokenizerError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path / "absent.json")
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    with pytest.raises(TokenizerError, match=r"not a Hugging Face tokenizer\.json"):
        load_tokenizer(junk)
    with pytest.raises(TokenizerError, match="at least 258"):
        train_bpe(iter(CORPUS), vocab_size=200)


def test_token_bytes_concatenate_to_what_decode_returns(bpe_file: Path) -> None:
    import random

    tok = HFTokenizer.from_file(bpe_file)
    draw = random.Random(0)
    for _ in range(500):  # any ids, the end-of-text token and bytes that split a character included
        ids = [draw.randrange(tok.vocab_size) for _ in range(draw.randrange(1, 12))]
        assert b"".join(tok.token_bytes(t) for t in ids).decode("utf-8", "replace") == tok.decode(ids)
    assert tok.token_bytes(tok.eot_id) == END_OF_TEXT.encode()
    assert b"".join(tok.token_bytes(t) for t in tok.encode("ünï ✓")) == "ünï ✓".encode()
    assert tok.token_bytes(10_000) == b""  # outside the vocabulary: no text, as decode gives none
    assert [Bytes().token_bytes(t) for t in (65, 0xE9, 256)] == [b"A", b"\xe9", b""]
