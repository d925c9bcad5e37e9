"""`gonka-node data`: train a tokenizer, prepare a dataset once, check a prepared dataset.

    gonka-node data tokenizer --corpus PATH --vocab N --out tokenizer.json
    gonka-node data prepare --input FILES --tokenizer T --out DIR|s3://bucket/prefix
    gonka-node data verify --dataset DIR|s3://...

A recipe then names the dataset (`corpus = "DIR|s3://…"`, `data_manifest_sha256`) and its tokenizer
(`tokenizer` = the tokenizer.json's sha256); docs/DATA.md describes the format.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gonka_node.cli import CliError
from gonka_node.cli.verbs import add_group, add_verb
from gonka_node.core.storage import LocalStore, open_store
from training.data import corpus_files
from training.dataset import read_manifest, verify_all
from training.prepare import DEFAULT_UNIT_BYTES, Progress, prepare
from training.tokenizer import HFTokenizer, train_bpe


def register(subparsers: argparse._SubParsersAction) -> None:
    actions = add_group(subparsers, "data", help="tokenizers and prepared datasets")
    tok = add_verb(
        actions, "tokenizer", help="train a byte-level BPE tokenizer on a corpus; prints its sha256",
        examples=["gonka-node data tokenizer --corpus texts/ --vocab 32000 --out tokenizer.json"],
        next="gonka-node data prepare --input texts/*.jsonl --tokenizer tokenizer.json --out dataset/",
    )
    tok.add_argument("--corpus", required=True, nargs="+", type=Path, metavar="PATH", help="text files or folders")
    tok.add_argument("--vocab", required=True, type=int, metavar="N", help="vocabulary size (>= 258)")
    tok.add_argument("--out", required=True, type=Path, metavar="FILE", help="where to write tokenizer.json")
    tok.set_defaults(func=_tokenizer)
    prep = add_verb(
        actions, "prepare", help="tokenize text/jsonl/parquet into shards and a manifest (resumable)",
        examples=["gonka-node data prepare --input a.jsonl b.parquet --tokenizer tokenizer.json --out dataset/",
                  "gonka-node data prepare --input books.txt --out s3://bucket/books   # byte tokenizer"],
        next="put the printed corpus and data_manifest_sha256 (and tokenizer) in the recipe",
    )
    prep.add_argument("--input", required=True, nargs="+", type=Path, metavar="FILE",
                      help=".jsonl and .parquet (a 'text' field), anything else is one text document")
    prep.add_argument("--tokenizer", type=Path, metavar="FILE", help="tokenizer.json (default: the byte tokenizer)")
    prep.add_argument("--out", required=True, metavar="DIR|s3://BUCKET/PREFIX", help="where the dataset goes")
    prep.add_argument("--endpoint", metavar="URL", help="S3 endpoint (MinIO, R2, ...); default: AWS")
    prep.add_argument("--heldout-fraction", type=float, default=0.01, help="share of documents held out")
    prep.add_argument("--unit-mb", type=float, default=DEFAULT_UNIT_BYTES / 2**20,
                      help="text per shard, in MiB (one worker tokenizes one such unit)")
    prep.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    prep.add_argument("--field", default="text", help="the jsonl/parquet field holding the text")
    prep.set_defaults(func=_prepare)
    ver = add_verb(
        actions, "verify", help="fetch every shard of a prepared dataset and check it against the manifest",
        examples=["gonka-node data verify --dataset s3://bucket/books"],
        next="gonka-node data prepare again on the same --out re-creates what is missing",
    )
    ver.add_argument("--dataset", required=True, metavar="DIR|s3://BUCKET/PREFIX", help="the prepared dataset")
    ver.add_argument("--endpoint", metavar="URL", help="S3 endpoint; default: AWS")
    ver.add_argument("--sha256", default="", help="the manifest hash the dataset must have (a recipe's)")
    ver.set_defaults(func=_verify)


def _texts(paths: list[Path]) -> Iterator[str]:
    try:
        files = corpus_files(paths)
    except (OSError, ValueError) as exc:
        raise CliError(f"--corpus: {exc}") from None
    for f in files:
        yield f.path.read_text(encoding="utf-8", errors="replace")


def _tokenizer(args: argparse.Namespace) -> int:
    data = train_bpe(_texts(args.corpus), args.vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    LocalStore(args.out.parent).put_bytes(args.out.name, data)
    tok = HFTokenizer(data)
    print(f"wrote {args.out}: byte-level BPE, {tok.vocab_size} tokens, end-of-text id {tok.eot_id}")
    print(f"tokenizer = \"{tok.sha256}\"   # for the recipe")
    return 0


def _show(progress: Progress) -> None:
    rate = progress.tokens / progress.seconds if progress.seconds > 0 else 0.0
    print(f"\rprepare: {progress.units_done} units tokenized, {progress.units_skipped} resumed, "
          f"{progress.tokens:,} tokens, {rate:,.0f} tokens/s", end="", file=sys.stderr, flush=True)


def _prepare(args: argparse.Namespace) -> int:
    tokenizer_json = b""
    if args.tokenizer is not None:
        tokenizer_json = HFTokenizer.from_file(args.tokenizer).raw
    if args.workers is not None and args.workers <= 0:
        raise CliError(f"--workers {args.workers}: must be positive")
    store = open_store(args.out, args.endpoint)
    local = store.root if isinstance(store, LocalStore) else None
    manifest, digest = prepare(args.input, store, tokenizer_json, local_root=local,
                               heldout_fraction=args.heldout_fraction, unit_bytes=int(args.unit_mb * 2**20),
                               workers=args.workers, field=args.field, on_progress=_show)
    print(file=sys.stderr)
    print(f"dataset {store.uri}: {manifest.tokens('train'):,} training and {manifest.tokens('heldout'):,} "
          f"held-out tokens in {len(manifest.train) + len(manifest.heldout)} shards ({manifest.dtype})")
    print(f"corpus = \"{store.uri}\"\ndata_manifest_sha256 = \"{digest}\"")
    if manifest.tokenizer_sha256:
        print(f"tokenizer = \"{manifest.tokenizer_sha256}\"")
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = open_store(args.dataset, args.endpoint)
    manifest, digest = read_manifest(store, args.sha256)
    with tempfile.TemporaryDirectory(prefix="gonka-verify-") as tmp:
        problems = verify_all(manifest, store, Path(tmp))
    for line in problems:
        print(line)
    count = len(manifest.train) + len(manifest.heldout)
    if problems:
        raise CliError(f"{len(problems)} of {count} shards of {store.uri} failed their check")
    print(f"dataset {store.uri}: all {count} shards match manifest {digest}")
    return 0
