"""`gonka-node aggregator --config agg.toml`: serve one epoch's rounds over gRPC (TLS) until interrupted.

The TLS identity is made at the first start in `<data_dir>/tls/` and reused after; its certificate
(`cert.pem`, never the key) is what hosts and clients pin.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from gonka_node.aggregator.challenger import Challenger
from gonka_node.aggregator.metrics import PrometheusMetrics
from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.cli import CliError
from gonka_node.cli.verbs import add_verb
from gonka_node.core.config import AggregatorConfig, ConfigError, load_aggregator_config, read_env
from gonka_node.core.storage import StoreError, open_store
from gonka_node.core.tls import CERT_FILE, TlsError, TlsIdentity, load_or_create_identity
from gonka_node.slashing import EvidenceLog

if TYPE_CHECKING:
    from nacl.signing import SigningKey

    from gonka_node.aggregator.chain_view import ChainView
    from gonka_node.aggregator.engine_types import EpochContext
    from gonka_node.aggregator.shard import ShardExchange
    from gonka_node.aggregator.store import Store

log = logging.getLogger(__name__)
SHARD_MESSAGES_DIR = "shard-messages"  # under data_dir: the signed messages a gRPC shard holds (shard_inbox.py)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_verb(
        subparsers, "aggregator", help="run an aggregator: collect, check, combine and finalize rounds",
        examples=["gonka-node aggregator --config aggregator.toml --passphrase-file agg.pass"],
        next="hosts find it on chain: gonka-node run --config host.toml --check; clients: gonka-node checkpoint list",
    )
    p.add_argument("--config", type=Path, required=True,
                   help="aggregator TOML file (gonka-node init aggregator writes a commented one)")
    p.add_argument("--listen", help="host:port to serve on (overrides [aggregator] listen)")
    p.add_argument("--data-dir", type=Path, help="state folder (overrides [aggregator] data_dir)")
    p.add_argument("--port-file", type=Path, help="write the port here once listening (for listen = …:0)")
    p.add_argument("--passphrase-file", type=Path,
                   help="file whose first line unlocks encrypted keys (mode 0600; else GONKA_KEY_PASSPHRASE)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gonka_node.cli.keys import read_passphrase_file

    try:
        cfg = load_aggregator_config(
            args.config, overrides={"listen": args.listen, "data_dir": args.data_dir}
        )
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    passphrase = read_passphrase_file(args.passphrase_file) if args.passphrase_file else None
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(cfg, args.config, args.port_file, passphrase))
    return 0


def _require(cfg: AggregatorConfig, where: Path, name: str) -> Path:
    value = getattr(cfg, name)
    if value is None:
        raise CliError(f"{where}: [aggregator] {name} is required")
    return value


async def _serve(
    cfg: AggregatorConfig, where: Path, port_file: Path | None = None, passphrase: str | None = None
) -> None:
    identity = _identity(cfg)
    engine = _build(cfg, where, passphrase)
    from gonka_node.aggregator.server import AggregatorServer

    if cfg.metrics_port:
        engine.metrics = _metrics(cfg.metrics_port)
    engine.publisher = _publisher(cfg, engine)

    server = AggregatorServer(engine, identity, cfg.listen)
    port = await server.start()
    await asyncio.to_thread(_announce, cfg, identity, engine, port)
    if port_file is not None:
        staged = port_file.with_name(port_file.name + ".tmp")
        staged.write_text(f"{port}\n")
        staged.replace(port_file)  # atomic: a waiting process never reads half a number
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    challenger = None
    if cfg.aggregation.challenge and isinstance(engine.evidence, EvidenceLog):
        uri = f"{public_endpoint(cfg, port)} evidence/<sha256>.json"
        challenger = asyncio.create_task(Challenger(engine, engine.evidence, uri).run(stop))
    await stop.wait()
    if challenger is not None:
        await challenger
    await server.stop(2.0)
    engine.store.close()


def _publisher(cfg: AggregatorConfig, engine: RoundEngine) -> RoundPublisher:
    """The store finalized rounds are written to before the chain names them ([store]; default: the data
    directory itself, today's layout, nothing copied)."""
    try:
        objects = open_store(cfg.store.uri or cfg.data_dir)
    except StoreError as exc:
        raise CliError(f"[store] uri: {exc}") from None
    if cfg.store.uri:
        log.info("finalized checkpoints and updates are published to %s", objects.uri)
    shard = engine.ctx.shard
    return RoundPublisher(engine.store, objects, cfg.store.public_url, cfg.store.url_expiry_s,
                          cfg.store.direct_upload, None if shard is None else (shard.index, shard.count))


def _metrics(port: int) -> PrometheusMetrics:
    metrics = PrometheusMetrics()
    try:
        bound = metrics.serve(port)
    except OSError as exc:
        raise CliError(f"[aggregator] metrics_port = {port}: cannot serve metrics there ({exc.strerror})") from None
    log.info("metrics on http://127.0.0.1:%d/metrics", bound)
    return metrics


def _identity(cfg: AggregatorConfig) -> TlsIdentity:
    try:
        return load_or_create_identity(cfg.tls_dir, _cert_names(cfg.listen))
    except TlsError as exc:
        raise CliError(str(exc)) from None


def _cert_names(listen: str) -> tuple[str, ...]:
    """The listen host as an extra certificate name, for tools that check it (ours pin and do not)."""
    host = listen.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return () if host in ("", "0.0.0.0", "::") else (host,)


def _announce(cfg: AggregatorConfig, identity: TlsIdentity, engine: RoundEngine, port: int) -> None:
    """Say where this aggregator serves and which certificate clients must pin: in the log, and on chain
    from the aggregator's account (re-announced only when either changed), so hosts and clients find
    both from the chain alone; and publish the epoch's recipe on chain if nobody has yet (anyone may: the
    contract checks it hashes to the epoch's model_spec_hash), so clients can check a checkpoint's model
    config against it."""
    epoch, chain = engine.ctx.epoch, engine.chain
    endpoint = public_endpoint(cfg, port)
    log.info(
        "aggregator serving epoch %d on %s, TLS certificate sha256 %s (%s)",
        epoch, endpoint, identity.sha256.hex(), cfg.tls_dir / CERT_FILE,
    )
    mine = {(a.address.lower(), a.endpoint, a.tls_cert_sha256) for a in chain.aggregator_endpoints(epoch)}
    if (chain.address.lower(), endpoint, identity.sha256) not in mine:
        chain.announce_aggregator(epoch, endpoint, identity.cert_pem)
        log.info("announced %s and the certificate on chain for epoch %d", endpoint, epoch)
    recipe = engine.ctx.recipe_json
    if recipe is not None and chain.published_recipe(epoch) is None:
        chain.publish_recipe(epoch, recipe)
        log.info("published epoch %d's recipe on chain", epoch)


def public_endpoint(cfg: AggregatorConfig, port: int) -> str:
    if cfg.public_endpoint:
        return cfg.public_endpoint
    host = cfg.listen.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        raise CliError(
            f"[aggregator] listen = {cfg.listen!r} binds every interface: set [aggregator] public_endpoint to "
            "the HOST:PORT hosts and clients should dial (it is announced on chain)"
        )
    return f"{host}:{port}"


def _build(cfg: AggregatorConfig, where: Path, passphrase: str | None = None) -> RoundEngine:
    from chain.backends import RpcBackend
    from chain.client import ChainClient
    from chain.errors import ChainError
    from chain.types import Deployment
    from gonka_node.aggregator.chain_view import ChainView
    from gonka_node.aggregator.checkpoints import TrainingCheckpoints
    from gonka_node.aggregator.store import Store
    from gonka_node.core.keys import KeyStoreError, load_evm_account, load_node_key
    from gonka_node.core.recipe import Recipe, RecipeError
    from gonka_node.epoch_setup import aggregator_context, beacon_reader, shard_context
    from gonka_node.slashing import EvidenceLog

    if cfg.chain.backend != "rpc":
        raise CliError(
            f"{where}: [chain] backend must be 'rpc' (an aggregator process reaches the chain over JSON-RPC)"
        )
    passphrase = passphrase if passphrase is not None else read_env().get("GONKA_KEY_PASSPHRASE")
    try:
        node_key = load_node_key(_require(cfg, where, "node_key"), passphrase)
        account = load_evm_account(_require(cfg, where, "evm_key"), passphrase)
        deployment = Deployment.load(_require(cfg, where, "deployment"))
        recipe = Recipe.load(_require(cfg, where, "recipe"))
        client = ChainClient(RpcBackend(cfg.chain.rpc_url), account, deployment).connect()
        epoch = cfg.epoch or client.epoch_count()
        info = client.get_epoch(epoch)
        init = cfg.initial_checkpoint or cfg.data_dir / "initial.safetensors"
        ctx = aggregator_context(
            recipe,
            info,
            chain_id=deployment.chain_id,
            registry=deployment.registry,
            init_path=init,
            cache_dir=cfg.data_dir / "cache",
            heldout_windows=cfg.aggregation.heldout_windows,
            scoring=cfg.scoring,
            beacon=beacon_reader(client.signin_beacon, epoch),
        )
        me = bytes.fromhex(account.address[2:])
        ctx = shard_context(ctx, recipe, info, me, cfg.aggregation.rule_for(epoch))
    except (KeyStoreError, RecipeError, ChainError, ValueError) as exc:
        raise CliError(f"{where}: {exc}") from exc
    if not cfg.scoring:
        log.warning("[aggregator] scoring = false: every valid update counts and no round is replayed, "
                    "whatever the epoch's replay probability (for fault tests only)")
    store, view = Store(cfg.data_dir).open(), ChainView(client)
    try:
        return RoundEngine(
            ctx,
            cfg.round,
            cfg.aggregation,
            store,
            view,
            TrainingCheckpoints(),
            node_key.signing_key,
            evidence=EvidenceLog(cfg.data_dir / "evidence"),  # signed copies/garbage, for slashing
            exchange=None if ctx.shard is None else shard_exchange(cfg, ctx, store, view, node_key.signing_key),
        )
    except ValueError as exc:
        raise CliError(f"{where}: {exc}") from exc


def shard_exchange(
    cfg: AggregatorConfig, ctx: EpochContext, store: Store, chain: ChainView, signer: SigningKey
) -> ShardExchange:
    """How this shard reaches the others: `[aggregator] shard_transport` "grpc" (signed messages over the
    Shard service on this aggregator's own port, peers as their accounts announced them on chain) or "dir"
    (a directory shared on one machine)."""
    from gonka_node.aggregator.shard import DirExchange, sampled_by_seed
    from gonka_node.aggregator.shard_inbox import Inbox, ShardSelf
    from gonka_node.aggregator.shard_net import ChainDirectory, NetExchange
    from gonka_node.aggregator.shard_quota import ShardBudget

    assert ctx.shard is not None
    if cfg.shard_transport == "dir":
        return DirExchange(cfg.shard_exchange or cfg.data_dir.parent / "shard-exchange")
    me = ShardSelf(ctx.chain_id, ctx.registry, ctx.epoch, ctx.shard.index, ctx.shard.count)
    max_hosts = chain.call(chain.chain.get_epoch, ctx.epoch).spec.max_hosts  # what sizes a peer's quota
    inbox = Inbox(cfg.data_dir / SHARD_MESSAGES_DIR, me, store.rounds, quota=ShardBudget.of(ctx, max_hosts),
                  holds_payload=lambda e, r, host: store.submission(e, r, host) is not None,
                  sampled=sampled_by_seed(ctx, store))
    return NetExchange(inbox, signer, ChainDirectory(chain, ctx.epoch))
