"""Throughput of `gonka-node serve` at 1, 8 and 32 concurrent clients, beside transformers' `generate`.

The server runs in a child process (its own interpreter, `--threads` torch threads) on the devnet
preset (~1M parameters, a seeded random init saved as a checkpoint and verified against its own
sha256: the chain only decides *which* weights load, not how fast they run). Clients in this process
(asyncio + aiohttp, non-streaming `POST /v1/completions`) each send requests one after another; a
run's tokens/s is the completion tokens all clients received over the run's wall time, p50/p99 the
request latencies. Then transformers' `LlamaForCausalLM.generate` samples the same completions one
at a time from the Hugging Face export of the same checkpoint, with the same threads, the server
stopped.

    .venv/bin/python scripts/bench_serve.py --out bench-serve.json

Target (issue 19): at 8 clients, total tokens/s ≥ 3× the single-client figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "def main():\n    "  # 17 bytes + the separator: with 96 new tokens, inside the 128-byte window
CLIENTS = (1, 8, 32)


def _serve(checkpoint: str, threads: int, max_batch: int, ready: Any, done: Any) -> None:
    """Child process: serve the checkpoint until `done` is set; send the URL through `ready`."""
    import torch

    torch.set_num_threads(threads)
    from gonka_node.serve.follow import VerifiedModel
    from gonka_node.serve.models import Provenance
    from gonka_node.serve.server import ServeSettings, serve_verified
    from training.checkpoint import load_checkpoint
    from training.model import Llama, ModelConfig

    loaded = load_checkpoint(checkpoint)
    model = Llama(ModelConfig.preset("devnet"))
    model.load_state_dict(loaded.tensors)
    provenance = Provenance(epoch=1, round=0, sha256=loaded.sha256, chain_id=0, registry="(benchmark: no chain)")
    settings = ServeSettings(max_batch=max_batch, max_waiting=4 * max_batch, device="cpu")
    handle = serve_verified(VerifiedModel(provenance, model.eval()), settings=settings)
    ready.send(handle.url)
    done.wait()
    handle.stop()


async def _client(session: Any, url: str, requests: int, seed: int, max_tokens: int) -> list[tuple[float, int]]:
    out = []
    for i in range(requests):
        body = {"model": "gonka-epoch-1", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0,
                "seed": seed * 1000 + i}
        started = time.perf_counter()
        async with session.post(url + "/completions", json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"the server answered {response.status}: {answer}")
        out.append((time.perf_counter() - started, answer["usage"]["completion_tokens"]))
    return out


async def _run(url: str, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _client(session, url, 1, 999, max_tokens)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(_client(session, url, requests, c, max_tokens) for c in range(clients)))
        wall = time.perf_counter() - started
    latencies = sorted(latency for per_client in results for latency, _ in per_client)
    tokens = sum(n for per_client in results for _, n in per_client)
    return {"clients": clients, "tokens_per_s": round(tokens / wall, 1), "p50_s": round(_quantile(latencies, 0.5), 4),
            "p99_s": round(_quantile(latencies, 0.99), 4), "requests": len(latencies), "completion_tokens": tokens,
            "wall_s": round(wall, 3)}


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _transformers(folder: Path, threads: int, samples: int, max_tokens: int) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([[0, *PROMPT.encode()]])
    tokens, started = 0, time.perf_counter()
    with torch.no_grad():
        for seed in range(samples):
            torch.manual_seed(seed)
            out = model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_tokens)
            tokens += out.shape[1] - prompt.shape[1]
    return {"tokens_per_s": round(tokens / (time.perf_counter() - started), 1), "samples": samples,
            "completion_tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (and of transformers)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, default=8, help="requests per client per run (1 client: 4x this)")
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()

    from training.checkpoint import save_checkpoint
    from training.hf_export import export_hf
    from training.model import ModelConfig, build_model

    config = ModelConfig.preset("devnet")
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        checkpoint = Path(tmp) / "devnet.safetensors"
        tensors = build_model(config, seed=0).state_dict()
        sha = save_checkpoint(checkpoint, tensors)
        export_hf(tensors, config, Path(tmp) / "hf", source_sha256=sha, source={"file": checkpoint.name})
        runs = _serve_runs(checkpoint, args)
        baseline = _transformers(Path(tmp) / "hf", args.threads, samples=4 * args.requests, max_tokens=args.max_tokens)
    single = runs[0]["tokens_per_s"]
    report = {
        "runs": runs, "transformers_tokens_per_s": baseline["tokens_per_s"], "transformers": baseline,
        "speedup_8_vs_1": round(next(r for r in runs if r["clients"] == 8)["tokens_per_s"] / single, 2),
        "model": {"preset": "devnet", "parameters": config.num_params(), "checkpoint_sha256": sha},
        "prompt_bytes": len(PROMPT.encode()), "max_tokens": args.max_tokens, "threads": args.threads,
        "cpus": os.cpu_count(), "load_average": os.getloadavg(),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


def _serve_runs(checkpoint: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    done = context.Event()
    server = context.Process(target=_serve, args=(str(checkpoint), args.threads, args.max_batch, send, done))
    server.start()
    try:
        if not receive.poll(300):
            raise RuntimeError("the server process did not start")
        url = receive.recv()
        return [asyncio.run(_run(url, clients, args.requests * (4 if clients == 1 else 1), args.max_tokens))
                for clients in CLIENTS]
    finally:
        done.set()
        server.join(60)
        if server.is_alive():
            server.terminate()


if __name__ == "__main__":
    sys.exit(main())
