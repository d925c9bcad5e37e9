"""Running the model server: `ServeSettings`, the aiohttp runner, and `start_model_server`.

`start_model_server` is the entry point other parts call (`gonka-node serve`, the devnet): it opens the
chain read-only, loads and verifies the chosen round (blocking until it serves), listens on
127.0.0.1 (or `host`), and with `round_="latest"` follows the chain. It returns a handle with the
base URL clients use (`http://HOST:PORT/v1`) and `stop()`. The HTTP server runs on its own event loop
in a thread; each served round has its own engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from gonka_node.serve.app import HttpSettings, build_app
from gonka_node.serve.engine import BatchEngine
from gonka_node.serve.follow import ChainFollower, CheckpointSource, VerifiedModel, load_round, open_chain
from gonka_node.serve.models import ModelRegistry, ServedModel
from gonka_node.serve.protocol import Limits

log = logging.getLogger(__name__)
ROUND_LATEST = "latest"


class ListenError(Exception):
    """The HTTP server could not bind its address (in use, not this machine's, not permitted)."""


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    max_batch: int = 32  # sequences decoded together (batch slots per served round)
    max_waiting: int = 64  # sequences queued for a slot; more is answered 429
    limits: Limits = field(default_factory=Limits)
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 120.0
    keep_rounds: int = 2  # rounds served at once with --round latest (older ids answer 404)
    poll_s: float = 2.0  # how often --round latest asks the chain for a newer round
    device: str | None = None  # default: cuda when available, else cpu

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_waiting", "max_body_bytes", "keep_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_waiting < self.limits.max_choices:  # such a request could never be queued: 429 forever
            raise ValueError(f"max_waiting ({self.max_waiting}) must be >= the completions one request may "
                             f"ask for ({self.limits.max_choices})")

    def http(self) -> HttpSettings:
        return HttpSettings(self.limits, self.max_body_bytes, self.request_timeout_s)

    def resolved_device(self) -> str:
        import torch

        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")


def serve_model(registry: ModelRegistry, loaded: VerifiedModel, settings: ServeSettings) -> ServedModel:
    """Put a verified model behind its own batching engine in `registry`."""
    name = f"epoch-{loaded.provenance.epoch}-round-{loaded.provenance.round}"
    engine = BatchEngine(loaded.model, max_batch=settings.max_batch, max_waiting=settings.max_waiting, name=name)
    return registry.add(loaded.provenance, engine, loaded.tokenizer)


class HttpThread:
    """The aiohttp server on an event loop of its own, in a thread."""

    def __init__(self, registry: ModelRegistry, settings: ServeSettings, host: str, port: int) -> None:
        self._app = build_app(registry, settings.http())
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="gonka-serve-http", daemon=True)

    def start(self) -> int:
        """Listen; the port bound (ListenError if it cannot)."""
        self._thread.start()
        future: Future[int] = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        try:
            return future.result(30.0)
        except OSError as exc:
            self._close_loop()
            raise ListenError(f"cannot listen on {self._host}:{self._port} ({exc.strerror or exc})") from None
        except BaseException:
            self._close_loop()
            raise

    async def _listen(self) -> int:
        # handler_cancellation: a client that hangs up cancels its handler, which frees its batch slots.
        runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        return int(runner.addresses[0][1])

    def stop(self) -> None:
        if self._runner is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30.0)
        self._close_loop()

    def _close_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        self._loop.close()


@dataclass
class ModelServerHandle:
    """A running model server: `url` is the OpenAI base URL (`http://HOST:PORT/v1`)."""

    url: str
    port: int
    registry: ModelRegistry
    _http: HttpThread
    _follower: ChainFollower | None
    _cache: tempfile.TemporaryDirectory[str] | None

    def stop(self) -> None:
        """Stop following, stop listening, stop the engines (requests still running fail)."""
        if self._follower is not None:
            self._follower.stop()
        self._http.stop()
        self.registry.stop()
        if self._cache is not None:
            self._cache.cleanup()

    def served(self) -> list[ServedModel]:
        return self.registry.listed()


def start_model_server(
    rpc_url: str | None, deployment: Path, epoch: int, port: int = 0, *, round_: str = ROUND_LATEST,
    host: str = "127.0.0.1", recipe: Path | None = None, aggregator: str | None = None,
    tls_cert: Path | None = None, cache_dir: Path | None = None, settings: ServeSettings | None = None,
    tokenizer: Path | None = None,
) -> ModelServerHandle:
    """Serve epoch `epoch`'s round `round_` (a number, or "latest" to follow the chain) over the OpenAI
    API; returns once the first verified checkpoint is served. Raises CliError (a one-line reason) if
    the chain, the checkpoint or its verification fails, ListenError if the port cannot be bound.
    Prompts and completions use the epoch recipe's tokenizer: `tokenizer` (a tokenizer.json checked
    against the recipe's sha256), else the one stored with the recipe's dataset."""
    settings = settings or ServeSettings()
    temporary = None
    if cache_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="gonka-serve-")
        cache_dir = Path(temporary.name)
    source = CheckpointSource(deployment, epoch, cache_dir,
                              rpc_url, recipe, aggregator, tls_cert, tokenizer=tokenizer)
    device = settings.resolved_device()
    try:
        client = open_chain(source)
        handle = serve_verified(load_round(client, source, round_, device), port, host=host, settings=settings)
    except BaseException:
        if temporary is not None:
            temporary.cleanup()
        raise
    handle._cache = temporary
    if round_ == ROUND_LATEST:
        registry = handle.registry
        handle._follower = ChainFollower(
            client, source, registry, lambda m: _log_added(serve_model(registry, m, settings)), device=device,
            poll_s=settings.poll_s,
        ).start()
    return handle


def serve_verified(
    loaded: VerifiedModel, port: int = 0, *, host: str = "127.0.0.1", settings: ServeSettings | None = None,
) -> ModelServerHandle:
    """Serve a model the caller has verified (its provenance is what responses will claim): the part of
    `start_model_server` after the chain, for callers that load weights themselves (the benchmark)."""
    settings = settings or ServeSettings()
    registry = ModelRegistry(settings.keep_rounds)
    try:
        serve_model(registry, loaded, settings)
        http = HttpThread(registry, settings, host, port)
        bound = http.start()
    except BaseException:
        registry.stop()
        raise
    shown = f"[{host}]" if ":" in host else host
    return ModelServerHandle(f"http://{shown}:{bound}/v1", bound, registry, http, None, None)


def _log_added(served: ServedModel) -> None:
    log.info("now serving %s (checkpoint sha256 %s)", served.id, served.provenance.sha256)
