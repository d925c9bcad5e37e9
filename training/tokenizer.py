"""Tokenizers named by hash: the built-in byte tokenizer, or a Hugging Face `tokenizer.json`.

A recipe names its tokenizer by the sha256 of the `tokenizer.json` file's bytes (or "" for the byte
tokenizer), so two hosts holding files with the same hash tokenize identically. A file whose hash
differs from the one asked for is refused before it is parsed.

Every tokenizer has an end-of-text token that separates documents: NUL (id 0) for bytes, and
`<|endoftext|>` for a BPE trained here (id 0 too, the first special token). A `tokenizer.json` from
elsewhere must define `<|endoftext|>` or say which of its tokens ends a text.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as _Tokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from training.data import DOCUMENT_SEPARATOR, ByteTokenizer

END_OF_TEXT = "<|endoftext|>"
EOT_CANDIDATES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")
BYTE_TOKENIZER = ""  # the recipe's tokenizer field for the built-in byte tokenizer


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used (unreadable, not a tokenizer, no end-of-text token)."""


class TokenizerHashError(TokenizerError):
    """A tokenizer file whose sha256 is not the one the recipe names."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int
    sha256: str  # of tokenizer.json; "" for the byte tokenizer

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, tokens: Iterable[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes `token` contributes to decoded text (b"" for an id outside the vocabulary)."""
        ...


class Bytes(ByteTokenizer):
    """`training.data.ByteTokenizer` with the rest of the `Tokenizer` interface."""

    eot_id = DOCUMENT_SEPARATOR
    sha256 = BYTE_TOKENIZER

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,)) if 0 <= token < 256 else b""


class HFTokenizer:
    """A `tokenizers` tokenizer read from a `tokenizer.json` file, identified by the file's sha256."""

    def __init__(self, data: bytes, source: str = "tokenizer.json") -> None:
        try:
            self.inner = _Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the library raises plain Exception for a malformed file
            raise TokenizerError(f"{source}: not a Hugging Face tokenizer.json: {exc}") from None
        self.raw = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.name = f"hf-{self.sha256[:16]}"
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        eot = next((self.inner.token_to_id(t) for t in EOT_CANDIDATES if self.inner.token_to_id(t) is not None), None)
        if eot is None:
            raise TokenizerError(f"{source}: defines none of the end-of-text tokens {list(EOT_CANDIDATES)}")
        self.eot_id = int(eot)
        spec = json.loads(data)
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self._added = {int(t["id"]): str(t["content"]) for t in spec.get("added_tokens") or ()}
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_file(cls, path: Path, expected_sha256: str | None = None) -> HFTokenizer:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise TokenizerError(f"{path}: cannot read tokenizer: {exc.strerror}") from None
        check_hash(data, expected_sha256, str(path))
        return cls(data, str(path))

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.inner.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, tokens: Iterable[int]) -> str:
        return str(self.inner.decode(list(tokens), skip_special_tokens=False))

    def token_bytes(self, token: int) -> bytes:
        """Exact for a byte-level tokenizer (GPT-2, Llama 3, those trained here): `decode(ids)` is the
        concatenation of these bytes, decoded as UTF-8 with U+FFFD for invalid bytes. Otherwise the
        token's own decoded text, which can differ from `decode` at piece boundaries (a SentencePiece
        tokenizer's leading space)."""
        known = self._bytes.get(token)
        if known is None:
            known = self._bytes[token] = self._token_bytes(token)
        return known

    def _token_bytes(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        piece = self.inner.id_to_token(token)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_of_symbol()
            return bytes(table.get(c, 0x3F) for c in piece)
        return str(self.inner.decode([token], skip_special_tokens=False)).encode("utf-8")


@functools.cache
def _byte_of_symbol() -> dict[str, int]:
    """GPT-2's byte-level table inverted: the printable character a byte is written as -> the byte."""
    from training.hf_export import byte_symbols  # it imports this module: read here, when first needed

    return {symbol: byte for byte, symbol in enumerate(byte_symbols())}


def check_hash(data: bytes, expected_sha256: str | None, source: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 and actual != expected_sha256:
        raise TokenizerHashError(
            f"{source}: sha256 {actual} differs from the recipe's tokenizer {expected_sha256}: "
            "use the exact file the epoch names"
        )


def load_tokenizer(path: Path | None, expected_sha256: str = BYTE_TOKENIZER) -> Bytes | HFTokenizer:
    """The byte tokenizer (no path, no hash) or the file at `path`, refused unless its hash matches."""
    if path is None:
        if expected_sha256:
            raise TokenizerError(f"the recipe names tokenizer {expected_sha256}; give its tokenizer.json")
        return Bytes()
    return HFTokenizer.from_file(path, expected_sha256 or None)


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int = 2) -> bytes:
    """A byte-level BPE trained on `texts`: the bytes of a `tokenizer.json` with `<|endoftext|>` as id 0.

    Byte-level: every byte has a token, so any text encodes and decodes losslessly."""
    if vocab_size < 257 + 1:
        raise TokenizerError(f"--vocab {vocab_size}: a byte-level BPE needs at least 258 tokens (256 bytes, "
                             "end-of-text and one merge)")
    tok = _Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str().encode("utf-8")
