"""The devnet's child processes: `gonka-node aggregator` and `gonka-node run` started with their logs
appended under out/logs, watched while the devnet waits (`wait_for` fails with a child's log tail
when it exits), and all stopped on the way out. The aggregator serves TLS only: it writes its
certificate at its first start (`aggregator_cert(out)`), which hosts and the devnet's own clients pin.
A sharded devnet starts one aggregator per shard (`aggregator_name`); `restart_aggregator` brings a
stopped one back on the port it had, which the chain already announces to hosts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gonka_node.core.client import AggregatorClient
from gonka_node.core.config import TLS_DIR, load_aggregator_config
from gonka_node.core.config_file import write_config
from gonka_node.core.tls import CERT_FILE, load_certificate
from gonka_node.host.config import load_host_config

AGGREGATOR_DIR = "aggregator"  # the aggregator's (shard 0's) data_dir under the devnet folder


def aggregator_name(shard: int) -> str:
    """Shard `shard`'s name: its data_dir, key folder, config (NAME.toml), log and child name."""
    return AGGREGATOR_DIR if shard == 0 else f"{AGGREGATOR_DIR}-shard{shard}"


class DevnetError(RuntimeError):
    pass


@dataclass
class Children:
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # held by `check` and by whoever stops and restarts a child from another thread, so that the
    # devnet's watch never sees the child between the two (re-entrant: a restart waits with `check`)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def start(self, name: str, args: list[str], log: Path, env: dict[str, str], prefix: tuple[str, ...] = ()) -> None:
        """`gonka-node ARGS` as child `name`; `prefix`: what runs it (`ip netns exec NS`: devnet_links.py)."""
        with self.lock, open(log, "ab") as sink:  # append: a restarted child keeps its earlier log
            self.procs[name] = subprocess.Popen(
                [*prefix, sys.executable, "-m", "gonka_node", *args], stdout=sink, stderr=subprocess.STDOUT, env=env
            )

    def check(self, logs: Path) -> None:
        with self.lock:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0):
                    tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise DevnetError(f"{name} exited with status {p.returncode}; its log ends:\n{tail}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, children: Children, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        children.check(logs)
        if time.monotonic() > deadline:
            raise DevnetError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def child_env() -> dict[str, str]:
    """The children's environment: ours without GONKA_* settings (the configs say everything)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def aggregator_cert(out: Path) -> Path:
    """The certificate the devnet's aggregator writes at its first start (its TLS identity's public half)."""
    return out / AGGREGATOR_DIR / TLS_DIR / CERT_FILE


def aggregator_client(out: Path, target: str, timeout_s: float = 120.0) -> AggregatorClient:
    """A client of the devnet's running aggregator, pinning the certificate it wrote."""
    return AggregatorClient(target, load_certificate(aggregator_cert(out)), timeout_s)


def start_aggregator(out: Path, children: Children, timeout_s: float = 120.0, shard: int = 0) -> str:
    """Start `gonka-node aggregator` on out/NAME.toml (NAME: `aggregator_name(shard)`); returns its
    HOST:PORT once it listens (HOST: its config's listen address)."""
    logs, name = out / "logs", aggregator_name(shard)
    port_file, cfg_file = out / f"{name}.port", out / f"{name}.toml"
    port_file.unlink(missing_ok=True)
    children.start(name, ["aggregator", "--config", str(cfg_file), "--port-file", str(port_file)],
                   logs / f"{name}.log", child_env())
    wait_for(f"{name} to listen", port_file.exists, timeout_s, children, logs)
    host = load_aggregator_config(cfg_file, environ={}).listen.rpartition(":")[0]
    return f"{host}:{port_file.read_text().strip()}"


def restart_aggregator(out: Path, children: Children, shard: int, timeout_s: float = 120.0) -> str:
    """Start shard `shard` again (same config, data_dir and log) on the port it listened on before:
    hosts keep dialling the endpoint the chain announced. Its process must have ended."""
    name = aggregator_name(shard)
    port = (out / f"{name}.port").read_text().strip()
    cfg_file = out / f"{name}.toml"
    cfg = load_aggregator_config(cfg_file, environ={})
    write_config(dataclasses.replace(cfg, listen=f"{cfg.listen.rpartition(':')[0]}:{port}"), cfg_file)
    return start_aggregator(out, children, timeout_s, shard)


def point_host_at(out: Path, i: int, target: str) -> Path:
    """Set host i's aggregator endpoint (HOST:PORT) in its config file, which it returns."""
    cfg = out / f"host{i}.toml"
    write_config(dataclasses.replace(load_host_config(cfg, environ={}), aggregator=target), cfg)
    return cfg


def start_host(
    out: Path, i: int, target: str, children: Children, extra: tuple[str, ...] = (), prefix: tuple[str, ...] = ()
) -> None:
    """Start (or restart: same config, same state dir) host i as `gonka-node run`; log appended.
    `prefix`: what runs it (`ip netns exec NS` with kernel-shaped links)."""
    cfg = point_host_at(out, i, target)
    children.start(f"host{i}", ["run", "--config", str(cfg), "--quiet", *extra], out / "logs" / f"host{i}.log",
                   child_env(), prefix)
