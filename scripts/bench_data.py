"""Benchmark the data path: prepare a generated corpus on all cores, then stream it as a host does.

    .venv/bin/python scripts/bench_data.py --out bench_data.json [--corpus-mb 200]

1. Generates a jsonl corpus of `--corpus-mb` MB (Zipf-distributed pseudo-words, documents of 100–2,000
   words; deterministic), trains a byte-level BPE on its first few MB.
2. `prepare_tokens_per_s`: `gonka-node data prepare` over all cores (a child process; its peak memory is
   the largest process of the run, the tokenizing workers included).
3. `loader_tokens_per_s` (and per source under `sources`): a fresh process opens the dataset from the
   local directory, then from moto's S3 server on 127.0.0.1, with an empty shard cache limited to
   `--cache-mb`, and delivers the (inputs, targets) micro-batches of host slot 0 over several rounds
   (seq_len 2048, the windows a 1.24B-model round would take), fetching and verifying shards as it goes.
   Peak memory is that process's; `local_half` repeats the local run on half the dataset, to show the
   loader's memory does not grow with the dataset.
Target: 10 × 69k tokens/s (what a 1.24B model consumes on one H200, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gonka_node.core.storage import LocalStore, copy_tree, open_store  # noqa: E402
from training.dataset import ShardCache, open_windows, read_manifest  # noqa: E402
from training.tokenizer import train_bpe  # noqa: E402

TARGET_TOKENS_PER_S = 10 * 69_000
SEQ_LEN = 2048
MICRO_BATCH = 8


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Zipf-distributed pseudo-words in jsonl documents; returns the bytes of text written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = np.array(["".join(rng.choice(letters, size=int(n))) for n in rng.integers(1, 11, size=30_000)])
    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    weights /= weights.sum()
    target, written = int(megabytes * 2**20), 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            lengths = rng.integers(100, 2000, size=256)
            picks = rng.choice(len(words), size=int(lengths.sum()), p=weights)
            cuts = np.cumsum(lengths)[:-1]
            lines = []
            for doc in np.split(words[picks], cuts):
                text = " ".join(doc.tolist())
                written += len(text)
                lines.append(json.dumps({"text": text}))
            out.write("\n".join(lines) + "\n")
    return written


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "gonka_node", "data", "prepare", "--input", str(corpus), "--tokenizer",
               str(tokenizer), "--out", str(out), "--workers", str(workers), "--unit-mb", "16"]
    before = _cpu(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    cpu_s = _cpu(resource.RUSAGE_CHILDREN) - before
    manifest, digest = read_manifest(LocalStore(out))
    tokens = manifest.tokens("train") + manifest.tokens("heldout")
    return {"seconds": round(seconds, 2), "tokens": tokens, "workers": workers, "manifest_sha256": digest,
            "shards": len(manifest.train) + len(manifest.heldout), "dtype": manifest.dtype,
            "prepare_tokens_per_s": round(tokens / seconds), "cpu_s": round(cpu_s, 1),
            "tokens_per_cpu_s": round(tokens / cpu_s), "peak_rss_mb": round(peak_rss_mb(resource.RUSAGE_CHILDREN))}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _loader(uri: str, cache_mb: int, rounds: int, half: bool, result: Any) -> None:
    """In a fresh process: stream host slot 0's micro-batches for `rounds` rounds; report rate and memory."""
    store = open_store(uri)
    manifest, _ = read_manifest(store)
    if half:
        manifest = dataclasses.replace(manifest, train=manifest.train[: max(1, len(manifest.train) // 2)])
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as cache_dir:
        cache = ShardCache(store, Path(cache_dir), max_bytes=cache_mb << 20)
        windows = open_windows(manifest, cache, SEQ_LEN)
        per_round = 512  # windows a host takes per round (e.g. H = 64 steps × 8 windows)
        tokens, started, cpu = 0, time.monotonic(), time.process_time()
        for r in range(rounds):
            ids = windows.assignment(epoch_seed=1, round_index=r, slot=0, max_slots=4, windows_per_host=per_round)
            for inputs, _targets in windows.batches(ids, MICRO_BATCH):
                tokens += inputs.numel()
        seconds, cpu = time.monotonic() - started, time.process_time() - cpu
        result.put({"tokens": tokens, "seconds": round(seconds, 2), "loader_tokens_per_s": round(tokens / seconds),
                    "cpu_s": round(cpu, 2), "tokens_per_cpu_s": round(tokens / cpu),
                    "shard_downloads": cache.downloads, "dataset_tokens": manifest.tokens("train"),
                    "cache_limit_mb": cache_mb, "peak_rss_mb": round(peak_rss_mb())})


def run_loader(uri: str, cache_mb: int, rounds: int, half: bool = False) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_loader, args=(uri, cache_mb, rounds, half, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return dict(result)


def start_s3() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "bench")  # moto accepts any; a real run uses the operator's
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--corpus-mb", type=float, default=200.0, help="generated corpus size (default 200)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    parser.add_argument("--cache-mb", type=int, default=256, help="the loader's shard cache limit (default 256)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of windows the loader delivers (default 8)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare processes (default: all)")
    parser.add_argument("--work-dir", type=Path, help="keep the corpus and dataset here (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = bench(args, work)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    load = [round(x, 1) for x in os.getloadavg()]  # a shared machine: rates per CPU-second say more
    corpus = work / "corpus.jsonl"
    started = time.monotonic()
    text_bytes = generate_corpus(corpus, args.corpus_mb)
    generate_s = time.monotonic() - started
    tokenizer = work / "tokenizer.json"
    with open(corpus, encoding="utf-8") as handle:
        sample = [json.loads(line)["text"] for _, line in zip(range(800), handle, strict=False)]
    tokenizer.write_bytes(train_bpe(iter(sample), args.vocab))
    dataset = work / "dataset"
    prepared = run_prepare(corpus, tokenizer, dataset, args.workers)
    sources = {"local": run_loader(str(dataset), args.cache_mb, args.rounds),
               "local_half": run_loader(str(dataset), args.cache_mb, args.rounds, half=True)}
    server, endpoint = start_s3()
    try:
        import boto3

        boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        uri = f"s3://bench/dataset?endpoint={endpoint}"
        upload_started = time.monotonic()
        copy_tree(LocalStore(dataset), open_store(uri))
        upload_s = time.monotonic() - upload_started
        sources["s3"] = run_loader(uri, args.cache_mb, args.rounds)
        sources["s3"]["upload_s"] = round(upload_s, 2)
    finally:
        server.stop()
    local = sources["local"]["loader_tokens_per_s"]
    return {
        "command": " ".join(["scripts/bench_data.py", *sys.argv[1:]]),
        "cores": os.cpu_count(),
        "load_average_at_start": load,
        "corpus_bytes": text_bytes,
        "generate_s": round(generate_s, 2),
        "vocab": args.vocab,
        "seq_len": SEQ_LEN,
        "micro_batch": MICRO_BATCH,
        "prepare": prepared,
        "prepare_tokens_per_s": prepared["prepare_tokens_per_s"],
        "loader_tokens_per_s": local,
        "sources": sources,
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "meets_target": {name: s["loader_tokens_per_s"] >= TARGET_TOKENS_PER_S for name, s in sources.items()},
    }

if __name__ == "__main__":
    raise SystemExit(main())
