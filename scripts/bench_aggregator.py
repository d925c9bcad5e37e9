"""Benchmark the aggregator: one round with N simulated hosts of a ~10M-parameter model on loopback.

    .venv/bin/python scripts/bench_aggregator.py --hosts 4 16 64 --out bench_aggregator.json

For each N, a fresh aggregator *process* (embedded chain, contracts deployed, an epoch with N hosts
signed in) serves on 127.0.0.1:0; this process signs and streams N int8-coded pseudo-gradients
(8 concurrent streams) and measures:
- ingest_mb_s: payload bytes / seconds from the first stream opened to the last receipt;
- finalize_latency_s: last receipt → round finalized on chain (robust aggregate, outer step,
  checkpoint, rewards, Merkle root, finalize transaction);
- peak_rss_mb: the aggregator process's peak resident memory (ru_maxrss), chain included;
  rss_before_round_mb: the same just before the round (embedded chain with N hosts, model, imports).
Scoring is off (it runs forward passes of the model per host; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from nacl.signing import SigningKey

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gonka_node.aggregator.client import AggregatorClient  # noqa: E402
from training.codecs import get_codec  # noqa: E402
from training.model import ModelConfig, build_model  # noqa: E402

GNK = 10**9
CODEC = "int8"
BENCH_MODEL = ModelConfig(dim=320, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=864, max_seq_len=256)


def host_keys(i: int) -> tuple[bytes, SigningKey]:
    return hashlib.sha256(f"bench-evm-{i}".encode()).digest(), SigningKey(
        hashlib.sha256(f"bench-node-{i}".encode()).digest()
    )


def serve(n_hosts: int, workdir: Path) -> None:
    """The aggregator process: chain + epoch + server; prints its port, then its peak RSS on SIGTERM."""
    from eth_account import Account
    from nacl.signing import SigningKey as Key
    from web3.types import Wei

    from chain.backends import EmbeddedBackend
    from chain.client import ChainClient
    from chain.types import EpochSpec
    from gonka_node.aggregator.chain_view import ChainView
    from gonka_node.aggregator.checkpoints import TrainingCheckpoints
    from gonka_node.aggregator.rounds import EpochContext, RoundEngine
    from gonka_node.aggregator.server import AggregatorServer
    from gonka_node.aggregator.store import Store
    from gonka_node.config import AggregationSettings, RoundSettings
    from gonka_node.tls import create_identity
    from training.codecs import CodecError

    backend = EmbeddedBackend()
    dev = backend.dev_accounts()
    gov = ChainClient(backend, dev[0]).connect()
    deployment = gov.deploy_all()
    base = {n: p.detach() for n, p in build_model(BENCH_MODEL, 0).named_parameters()}
    init_path = workdir / "init.safetensors"
    init_sha = TrainingCheckpoints().save(init_path, base, {})
    reward = 1000 * GNK
    spec = EpochSpec(
        model_spec_hash=hashlib.sha256(b"bench").digest(), model_uri="bench", data_manifest_hash=hashlib.sha256(b"d").digest(),
        init_checkpoint_hash=init_sha, inner_steps=1, inner_lr=1e-3, batch_size=1, outer_lr=0.7, outer_momentum=0.9,
        codec=CODEC, n_rounds=2, round_length=3600, signin_window=7200, min_stake=reward, max_hosts=n_hosts,
        aggregators=(dev[1].address,), reward_per_round=reward,
    )  # fmt: skip
    epoch = gov.create_epoch(spec)
    gov.mint(gov.address, reward * 2 + n_hosts * reward)
    gov.fund_epoch(epoch, reward * 2)
    for i in range(n_hosts):
        evm, node = host_keys(i)
        account = Account.from_key(evm)
        gov.w3.eth.send_transaction({"from": dev[0].address, "to": account.address, "value": Wei(10**18)})
        gov.transfer(account.address, reward)  # the stake rule: min_stake × p (1) covers the round's reward
        ChainClient(backend, account, deployment).connect().join(epoch, reward, bytes(node.verify_key))
    backend.increase_time(7201)
    ctx = EpochContext(
        chain_id=deployment.chain_id, registry=bytes.fromhex(deployment.registry[2:]), epoch=epoch, codec_name=CODEC,
        codec=get_codec(CODEC), codec_error=CodecError, spec={n: tuple(t.shape) for n, t in base.items()}, n_rounds=2,
        round_length_s=3600, outer_lr=0.7, outer_momentum=0.9, reward_per_round=reward, initial_checkpoint=init_path,
        initial_sha256=init_sha,
    )  # fmt: skip
    del base
    engine = RoundEngine(
        ctx, RoundSettings(max_update_norm=1e6), AggregationSettings(rule="clip_median"), Store(workdir / "agg").open(),
        ChainView(ChainClient(backend, dev[1], deployment).connect()), TrainingCheckpoints(), Key(b"\x01" * 32),
    )  # fmt: skip

    async def main() -> None:
        identity = create_identity()
        server = AggregatorServer(engine, identity, "127.0.0.1:0")
        port = await server.start()
        setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"port": port, "tls_cert": identity.cert_pem.decode(), "setup_rss_mb": setup}), flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0.5)

    asyncio.run(main())
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


def payloads(n_hosts: int) -> list[bytes]:
    """Distinct, plausible updates: a shared direction plus per-host noise of the same size."""
    spec = {n: tuple(p.shape) for n, p in build_model(BENCH_MODEL, 0).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    shared = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in spec.items()}
    codec = get_codec(CODEC)
    return [
        codec.encode({n: shared[n] + torch.randn(s, generator=gen) * 1e-3 for n, s in spec.items()})
        for _ in range(n_hosts)
    ]


def run_one(n_hosts: int) -> dict[str, float]:
    data = payloads(n_hosts)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(n_hosts), "--workdir", tmp],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        port = hello["port"]
        try:
            with AggregatorClient(f"127.0.0.1:{port}", hello["tls_cert"].encode()) as client:
                info = client.open_round()

                def submit(i: int) -> None:
                    evm, node = host_keys(i)
                    from eth_account import Account

                    addr = bytes.fromhex(Account.from_key(evm).address[2:])
                    assert client.submit(info, addr, data[i], node, 1000).accepted

                start = time.perf_counter()
                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(submit, range(n_hosts)))
                last = time.perf_counter()
                while True:
                    try:
                        client.round_result(info.epoch, info.round)
                        break
                    except grpc.RpcError:  # NOT_FOUND until finalized
                        time.sleep(0.05)
                done = time.perf_counter()
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
    rss = json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]
    total_mb = sum(len(d) for d in data) / 1e6
    return {
        "hosts": n_hosts,
        "payload_mb": round(total_mb / n_hosts, 2),
        "ingest_mb_s": round(total_mb / (last - start), 1),
        "finalize_latency_s": round(done - last, 2),
        "peak_rss_mb": round(rss, 1),
        "rss_before_round_mb": round(hello["setup_rss_mb"], 1),  # chain, contracts, model, imports
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--out", type=Path, help="write {'runs': [...]} as JSON here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if args.serve:
        serve(args.serve, args.workdir)
        return 0
    params = BENCH_MODEL.num_params()
    print(f"model: {params / 1e6:.1f}M parameters, codec {CODEC}", file=sys.stderr)
    runs = []
    for n in args.hosts:
        runs.append(run_one(n))
        print(json.dumps(runs[-1]), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"model_params": params, "codec": CODEC, "runs": runs}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
