"""Pieces of the fault tests: a controllable TCP proxy and a small network of real processes.

`TcpProxy` sits on 127.0.0.1:0 in front of a real server (the chain's JSON-RPC, or the aggregator's
gRPC port). It can cut every connection and refuse new ones for a while (an outage), cut right after
forwarding a request that contains a marker (so the request lands and its answer is lost), and throttle
the client → server direction (a slow uplink).

`FaultNet` is the devnet in miniature, for tests: the embedded chain served on loopback, contracts
deployed, one epoch from a tiny recipe with every host signed in ahead, key folders and TOML configs
written the way `gonka_node.devnet` writes them, and `gonka-node aggregator` / `gonka-node run` started
as real processes whose logs go to files. Every child is SIGKILLed on `close()`. The aggregator serves
TLS with the identity it makes in its data_dir at first start; hosts and `aggregator_client` pin it
(the proxy forwards bytes, so TLS runs end to end through it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from eth_utils import function_signature_to_4byte_selector
from stdlib_corpus import write_small_corpus

from chain.backends import EmbeddedBackend
from chain.client import ChainClient
from chain.server import ChainServer
from chain.types import Deployment
from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import AggregatorConfig, ChainSettings, RoundSettings
from gonka_node.core.config_file import write_config
from gonka_node.core.keys import NodeKeys, init_keys, load_keys
from gonka_node.core.recipe import Recipe
from gonka_node.core.tls import load_certificate
from gonka_node.devnet_procs import aggregator_cert
from gonka_node.epoch_setup import EpochTerms, epoch_spec, initial_checkpoint
from gonka_node.host.config import HostConfig
from proto.gonka.v1 import aggregator_pb2 as pb
from training.codecs import get_codec
from training.model import ModelConfig, build_model

GNK = 10**9
AGGREGATOR = 9  # dev account index; hosts are 1..N
SIGNIN_WINDOW_S = 600
REPO = Path(__file__).resolve().parents[2]
# A finalize_round transaction on the wire: the JSON-RPC method and the function's selector in its data
# (the aggregator also sends seed commitments, reveals and announcements).
FINALIZE_TX = (b"eth_sendRawTransaction",
               function_signature_to_4byte_selector("finalize_round(uint256,uint256,bytes32,bytes32,uint32,uint256)")
               .hex().encode())


class TcpProxy:
    """A loopback TCP relay with an off switch, a one-shot trip wire and an uplink throttle."""

    def __init__(self, upstream_port: int, chunk: int = 4096) -> None:
        self.upstream_port = upstream_port
        self.chunk = chunk
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._down = threading.Event()
        self._stopped = False
        self._trip: tuple[bytes, ...] | None = None
        self.tripped_at: float | None = None
        self.rate: float | None = None  # bytes/s client → server; None: unthrottled
        self.uplink_bytes = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def cut(self) -> None:
        """Drop every open connection and close new ones at once: the server looks unreachable."""
        self._down.set()
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)

    def restore(self) -> None:
        self._down.clear()

    def cut_after(self, *markers: bytes) -> None:
        """Cut right after forwarding the first client bytes that contain every one of `markers`."""
        self._trip = markers

    def stop(self) -> None:
        self._stopped = True
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down.is_set():
                _close(client)
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            except OSError:
                _close(client)
                continue
            # The timeout was for connecting. Left on, it cut any downlink quiet for 10 s: a throttled
            # TLS upload is one (the server decrypts, and so answers, only once a whole record is in).
            server.settimeout(None)
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, uplink: bool) -> None:
        try:
            while data := src.recv(self.chunk):
                if self._down.is_set():
                    break
                tripped = uplink and self._trip is not None and all(m in data for m in self._trip)
                if tripped:
                    self._down.set()  # before forwarding: the answer must not get back
                    self.tripped_at = time.monotonic()
                    self._trip = None
                if uplink and self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
                if uplink:
                    self.uplink_bytes += len(data)
                if tripped:
                    time.sleep(0.5)  # let the request land upstream, then drop everything
                    self._drop_all()
                    break
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


@dataclass
class FaultNet:
    """A chain, an epoch and the configs of one aggregator and `hosts` hosts (all signed in)."""

    out: Path
    hosts: int = 2
    rounds: int = 1
    round_length_s: int = 600
    quorum: int = 2
    extend_s: float = 120.0
    max_extensions: int = 2
    scoring: bool = False  # every valid update scores 1: the faults, not the scores, are under test
    inner_steps: int = 4
    stream_idle_s: float = 30.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.backend = EmbeddedBackend()
        self.server = ChainServer(self.backend, "127.0.0.1", 0).start()
        try:
            self._setup()
        except BaseException:
            self.server.stop()
            raise

    def _setup(self) -> None:
        accounts = self.accounts = self.backend.dev_accounts()
        deployer = ChainClient(self.backend, accounts[0]).connect()
        self.deployment: Deployment = deployer.deploy_all(
            initial_mint={a.address: 1_000_000 * GNK for a in accounts}
        )
        self.deployment.save(self.out / "deployment.json")
        self.recipe = Recipe(
            model=ModelConfig.preset("tiny"),
            corpus=str(write_small_corpus(self.out)),
            seq_len=32,
            micro_batch=4,
            inner_steps=self.inner_steps,
            inner_lr=3e-3,
            warmup_steps=1,
            n_rounds=self.rounds,
            codec="int8",
        ).with_data_manifest()
        self.recipe.save(self.out / "recipe.json")
        init_sha = initial_checkpoint(self.recipe, self.out / "aggregator" / "initial.safetensors")
        terms = EpochTerms(
            aggregators=[accounts[AGGREGATOR].address],
            round_length_s=self.round_length_s,
            signin_window_s=SIGNIN_WINDOW_S,
            min_stake=100 * GNK,
            max_hosts=8,
            reward_per_round=100 * GNK,
        )
        gov = self.client(0)
        self.epoch = gov.create_epoch(epoch_spec(self.recipe, init_sha, terms, "file:recipe.json"))
        gov.fund_epoch(self.epoch, self.rounds * terms.reward_per_round)
        for name, index in [("aggregator", AGGREGATOR)] + [(f"host{i}", i) for i in self.host_ids]:
            init_keys(self.out / "keys" / name, None, insecure_plaintext=True, force=True,
                      evm_private_key=bytes(accounts[index].key))
        for i in self.host_ids:  # signed in ahead, so the sign-in window can close before rounds start
            self.client(i).join(self.epoch, 100 * GNK, self.keys(i).node_public_key)
        self.backend.increase_time(SIGNIN_WINDOW_S + 1)

    @property
    def host_ids(self) -> range:
        return range(1, self.hosts + 1)

    @property
    def chain_port(self) -> int:
        return int(self.server.url.rsplit(":", 1)[1].rstrip("/"))

    def client(self, i: int) -> ChainClient:
        return ChainClient(self.backend, self.accounts[i], self.deployment).connect()

    def keys(self, i: int) -> NodeKeys:
        return load_keys(self.out / "keys" / f"host{i}")

    def host_address(self, i: int) -> bytes:
        return bytes.fromhex(self.accounts[i].address[2:])

    # ---- processes -----------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        return env

    def _spawn(self, name: str, args: list[str]) -> Path:
        self.starts[name] = self.starts.get(name, 0) + 1
        log = self.logs / f"{name}-{self.starts[name]}.log"
        with open(log, "wb") as sink:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "gonka_node", *args], stdout=sink, stderr=subprocess.STDOUT,
                env=self._env(), cwd=REPO,
            )
        return log

    def start_aggregator(self, rpc_url: str | None = None, timeout_s: float = 90) -> str:
        """Start `gonka-node aggregator` (chain at `rpc_url`, default the chain itself); its target."""
        cfg = self.out / "aggregator.toml"
        keys = self.out / "keys" / "aggregator"
        write_config(AggregatorConfig(
            data_dir=self.out / "aggregator", listen="127.0.0.1:0", node_key=keys / "node_key.json",
            evm_key=keys / "evm_key.json", recipe=self.out / "recipe.json", deployment=self.out / "deployment.json",
            epoch=self.epoch, scoring=self.scoring, chain=ChainSettings(backend="rpc", rpc_url=rpc_url or self.server.url),
            round=RoundSettings(quorum=self.quorum, extend_s=self.extend_s, max_extensions=self.max_extensions,
                                stream_idle_s=self.stream_idle_s),
        ), cfg)
        port_file = self.out / "aggregator.port"
        port_file.unlink(missing_ok=True)
        self._spawn("aggregator", ["aggregator", "--config", str(cfg), "--port-file", str(port_file)])
        self.wait("the aggregator to listen", port_file.exists, timeout_s)
        return f"127.0.0.1:{port_file.read_text().strip()}"

    def start_host(self, i: int, aggregator: str) -> Path:
        cfg = self.out / f"host{i}.toml"
        write_config(HostConfig(
            key_dir=self.out / "keys" / f"host{i}", state_dir=self.out / f"host{i}", aggregator=aggregator,
            recipe=self.out / "recipe.json", deployment=self.out / "deployment.json", rpc_url=self.server.url,
            epoch=self.epoch, stake=100 * GNK, cache_dir=self.out / "cache", aggregator_tls_cert=aggregator_cert(self.out),
        ), cfg)
        return self._spawn(f"host{i}", ["run", "--config", str(cfg), "--quiet"])

    def aggregator_client(self, target: str, timeout_s: float = 30) -> AggregatorClient:
        """A client of the running aggregator (directly or through a proxy), pinning its certificate."""
        return AggregatorClient(target, load_certificate(aggregator_cert(self.out)), timeout_s)

    def kill(self, name: str) -> None:
        """SIGKILL: no handler runs, nothing is flushed or closed."""
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def log(self, name: str, start: int | None = None) -> str:
        n = start or self.starts.get(name, 1)
        return (self.logs / f"{name}-{n}.log").read_text(errors="replace")

    def wait(self, what: str, ready: Callable[[], bool], timeout_s: float, expect_exit: tuple[str, ...] = ()) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, p in self.procs.items():
                if name not in expect_exit and p.poll() not in (None, 0):
                    raise AssertionError(f"{name} exited with {p.returncode}; log:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs)
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
            time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(30)
        self.server.stop()

    # ---- what the test observes and does ----------------------------------------------------------------

    def agg_state(self, round_: int) -> str | None:
        """The round's state in the aggregator's SQLite file (read-only, beside the running process)."""
        db_path = self.out / "aggregator" / "state.sqlite3"
        if not db_path.exists():
            return None
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute("SELECT state FROM rounds WHERE epoch=? AND round=?", (self.epoch, round_)).fetchone()
        except sqlite3.OperationalError:
            return None
        finally:
            db.close()
        return None if row is None else str(row[0])

    def round_times(self, round_: int) -> tuple[int, int]:
        """(deadline_ms, closed_ms) of a closed round, on the aggregator's clock."""
        db = sqlite3.connect(f"file:{self.out / 'aggregator' / 'state.sqlite3'}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute(
                "SELECT deadline_ms, closed_ms FROM rounds WHERE epoch=? AND round=?", (self.epoch, round_)
            ).fetchone()
        finally:
            db.close()
        return int(row[0]), int(row[1])

    def finalize_txs_sent(self) -> int:
        """`finalize_round` transactions ever mined from the aggregator's account (it also commits and
        reveals round seeds, announces itself and publishes the recipe: those are not counted)."""
        registry = self.client(0).registry
        sender = self.accounts[AGGREGATOR].address
        with self.backend.lock:
            w3 = self.backend.connect()
            txs = [tx for n in range(int(w3.eth.block_number) + 1)
                   for tx in w3.eth.get_block(n, full_transactions=True)["transactions"]]
        return sum(1 for tx in txs if tx["from"] == sender and tx["to"] == registry.address
                   and registry.decode_function_input(tx.get("input", tx.get("data")))[0].fn_name == "finalize_round")

    def update_payload(self, seed: int) -> bytes:
        """A small valid encoded update (what a host would send, without training for it)."""
        model = build_model(self.recipe.model, self.recipe.init_seed)
        g = torch.Generator().manual_seed(seed)
        update = {n: torch.randn(p.shape, generator=g) * 1e-3 for n, p in model.named_parameters()}
        return get_codec(self.recipe.codec).encode(update)

    def submit_update(self, target: str, i: int, seed: int) -> pb.Receipt:
        """Submit a small valid update for host i (what a host would send, without training for it)."""
        payload = self.update_payload(seed)
        with self.aggregator_client(target) as agg:
            info = agg.open_round()
            return agg.submit(info, self.host_address(i), payload, self.keys(i).node_key.signing_key, 1000,
                              residual_root=bytes(32))  # no training, no residual: any 32 bytes are taken

    def open_round(self, target: str) -> pb.RoundInfo:
        with self.aggregator_client(target) as agg:
            return agg.open_round()
