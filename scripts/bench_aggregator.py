"""Benchmark the aggregator: one round with N simulated hosts on loopback, against a bare gRPC stream.

    .venv/bin/python scripts/bench_aggregator.py --out bench_aggregator.json          # 4 and 64 hosts, 10.1M
    .venv/bin/python scripts/bench_aggregator.py --hosts 64 1000 --params 1e5 --checks --out close.json
    .venv/bin/python scripts/bench_aggregator.py --stages                              # per-stage costs

For each N, a fresh aggregator *process* (embedded chain, contracts deployed, an epoch with N hosts
signed in) serves on 127.0.0.1:0; this process signs and streams N int8-coded pseudo-gradients
(8 concurrent streams) and measures:
- ingest_mb_s: payload bytes / seconds from the first stream opened to the last receipt;
- finalize_latency_s: last receipt → round finalized on chain (every check, robust aggregate, outer
  step, checkpoint, rewards, Merkle root, finalize transaction);
- peak_rss_mb: the aggregator process's peak resident memory (VmHWM), chain included;
  rss_before_round_mb: the same just before the round (embedded chain with N hosts, model, imports).
bare_grpc_mb_s: the same client, payloads and TLS against a server process whose Submit only reads
and discards the stream: what loopback gRPC carries here, the ceiling for ingest_mb_s.
Each run is repeated (`--repeat`, default 3), a bare stream measured right before each repeat; a run
reports the medians, the largest memory figures, `ingest_vs_bare` (the median of the repeats' own
ratios) with its range, and every repeat's figures.
Scoring is off unless `--checks` (it runs forward passes of the model per host); copies, mixtures
and dissent always run. `--params P` sizes a Llama-shaped model near P parameters (default: 10.1M).

`--shards S` (S > 1) runs S shard processes instead of one aggregator (docs/PROTOCOL.md "Sharded
aggregators"): each owns one fragment, meets the others through a shared directory (`DirExchange`),
and finalizes on its own embedded chain (an epoch naming S aggregators, quorum 1 there: separate
processes cannot share an embedded EVM; the votes are not what is measured). Hosts cut each payload by
fragment and upload to every shard at once; ingest counts every fragment's bytes, finalize_latency_s
runs until the last shard finalized, and the memory figures are the largest shard's. The default run
(no --hosts, --shards) adds the same model on 4 shards with 4 hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch
from nacl.signing import SigningKey

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chain.units import NGONKA_PER_GNK as GNK  # noqa: E402
from gonka_node.core.client import AggregatorClient, _requests  # noqa: E402
from gonka_node.core.wire import header_for  # noqa: E402
from proto.gonka.v1 import aggregator_pb2 as pb  # noqa: E402
from training.codecs import get_codec  # noqa: E402
from training.model import ModelConfig  # noqa: E402

CODEC = "int8"
STREAMS = 8  # concurrent uploads from the client process
BENCH_MODEL = ModelConfig(dim=320, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=864, max_seq_len=256)
SEQ_LEN = 32  # scoring windows (--checks)


def model_for(params: float | None) -> ModelConfig:
    """A Llama-shaped model (byte vocabulary) with about `params` parameters; None: BENCH_MODEL."""
    if params is None:
        return BENCH_MODEL
    best: ModelConfig | None = None
    for dim in range(16, 8193, 16):
        head = 64 if dim % 64 == 0 and dim >= 256 else 16
        cfg = ModelConfig(dim=dim, n_layers=max(1, dim // 128), n_heads=dim // head, n_kv_heads=dim // head,
                          ffn_dim=16 * round(dim * 8 / 3 / 16), max_seq_len=SEQ_LEN)  # fmt: skip
        if best is None or abs(cfg.num_params() - params) < abs(best.num_params() - params):
            best = cfg
    assert best is not None
    return best


def spec_of(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from training.model import Llama

    with torch.device("meta"):  # shapes only: nothing allocated or initialised
        return {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}


def host_keys(i: int) -> tuple[bytes, SigningKey]:
    return hashlib.sha256(f"bench-evm-{i}".encode()).digest(), SigningKey(
        hashlib.sha256(f"bench-node-{i}".encode()).digest()
    )


def epoch_with_hosts(n_hosts: int, init_sha: bytes, shards: int = 1) -> tuple[Any, Any, Any, int]:
    """The embedded chain with contracts, an epoch naming `shards` aggregators (dev accounts 1..S,
    quorum 1) and `n_hosts` signed in (the window closed)."""
    from eth_account import Account
    from web3.types import Wei

    from chain.backends import EmbeddedBackend
    from chain.client import ChainClient
    from chain.types import EpochSpec

    backend = EmbeddedBackend()
    dev = backend.dev_accounts()
    gov = ChainClient(backend, dev[0]).connect()
    deployment = gov.deploy_all()
    reward = 1000 * GNK
    spec = EpochSpec(
        model_spec_hash=hashlib.sha256(b"bench").digest(), model_uri="bench", data_manifest_hash=hashlib.sha256(b"d").digest(),
        init_checkpoint_hash=init_sha, inner_steps=1, inner_lr=1e-3, batch_size=1, outer_lr=0.7, outer_momentum=0.9,
        codec=CODEC, n_rounds=2, round_length=3600, signin_window=7200, min_stake=reward, max_hosts=n_hosts,
        aggregators=tuple(dev[1 + i].address for i in range(shards)), reward_per_round=reward,
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
    return backend, dev, deployment, epoch


def scoring_inputs(cfg: ModelConfig, n_hosts: int) -> dict[str, Any]:
    """Model and windows for `--checks`: random tokens (timing only; the scores mean nothing)."""
    import numpy as np

    from gonka_node.aggregator.scoring import ScoringData
    from training.data import Windows
    from training.model import build_model

    tokens = np.random.RandomState(0).randint(0, 256, size=SEQ_LEN * 64 * (n_hosts + 8), dtype=np.int64)
    windows = Windows(tokens.astype(np.uint16), SEQ_LEN)
    return {
        "model_factory": lambda: build_model(cfg, 0),
        "scoring": ScoringData(windows, 0, n_hosts, 2, 8),
    }


def serve(n_hosts: int, workdir: Path, params: float | None, checks: bool, shard: tuple[int, int] = (0, 1)) -> None:
    """The aggregator process (or shard `shard[0]` of `shard[1]`): chain + epoch + server; prints its
    port, then its peak RSS on SIGTERM."""
    from nacl.signing import SigningKey as Key

    from chain.client import ChainClient
    from gonka_node.aggregator.chain_view import ChainView
    from gonka_node.aggregator.checkpoints import TrainingCheckpoints
    from gonka_node.aggregator.engine_types import EpochContext
    from gonka_node.aggregator.rounds import RoundEngine
    from gonka_node.aggregator.shard import DirExchange, shard_role
    from gonka_node.aggregator.store import Store
    from gonka_node.core.config import AggregationSettings, RoundSettings

    index, shards = shard
    cfg = model_for(params)
    init_path = workdir.parent / "init.safetensors"  # written by the client process: no server builds the model
    init_sha = recorded_sha256(init_path)
    backend, dev, deployment, epoch = epoch_with_hosts(n_hosts, init_sha, shards)
    spec = spec_of(cfg)
    ctx = EpochContext(
        chain_id=deployment.chain_id, registry=bytes.fromhex(deployment.registry[2:]), epoch=epoch, codec_name=CODEC,
        codec=get_codec(CODEC), spec=spec, n_rounds=2,
        round_length_s=3600, outer_lr=0.7, outer_momentum=0.9, reward_per_round=1000 * GNK, initial_checkpoint=init_path,
        initial_sha256=init_sha, **(scoring_inputs(cfg, n_hosts) if checks else {}),
    )  # fmt: skip
    exchange = None
    if shards > 1:
        role = shard_role(spec, [bytes.fromhex(dev[1 + i].address[2:]) for i in range(shards)],
                          bytes.fromhex(dev[1 + index].address[2:]), "clip_median")
        ctx = dataclasses.replace(ctx, spec=role.spec if role else spec, shard=role, model_factory=None, scoring=None)
        exchange = DirExchange(workdir.parent / "exchange")
    engine = RoundEngine(
        ctx, RoundSettings(max_update_norm=1e6, max_payload_bytes=max(512 << 20, 2 * cfg.num_params())), AggregationSettings(rule="clip_median"),
        Store(workdir / "agg").open(), ChainView(ChainClient(backend, dev[1 + index], deployment).connect()),
        TrainingCheckpoints(), Key(bytes([1 + index]) * 32), exchange=exchange,
    )  # fmt: skip
    asyncio.run(_serve_engine(engine))
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}), flush=True)


def initial_model(cfg: ModelConfig, path: Path) -> None:
    """The round-0 model, written by the client process once per run (every shard reads it)."""
    from gonka_node.aggregator.checkpoints import TrainingCheckpoints
    from training.model import build_model

    base = {n: p.detach() for n, p in build_model(cfg, 0).named_parameters()}
    TrainingCheckpoints().save(path, base, {})


def recorded_sha256(path: Path) -> bytes:
    """The canonical hash a checkpoint records in its metadata (read without loading a tensor; the
    engine verifies the tensors against it when a round loads them)."""
    from safetensors import safe_open

    from training.checkpoint import META_SHA256

    with safe_open(str(path), framework="pt") as f:
        return bytes.fromhex((f.metadata() or {})[META_SHA256])


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: VmHWM, which starts afresh at exec (ru_maxrss does
    not on Linux: a child starts from its parent's peak at fork, here the client holding the payloads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _serve_engine(engine: Any) -> None:
    from gonka_node.aggregator.server import AggregatorServer
    from gonka_node.core.tls import create_identity

    engine.sketch_tables.result()  # before the RSS "before the round" is read, and before any upload
    identity = create_identity()
    server = AggregatorServer(engine, identity, "127.0.0.1:0")
    port = await server.start()
    print(json.dumps({"port": port, "tls_cert": identity.cert_pem.decode(), "setup_rss_mb": peak_rss_mb()}), flush=True)
    await _until_sigterm()
    await server.stop(0.5)


async def _until_sigterm() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


def serve_bare() -> None:
    """A server whose Submit reads every message of the stream and discards it: the transport alone."""
    from gonka_node.aggregator.server import MESSAGE_LIMIT
    from gonka_node.core.tls import create_identity, server_credentials
    from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc

    class Discard(pb_grpc.AggregatorServicer):
        async def Submit(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.Receipt:
            async for _ in request_iterator:
                pass
            return pb.Receipt(accepted=True)

    async def main() -> None:
        identity = create_identity()
        limits = [("grpc.max_receive_message_length", MESSAGE_LIMIT), ("grpc.max_send_message_length", MESSAGE_LIMIT)]
        server = grpc.aio.server(options=limits)
        pb_grpc.add_AggregatorServicer_to_server(Discard(), server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(identity))
        await server.start()
        print(json.dumps({"port": port, "tls_cert": identity.cert_pem.decode(), "setup_rss_mb": 0}), flush=True)
        await _until_sigterm()
        await server.stop(0.5)

    asyncio.run(main())


def payloads(cfg: ModelConfig, n_hosts: int, directory: Path) -> list[Path]:
    """Distinct, plausible updates: a shared direction plus per-host noise of the same size, encoded
    tensor by tensor (a payload's parts are independent) into one file per host, so only one fp32
    tensor is held at a time, and an upload reads its payload when it starts: the client holds the
    payloads in flight, not all of them (64 of the 10.1M model, or four of a 1.2B one, are 5 GB)."""
    spec = spec_of(cfg)
    codec = get_codec(CODEC)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # no server runs yet: the client may use every core
    out = []
    try:
        for i in range(n_hosts):
            out.append(directory / f"host{i}.payload")
            with open(out[-1], "wb") as f:
                f.write(codec.header(spec))
                for k, name in enumerate(sorted(spec), start=1):
                    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                    shared = torch.randn(spec[name], generator=gen)
                    noise = torch.randn(spec[name], generator=torch.Generator().manual_seed(i * 7919 + k))
                    f.write(codec.encode_tensor(name, shared.add_(noise).mul_(1e-3)))
    finally:
        torch.set_num_threads(threads)
    return out


def fragment_files(paths: list[Path], spec: dict[str, tuple[int, ...]], shards: int, directory: Path) -> list[list[Path]]:
    """Each host's payload cut into its S fragment payloads (`split_payload`), one file per fragment."""
    from gonka_node.host.shards import split_payload

    out: list[list[Path]] = []
    for i, path in enumerate(paths):
        out.append([])
        for k, part in enumerate(split_payload(get_codec(CODEC), path.read_bytes(), spec, shards)):
            out[-1].append(directory / f"host{i}.fragment{k}")
            out[-1][-1].write_bytes(part)
    return out


class Aggregator:
    """A benchmark server process (`--serve` or `--serve-bare`), stopped by SIGTERM on exit."""

    def __init__(self, args: list[str], workdir: Path | None = None) -> None:
        extra = ["--workdir", str(workdir)] if workdir else []
        self.proc = subprocess.Popen([sys.executable, __file__, *args, *extra], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        self.hello = json.loads(self.proc.stdout.readline())
        self.target = f"127.0.0.1:{self.hello['port']}"

    def client(self) -> AggregatorClient:
        return AggregatorClient(self.target, self.hello["tls_cert"].encode(), timeout_s=3600)

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=300)
        return dict(json.loads(out.strip().splitlines()[-1])) if out.strip() else {}


def upload_all(n: int, submit: Callable[[int], None]) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(submit, range(n)))
    return time.perf_counter() - start


def bare_grpc_mb_s(paths: list[Path]) -> float:
    server = Aggregator(["--serve-bare"])
    info = pb.RoundInfo(chain_id=1, registry=bytes(20), epoch=1, round=1, base_checkpoint_sha256=bytes(32), codec=CODEC)
    try:
        keys = [host_keys(i) for i in range(len(paths))]  # before the clock starts, as in `run_one`
        with server.client() as client:

            def submit(i: int) -> None:
                evm, node = keys[i]
                data = paths[i].read_bytes()
                header = header_for(info, hashlib.sha256(evm).digest()[:20], data, 1000, node, bytes(32))
                assert client.submit_raw(_requests(header, data, 1 << 20)).accepted

            seconds = upload_all(len(paths), submit)
    finally:
        server.stop()
    return round(sum(p.stat().st_size for p in paths) / 1e6 / seconds, 1)


def run_one(
    cfg: ModelConfig, params: float | None, n_hosts: int, checks: bool, paths: list[Path], shards: int = 1
) -> dict[str, Any]:
    from eth_account import Account

    from gonka_node.host.shards import submit_fragments

    with tempfile.TemporaryDirectory() as tmp:
        args = ["--serve", str(n_hosts), *(["--params", str(params)] if params else []), *(["--checks"] if checks else [])]
        servers: list[Aggregator] = []
        initial_model(cfg, Path(tmp) / "init.safetensors")
        try:
            for i in range(shards):
                extra = ["--shard", f"{i}/{shards}"] if shards > 1 else []
                (Path(tmp) / f"s{i}").mkdir()
                servers.append(Aggregator([*args, *extra], Path(tmp) / f"s{i}"))
            clients = [s.client() for s in servers]
            info = clients[0].open_round()
            spec = spec_of(cfg)
            parts = fragment_files(paths, spec, shards, Path(tmp)) if shards > 1 else [[p] for p in paths]

            # The hosts' keys and addresses before the clock starts (deriving an address is no part of an
            # upload, and the bare stream's client derives none).
            keys = [host_keys(i)[1] for i in range(n_hosts)]
            addrs = [bytes.fromhex(Account.from_key(host_keys(i)[0]).address[2:]) for i in range(n_hosts)]

            def submit(i: int) -> None:
                addr, node = addrs[i], keys[i]
                data = [p.read_bytes() for p in parts[i]]
                accepted, why = submit_fragments(clients, info.round, data, addr, node, 1000,
                                                 residual_root=bytes(32))
                assert accepted, why

            seconds = upload_all(n_hosts, submit)
            last = time.perf_counter()
            results = [_wait_finalized(c, info.epoch, info.round) for c in clients]
            done = time.perf_counter()
            for c in clients:
                c.close()
        finally:
            stopped = [s.stop().get("peak_rss_mb", 0.0) for s in servers]
    largest = max(range(len(servers)), key=lambda k: stopped[k])
    total_mb = sum(p.stat().st_size for p in paths) / 1e6
    return {
        "hosts": n_hosts,
        "shards": shards,
        "params": cfg.num_params(),
        "payload_mb": round(total_mb / n_hosts, 3),
        "ingest_mb_s": round(total_mb / seconds, 1),
        "finalize_latency_s": round(done - last, 2),
        "peak_rss_mb": round(stopped[largest], 1),
        "rss_before_round_mb": round(servers[largest].hello["setup_rss_mb"], 1),  # chain, contracts, model, imports
        "aggregated": min(sum(1 for c in r.contributions if c.aggregated) for r in results),
    }


def _wait_finalized(client: AggregatorClient, epoch: int, round_: int) -> pb.RoundResult:
    while True:
        try:
            return client.round_result(epoch, round_)
        except grpc.RpcError:  # NOT_FOUND until finalized
            time.sleep(0.05)


def stages(cfg: ModelConfig) -> dict[str, float]:
    """Per-stage cost of one payload in this process (best of 5, one torch thread), in ms."""
    from gonka_node.aggregator.validate import Sketcher, mapped, scan_update, square_norm

    torch.set_num_threads(1)
    spec, codec = spec_of(cfg), get_codec(CODEC)
    with tempfile.TemporaryDirectory() as tmp:
        data = payloads(cfg, 1, Path(tmp))[0].read_bytes()
        update = codec.decode(data, spec)
        part = Path(tmp) / "payload.part"

        def spool() -> None:
            with open(part, "wb") as f:
                for chunk in _chunked(data):
                    f.write(chunk)

        def sketch() -> None:
            s = Sketcher()
            for name in sorted(update):
                s.add(update[name])

        def scan() -> None:
            with open(part, "rb") as f, mapped(f) as view:
                scan_update(codec, view, spec, 1e9)

        steps: dict[str, Callable[[], object]] = {
            "sha256": lambda: hashlib.sha256(data).digest(),
            "spool_write": spool,
            "fsync": lambda: _fsync(part),
            "decode": lambda: codec.decode(data, spec),
            "norm_and_finite": lambda: [square_norm(n, update[n], spec[n]) for n in sorted(spec)],
            "sketch": sketch,
            "decode_check_sketch": scan,
        }
        out = {name: _best_ms(step) for name, step in steps.items()}
    out["payload_mb"] = len(data) / 1e6
    return out


def _chunked(data: bytes) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), 1 << 20):
        yield bytes(view[start : start + (1 << 20)])


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _best_ms(step: Callable[[], object], repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return round(best * 1000, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", help="hosts per run (default: 4 and 64)")
    parser.add_argument("--shards", type=int, help="aggregator shards (default: 1, plus a 4-shard run of 4 hosts)")
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    parser.add_argument("--params", type=float, help="model size in parameters (default: the 10.1M bench model)")
    parser.add_argument("--checks", action="store_true", help="score every host too (forward passes per host)")
    parser.add_argument("--stages", action="store_true", help="print per-stage costs of one payload and exit")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare gRPC stream measurement")
    parser.add_argument("--repeat", type=positive, default=3,
                        help="measure each run this many times, each after its own bare stream (default: 3)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # client and server share the machine
    if args.serve_bare:
        serve_bare()
        return 0
    if args.serve:
        index, shards = (int(x) for x in args.shard.split("/")) if args.shard else (0, 1)
        serve(args.serve, args.workdir, args.params, args.checks, (index, shards))
        return 0
    cfg = model_for(args.params)
    print(f"model: {cfg.num_params() / 1e6:.2f}M parameters, codec {CODEC}", file=sys.stderr)
    if args.stages:
        print(json.dumps(stages(cfg), indent=2))
        return 0
    report = measure(cfg, args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def plan(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(hosts, shards) of each run: the default covers 4 and 64 hosts on one aggregator and 4 on 4 shards."""
    if args.hosts is None and args.shards is None:
        return [(4, 1), (64, 1), (4, 4)]
    return [(n, args.shards or 1) for n in (args.hosts or [4, 64])]


def measure(cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Each (hosts, shards) run `--repeat` times, a bare stream of the same payloads measured right
    before each repeat, so every ratio pairs two measurements taken seconds apart (on shared cores the
    two drift together; measured minutes apart, one run's ratio ranged 43-62 % on an idle machine)."""
    runs = plan(args)
    with tempfile.TemporaryDirectory() as tmp:
        data = payloads(cfg, max(n for n, _ in runs), Path(tmp))
        return _measure(cfg, args, runs, data)


def _measure(cfg: ModelConfig, args: argparse.Namespace, runs: list[tuple[int, int]], data: list[Path]) -> dict[str, Any]:
    bare_data = data[: max(STREAMS * 4, min(len(data), 64))]
    report: dict[str, Any] = {"model_params": cfg.num_params(), "codec": CODEC, "checks": args.checks,
                              "repeat": args.repeat}  # fmt: skip
    bare_all: list[float] = []
    report["runs"] = []
    for n, shards in runs:
        repeats = []
        for _ in range(args.repeat):
            bare = None if args.no_bare else bare_grpc_mb_s(bare_data)
            one = run_one(cfg, args.params, n, args.checks, data[:n], shards)
            repeats.append({**one, "bare_grpc_mb_s": bare})
            print(json.dumps(repeats[-1]), flush=True)
        bare_all += [r["bare_grpc_mb_s"] for r in repeats if r["bare_grpc_mb_s"] is not None]
        report["runs"].append(summarise(repeats))
        print(json.dumps({k: v for k, v in report["runs"][-1].items() if k != "repeats"}), flush=True)
    if bare_all:
        report["bare_grpc_mb_s"] = statistics.median(bare_all)
    return report


def summarise(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's repeats: medians of the rates and latencies, the largest memory figures (a memory
    target must hold in every repeat), and ingest / bare as the median of each repeat's own ratio."""
    first = repeats[0]
    out: dict[str, Any] = {k: first[k] for k in ("hosts", "shards", "params", "payload_mb")}
    out["ingest_mb_s"] = round(statistics.median(r["ingest_mb_s"] for r in repeats), 1)
    out["finalize_latency_s"] = round(statistics.median(r["finalize_latency_s"] for r in repeats), 2)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in repeats)
    out["rss_before_round_mb"] = max(r["rss_before_round_mb"] for r in repeats)
    out["aggregated"] = min(r["aggregated"] for r in repeats)
    bares = [r["bare_grpc_mb_s"] for r in repeats if r["bare_grpc_mb_s"]]
    if bares:
        ratios = [r["ingest_mb_s"] / r["bare_grpc_mb_s"] for r in repeats if r["bare_grpc_mb_s"]]
        out["bare_grpc_mb_s"] = round(statistics.median(bares), 1)
        out["ingest_vs_bare"] = round(statistics.median(ratios), 3)
        out["ingest_vs_bare_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    out["repeats"] = repeats
    return out


if __name__ == "__main__":
    sys.exit(main())
