"""The explorer as one object: an index follower thread and a web server thread, started and stopped
together. `start_explorer(...)` is the entry point for `gonka-node explorer` and `devnet --serve`.

The follower indexes new blocks (`Indexer.step`), then asks aggregators for the finalized rounds it
has no report of (`ReportFetcher.step`), and sleeps `poll_s` when there was nothing new. A chain node
that does not answer is logged and retried; the pages keep serving what the index holds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from eth_account import Account
from web3.exceptions import Web3Exception

from chain.backends import ChainBackend, RpcBackend
from chain.client import ChainClient
from chain.errors import ChainError
from chain.types import Deployment
from gonka_node.explorer.db import IndexDb
from gonka_node.explorer.indexer import ChainMoved, Indexer, ReorgTooDeep
from gonka_node.explorer.queries import Site
from gonka_node.explorer.reports import ReportFetcher
from gonka_node.explorer.web import build_app

log = logging.getLogger(__name__)
DB_FILE = "explorer.sqlite3"
START_TIMEOUT_S = 30.0


class ExplorerStartError(RuntimeError):
    """The web server could not listen (port taken, bad address)."""


@dataclass(frozen=True)
class ExplorerOptions:
    port: int = 0  # 0: the OS picks one (read it from `Explorer.url`)
    host: str = "127.0.0.1"
    db_path: Path | None = None  # default: explorer.sqlite3 beside the deployment file
    aggregators: tuple[str, ...] = ()  # HOST:PORT of aggregators to ask; empty: every announced one
    poll_s: float = 0.5
    rpc_url: str = ""  # shown in the pages' `checkpoint pull` command
    deployment_file: str = "deployment.json"


@dataclass
class Explorer:
    """Holds a connected read-only `ChainClient`; `start()` opens the index and starts both threads."""

    chain: ChainClient
    options: ExplorerOptions
    db_path: Path
    url: str = ""
    error: str = ""  # set when the follower stopped for good (a reorg deeper than the index keeps)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _served: asyncio.Event | None = None

    def start(self) -> Explorer:
        deployment = self.chain.deployment
        assert deployment is not None
        identity = {"chain_id": deployment.chain_id, "registry": deployment.registry, "governor": deployment.governor}
        self.db = IndexDb(self.db_path).open(identity)
        self.indexer = Indexer(self.chain, self.db)
        self.fetcher = ReportFetcher(self.chain, self.db, self.options.aggregators)
        site = Site(deployment.chain_id, deployment.registry, deployment.governor, self.options.rpc_url,
                    self.options.deployment_file, downloads=True)
        ready = threading.Event()
        self._spawn("explorer-web", lambda: self._serve(build_app(site, self.db_path, self.fetcher.endpoints), ready))
        if not ready.wait(START_TIMEOUT_S) or not self.url:
            self.stop()
            raise ExplorerStartError(
                f"the explorer cannot listen on {self.options.host}:{self.options.port} (in use, or not an address "
                "of this machine): pick another --port or --host"
            )
        self._spawn("explorer-follow", self._follow)
        return self

    def _spawn(self, name: str, target: Callable[[], object]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None and self._served is not None:
            self._loop.call_soon_threadsafe(self._served.set)
        for thread in self._threads:
            thread.join(10)
        self.db.close()

    # ---- the follower -------------------------------------------------------------------------------

    def _follow(self) -> None:
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                added = self.indexer.step()
                self.fetcher.step()
                failing_since = None
            except ChainMoved as exc:
                log.info("%s; reading it again", exc)
                added = 0
            except ReorgTooDeep as exc:
                self.error = str(exc)
                log.error("explorer: %s", exc)
                return
            except (ChainError, OSError, Web3Exception) as exc:
                if failing_since is None:
                    log.warning("explorer: the chain node does not answer (%s); retrying", exc)
                    failing_since = time.monotonic()
                added = 0
            if added == 0:
                self._stop.wait(self.options.poll_s)

    # ---- the web server -----------------------------------------------------------------------------

    def _serve(self, app: web.Application, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, self.options.host, self.options.port).start())
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}/"
            self._served = asyncio.Event()
        except OSError as exc:
            log.error("explorer: cannot listen on %s:%s: %s", self.options.host, self.options.port, exc)
            ready.set()
            loop.run_until_complete(runner.cleanup())
            loop.close()
            return
        ready.set()
        loop.run_until_complete(self._served.wait())
        loop.run_until_complete(runner.cleanup())
        loop.close()


def open_chain(rpc_url: str, deployment: Deployment, backend: ChainBackend | None = None) -> ChainClient:
    """A connected read-only client: it only calls views, so a key made here (never used to sign) does."""
    return ChainClient(backend or RpcBackend(rpc_url), Account.create(), deployment).connect()


def start_explorer(
    rpc_url: str,
    deployment_path: Path,
    port: int = 0,
    db_path: Path | None = None,
    *,
    aggregators: Sequence[str] = (),
    host: str = "127.0.0.1",
    poll_s: float = 0.5,
) -> Explorer:
    """Index the deployment's chain into `db_path` (default: explorer.sqlite3 beside the deployment file)
    and serve the pages on host:port; returns once the server answers (`.url`, then `.stop()`).
    Raises `chain.errors.ChainError` (DeploymentError for a bad file) when the chain or the file is unusable."""
    deployment = Deployment.load(deployment_path)
    options = ExplorerOptions(port=port, host=host, db_path=db_path, aggregators=tuple(aggregators), poll_s=poll_s,
                              rpc_url=rpc_url, deployment_file=str(deployment_path))
    chain = open_chain(rpc_url, deployment)
    return Explorer(chain, options, db_path or deployment_path.parent / DB_FILE).start()
