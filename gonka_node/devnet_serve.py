"""`devnet --serve`: after the report the chain (now following the wall clock) and the aggregator keep
running until Ctrl-C or SIGTERM, and their addresses are printed. Other long-running services start
beside them then: each `ExtraService` in `SERVICES` (the hook for `gonka-node explorer`, `gonka-node
serve` and the like) is a `gonka-node` verb whose arguments are built from a `ServeContext` (chain URL,
deployment file, epoch, aggregator), started as a child like the others, and announced with the
address it reports once ready.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gonka_node.devnet_chain import DevnetChain
from gonka_node.devnet_procs import Children, DevnetError, child_env, wait_for


@dataclass(frozen=True)
class ServeContext:
    """What a service started beside a serving devnet knows about the network it joins."""

    out: Path  # the devnet folder; a service may write its files (logs, port files) here
    chain_url: str
    deployment: Path
    epoch: int
    aggregator: str  # HOST:PORT of the aggregator's gRPC (TLS) service
    aggregator_cert: Path  # the certificate clients pin (also announced on chain)


@dataclass(frozen=True)
class ExtraService:
    """A long-running `gonka-node` verb started beside the chain and the aggregator by `devnet --serve`.

    `args(ctx)` is the verb and its flags; `ready(ctx)` says when it is up (e.g. its port file exists);
    `address(ctx)`, read once ready, is what the devnet prints for it (e.g. "http://127.0.0.1:PORT")."""

    name: str
    args: Callable[[ServeContext], list[str]]
    address: Callable[[ServeContext], str]
    ready: Callable[[ServeContext], bool] = lambda ctx: True


def printed_url(ctx: ServeContext, name: str, prefix: str) -> str | None:
    """The URL a child printed on its line starting with `prefix` (its log is logs/<name>.log), or None yet."""
    log = ctx.out / "logs" / f"{name}.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((line.removeprefix(prefix).strip() for line in lines if line.startswith(prefix)), None)


EXPLORER = ExtraService(
    "explorer",
    args=lambda ctx: ["explorer", "--deployment", str(ctx.deployment), "--rpc", ctx.chain_url, "--port", "0",
                      "--db", str(ctx.out / "explorer.sqlite3")],
    address=lambda ctx: printed_url(ctx, "explorer", "explorer:") or "?",
    ready=lambda ctx: printed_url(ctx, "explorer", "explorer:") is not None,
)


def _model_url(ctx: ServeContext) -> str | None:
    line = printed_url(ctx, "model", "model:")
    return line.split()[0] if line else None


MODEL = ExtraService(
    "model",
    args=lambda ctx: ["serve", "--deployment", str(ctx.deployment), "--rpc", ctx.chain_url, "--epoch",
                      str(ctx.epoch), "--round", "latest", "--port", "0", "--threads", "1",
                      "--cache-dir", str(ctx.out / "serve-cache")],
    address=lambda ctx: _model_url(ctx) or "?",
    ready=lambda ctx: _model_url(ctx) is not None,
)


SERVICES: list[ExtraService] = [EXPLORER, MODEL]


def keep_serving(
    ctx: ServeContext, chain: DevnetChain, children: Children, services: Sequence[ExtraService],
    say: Callable[[str], None], stop: threading.Event | None = None,
) -> None:
    """Start `services`, print every address, and wait for `stop`, SIGTERM or Ctrl-C (then return)."""
    if chain.server is not None:
        chain.server.follow_clock = True  # deadlines now pass with the wall clock, from the devnet's lead
    logs = ctx.out / "logs"
    for service in services:
        children.start(service.name, service.args(ctx), logs / f"{service.name}.log", child_env())
        wait_for(f"{service.name} to start", functools.partial(service.ready, ctx), 120, children, logs)
    say(f"serving until Ctrl-C: chain {ctx.chain_url} (deployment {ctx.deployment}, epoch {ctx.epoch})")
    say(f"aggregator: {ctx.aggregator} (TLS certificate {ctx.aggregator_cert}, also announced on chain)")
    for service in services:
        say(f"{service.name}: {service.address(ctx)}")
    say(f"try: gonka-node checkpoint list --deployment {ctx.deployment}")
    stop = stop or threading.Event()
    _stop_on_sigterm(stop)
    try:
        while not stop.wait(0.5):
            _check_serving(children, logs)
    except KeyboardInterrupt:
        pass
    say("stopping the devnet")


def _check_serving(children: Children, logs: Path) -> None:
    """While serving, hosts have left; every other child must still run."""
    for name, proc in children.procs.items():
        if not name.startswith("host") and proc.poll() is not None:
            tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
            raise DevnetError(f"{name} exited with status {proc.returncode} while serving; its log ends:\n{tail}")


def _stop_on_sigterm(stop: threading.Event) -> None:
    if threading.current_thread() is threading.main_thread():  # signals can only be set from there
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
