"""Typed configuration: TOML files read with `tomllib`, validated into frozen dataclasses.

This is the only module of the project that reads environment variables. It knows a fixed set of
`GONKA_*` names and refuses any other, so a typo (`GONKA_RPC_ULR`) fails loudly instead of being
silently ignored. Every error names the file and the field.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping, Set
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gonka_node.core.config_file import TomlTables, TomlValue, toml_path

# name -> what it overrides. Precedence: CLI flag > environment > TOML file > default.
KNOWN_ENV: dict[str, str] = {
    "GONKA_HOME": "base folder for relative data paths (default: the config file's folder)",
    "GONKA_RPC_URL": "[chain] rpc_url",
    "GONKA_LISTEN": "[aggregator] listen",
    "GONKA_LOG_LEVEL": "log level (DEBUG, INFO, WARNING, ERROR)",
    "GONKA_KEY_PASSPHRASE": "passphrase of the encrypted key files (`gonka-node keys`, gonka_node/core/keys.py)",
}
AGGREGATION_RULES = ("mean", "clip_median", "centered_clip")
MAX_CHUNK_BYTES = 1 << 20
TLS_DIR = "tls"  # under the aggregator's data_dir


class ConfigError(ValueError):
    """A configuration mistake; the message names the file and field to fix."""


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The known GONKA_* variables that are set; raises on any unknown GONKA_* name."""
    env = os.environ if environ is None else environ
    ours = {k: v for k, v in env.items() if k.startswith("GONKA_")}
    unknown = sorted(set(ours) - set(KNOWN_ENV))
    if unknown:
        known = ", ".join(sorted(KNOWN_ENV))
        raise ConfigError(f"unknown environment variable(s) {', '.join(unknown)}; known: {known}")
    return ours


@dataclass(frozen=True)
class ChainSettings:
    backend: str = "embedded"  # "embedded" (in-process py-evm) or "rpc"
    rpc_url: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("embedded", "rpc"):
            raise ConfigError(f"[chain] backend must be 'embedded' or 'rpc', got {self.backend!r}")
        if self.backend == "rpc" and not self.rpc_url:
            raise ConfigError("[chain] rpc_url is required when backend = 'rpc'")


@dataclass(frozen=True)
class RoundSettings:
    """Deadlines and limits of every round (docs/PROTOCOL.md "Round lifecycle")."""

    quorum: int = 1  # accepted submissions needed to close at the deadline
    extend_s: float = 120.0  # extension granted when the deadline passes below quorum
    max_extensions: int = 2  # then the round is skipped
    max_payload_bytes: int = 512 << 20
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    max_update_norm: float = 1.0e4
    max_clock_skew_s: float = 300.0
    # Stream deadlines (docs/PROTOCOL.md): the longest wait for a header or the next chunk, and the
    # minimum upload rate: an upload of N bytes must finish within stream_setup_s + N / rate.
    stream_idle_s: float = 30.0
    stream_setup_s: float = 30.0
    min_upload_kib_per_s: float = 128.0

    def __post_init__(self) -> None:
        _positive("[round] extend_s", self.extend_s)
        _positive("[round] max_update_norm", self.max_update_norm)
        _positive("[round] max_clock_skew_s", self.max_clock_skew_s)
        _positive("[round] stream_idle_s", self.stream_idle_s)
        _positive("[round] stream_setup_s", self.stream_setup_s)
        _positive("[round] min_upload_kib_per_s", self.min_upload_kib_per_s)
        if self.quorum < 1:
            raise ConfigError(f"[round] quorum must be >= 1, got {self.quorum}")
        if self.max_extensions < 0:
            raise ConfigError(f"[round] max_extensions must be >= 0, got {self.max_extensions}")
        if not 1 <= self.max_payload_bytes <= 1 << 40:
            raise ConfigError(f"[round] max_payload_bytes must be in [1, 2^40], got {self.max_payload_bytes}")
        if not 1 <= self.max_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(
                f"[round] max_chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {self.max_chunk_bytes}"
            )

    def longest_upload_s(self) -> float:
        """How long the largest allowed payload may stream at the minimum upload rate."""
        return self.stream_setup_s + self.max_payload_bytes / (self.min_upload_kib_per_s * 1024)


@dataclass(frozen=True)
class AggregationSettings:
    rule: str = "clip_median"
    per_epoch: Mapping[int, str] = field(default_factory=dict)  # epoch -> rule, overrides `rule`
    centered_clip_iters: int = 3
    copy_cosine: float = 0.99  # sketch cosine above which a later submission counts as a copy
    consensus_fraction: float = 0.25  # dissent: cosine with the others' median ≤ this × round median; 0: off
    min_score: float = 0.0  # contributions scoring at or below this are not aggregated nor paid
    heldout_windows: int = 4
    score_rule: str = "heldout_gain"  # or "assignment_gap" (gonka_node/aggregator/scoring.py)
    # An update within this relative residual of the span of public tensors and earlier-arrived
    # submissions brings nothing of its own (aggregator/checks.py find_mixtures): excluded.
    mix_residual: float = 0.05
    # File a bonded challenge (and vote to uphold it) for every host this aggregator holds slashable
    # evidence against, after each round (aggregator/challenger.py); the bond comes from its account.
    challenge: bool = True
    # Replay check (gonka_node/aggregator/replay.py): how often a host is replayed is the epoch's
    # replay_probability on chain; these say what a replay must reproduce.
    replay_min_cosine: float = 0.9
    replay_norm_tolerance: float = 0.1  # |update| / |replay| must lie within 1 ± this
    # Top-k epochs: how long a host picked for the replay has, from the round seed's completion, to open
    # its residual (docs/PROTOCOL.md "Challenge and opening"): a 96 MB opening at 10 MB/s, with margin.
    opening_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        rules: list[tuple[int | None, str]] = [(None, self.rule), *self.per_epoch.items()]
        for epoch, rule in rules:
            if rule not in AGGREGATION_RULES:
                where = "[aggregation] rule" if epoch is None else f"[aggregation.per_epoch] {epoch}"
                raise ConfigError(f"{where} must be one of {', '.join(AGGREGATION_RULES)}, got {rule!r}")
        if not 0.0 <= self.consensus_fraction < 1.0:
            raise ConfigError(
                f"[aggregation] consensus_fraction must be in [0, 1), got {self.consensus_fraction}"
            )
        if not 0.0 < self.copy_cosine <= 1.0:
            raise ConfigError(f"[aggregation] copy_cosine must be in (0, 1], got {self.copy_cosine}")
        if self.score_rule not in ("heldout_gain", "assignment_gap"):
            raise ConfigError(
                f"[aggregation] score_rule must be 'heldout_gain' or 'assignment_gap', got {self.score_rule!r}"
            )
        if not 0.0 <= self.mix_residual < 1.0:
            raise ConfigError(f"[aggregation] mix_residual must be in [0, 1), got {self.mix_residual}")
        if not 0.0 < self.replay_min_cosine <= 1.0:
            raise ConfigError(
                f"[aggregation] replay_min_cosine must be in (0, 1], got {self.replay_min_cosine}"
            )
        if not 0.0 < self.replay_norm_tolerance < 1.0:
            raise ConfigError(
                f"[aggregation] replay_norm_tolerance must be in (0, 1), got {self.replay_norm_tolerance}"
            )
        if not 0.0 < self.opening_timeout_s < 1e6:
            raise ConfigError(f"[aggregation] opening_timeout_s must be in (0, 1e6) seconds, got {self.opening_timeout_s}")
        if self.centered_clip_iters < 1 or self.heldout_windows < 1:
            raise ConfigError("[aggregation] centered_clip_iters and heldout_windows must be >= 1")

    def rule_for(self, epoch: int) -> str:
        return self.per_epoch.get(epoch, self.rule)


@dataclass(frozen=True)
class StoreSettings:
    """Where finalized checkpoints and updates are published (docs/PROTOCOL.md "Object storage")."""

    uri: str = ""  # a directory or s3://bucket/prefix[?endpoint=URL]; "": the data directory (no copy)
    public_url: str = ""  # http(s) base under which the store's keys are served publicly; "": presign
    url_expiry_s: int = 3600  # how long a presigned GET handed to a host or client stays valid
    direct_upload: bool = False  # hosts PUT payloads into the (S3) store; Submit then names the object

    def __post_init__(self) -> None:
        if not 1 <= self.url_expiry_s <= 604_800:  # S3's limit for a presigned URL: 7 days
            raise ConfigError(f"[store] url_expiry_s must be in [1, 604800], got {self.url_expiry_s}")
        if self.public_url and not self.public_url.startswith(("http://", "https://")):
            raise ConfigError(f"[store] public_url must start with http:// or https://, got {self.public_url!r}")
        if self.direct_upload and not self.uri.startswith("s3://"):
            raise ConfigError("[store] direct_upload needs an s3:// uri (hosts PUT to presigned URLs)")
        if self.direct_upload and self.public_url:
            # A publicly readable bucket would show a payload before its host's header claims it (copies).
            raise ConfigError("[store] direct_upload and public_url exclude each other: uploads would be public "
                              "before their headers arrive; publish through presigned URLs instead")


@dataclass(frozen=True)
class AggregatorConfig:
    data_dir: Path
    listen: str = "127.0.0.1:50051"
    # host:port hosts and clients dial, announced on chain with the TLS certificate; "": the listen
    # address with its actual port (a wildcard listen address needs this set)
    public_endpoint: str = ""
    node_key: Path | None = None  # ed25519 key that signs receipts
    evm_key: Path | None = None  # account that finalizes rounds on chain
    recipe: Path | None = None  # the epoch's training recipe (model, data, codec), checked against the chain
    deployment: Path | None = None  # contract addresses (written by `gonka-node chain deploy`)
    epoch: int = 0  # 0: the latest epoch on chain
    initial_checkpoint: Path | None = None  # round-0 weights; made from the recipe when absent
    scoring: bool = True
    metrics_port: int = 0  # Prometheus (gonka_aggregator_*) on 127.0.0.1:PORT; 0: off
    # how a sharded epoch's shards reach each other: "grpc" (the Shard service on this aggregator's port,
    # signed messages, peers as announced on chain; aggregator/shard_net.py) or "dir" (a directory every
    # shard can write, on one machine, unsigned: aggregator/shard.py DirExchange)
    shard_transport: str = "grpc"
    # "dir" only: the directory the shards meet in; None: data_dir's parent/shard-exchange
    shard_exchange: Path | None = None
    chain: ChainSettings = field(default_factory=ChainSettings)
    round: RoundSettings = field(default_factory=RoundSettings)
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    log_level: str = "INFO"
    store: StoreSettings = field(default_factory=StoreSettings)

    @property
    def tls_dir(self) -> Path:
        """The aggregator's TLS identity (cert.pem, key.pem; gonka_node/core/tls.py), made at its first start."""
        return self.data_dir / TLS_DIR

    def toml_tables(self, base: Path) -> TomlTables:
        """What `load_aggregator_config` reads this config from, in a file in folder `base`
        (gonka_node/core/config_file.py renders it); settings at their defaults are left out."""
        paths = {"node_key": self.node_key, "evm_key": self.evm_key, "recipe": self.recipe,
                 "deployment": self.deployment, "initial_checkpoint": self.initial_checkpoint,
                 "shard_exchange": self.shard_exchange}
        transport: dict[str, TomlValue] = {} if self.shard_transport == "grpc" else {"shard_transport": self.shard_transport}
        aggregator: dict[str, TomlValue] = {
            "listen": self.listen, "public_endpoint": self.public_endpoint, "data_dir": toml_path(self.data_dir, base),
            **{k: toml_path(p, base) for k, p in paths.items() if p is not None},
            "epoch": self.epoch, "scoring": self.scoring, "metrics_port": self.metrics_port, "log_level": self.log_level,
            **transport,
        }
        aggregation = _changed(self.aggregation, skip="per_epoch")
        if self.aggregation.per_epoch:
            aggregation["per_epoch"] = {str(e): rule for e, rule in sorted(self.aggregation.per_epoch.items())}
        return {"aggregator": aggregator, "chain": _changed(self.chain), "round": _changed(self.round),
                "aggregation": aggregation, "store": _changed(self.store)}


def _changed(settings: Any, skip: str = "") -> dict[str, TomlValue]:
    """The fields of a settings dataclass that differ from their defaults (what a file must say)."""
    default = type(settings)()
    return {f.name: getattr(settings, f.name) for f in fields(settings)
            if f.name != skip and getattr(settings, f.name) != getattr(default, f.name)}


def read_toml(path: Path) -> dict[str, Any]:
    """A config file's tables; a missing or malformed file is a ConfigError naming it."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such config file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def load_aggregator_config(
    path: Path, environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> AggregatorConfig:
    """Read `path` (TOML), then apply GONKA_* variables, then `overrides` (CLI flags, None = unset)."""
    env = read_env(environ)
    raw = read_toml(path)
    try:
        return _build(path, raw, env, dict(overrides or {}))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


AGGREGATOR_KEYS = frozenset({
    "listen", "public_endpoint", "data_dir", "node_key", "evm_key", "log_level", "recipe", "deployment", "epoch",
    "initial_checkpoint", "scoring", "metrics_port", "shard_exchange", "shard_transport",
})
SHARD_TRANSPORTS = ("grpc", "dir")


def _build(
    path: Path, raw: dict[str, Any], env: dict[str, str], overrides: dict[str, Any]
) -> AggregatorConfig:
    _only_keys("top level", raw, {"aggregator", "chain", "round", "aggregation", "store"})
    agg = dict(raw.get("aggregator", {}))
    _only_keys("[aggregator]", agg, AGGREGATOR_KEYS)
    if not isinstance(agg.get("epoch", 0), int) or agg.get("epoch", 0) < 0:
        raise ConfigError(f"[aggregator] epoch must be an integer >= 0, got {agg.get('epoch')!r}")
    port = agg.get("metrics_port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(f"[aggregator] metrics_port must be a port number (0: off), got {port!r}")
    if agg.get("shard_transport", "grpc") not in SHARD_TRANSPORTS:
        raise ConfigError(f"[aggregator] shard_transport must be one of {', '.join(SHARD_TRANSPORTS)}, "
                          f"got {agg.get('shard_transport')!r}")
    if not isinstance(agg.get("scoring", True), bool):
        raise ConfigError(f"[aggregator] scoring must be true or false, got {agg.get('scoring')!r}")
    base = Path(env.get("GONKA_HOME", path.parent))
    chain = dict(raw.get("chain", {}))
    if "GONKA_RPC_URL" in env:
        chain["rpc_url"] = env["GONKA_RPC_URL"]
    aggregation = dict(raw.get("aggregation", {}))
    if "per_epoch" in aggregation:
        aggregation["per_epoch"] = _epoch_map(aggregation["per_epoch"])
    listen = overrides.get("listen") or env.get("GONKA_LISTEN") or agg.get("listen", "127.0.0.1:50051")
    data_dir = overrides.get("data_dir") or agg.get("data_dir", "aggregator-data")
    return AggregatorConfig(
        data_dir=_resolve(base, data_dir),
        listen=str(listen),
        public_endpoint=str(agg.get("public_endpoint", "")),
        node_key=_resolve(base, agg["node_key"]) if "node_key" in agg else None,
        evm_key=_resolve(base, agg["evm_key"]) if "evm_key" in agg else None,
        recipe=_resolve(base, agg["recipe"]) if "recipe" in agg else None,
        deployment=_resolve(base, agg["deployment"]) if "deployment" in agg else None,
        epoch=int(agg.get("epoch", 0)),
        initial_checkpoint=_resolve(base, agg["initial_checkpoint"]) if "initial_checkpoint" in agg else None,
        scoring=bool(agg.get("scoring", True)),
        metrics_port=port,
        shard_exchange=_resolve(base, agg["shard_exchange"]) if "shard_exchange" in agg else None,
        shard_transport=str(agg.get("shard_transport", "grpc")),
        chain=_section(ChainSettings, "[chain]", chain),
        round=_section(RoundSettings, "[round]", dict(raw.get("round", {}))),
        aggregation=_section(AggregationSettings, "[aggregation]", aggregation),
        log_level=str(env.get("GONKA_LOG_LEVEL", agg.get("log_level", "INFO"))).upper(),
        store=_section(StoreSettings, "[store]", dict(raw.get("store", {}))),
    )


# Settings that moved or never took effect: a file naming one is told where the value comes from.
_EPOCH_SPEC = "on chain, set by governance when it schedules the epoch (gonka-node gov build-spec)"
MOVED: dict[tuple[str, str], str] = {
    ("[aggregation]", "replay_fraction"): (
        "how often hosts are replayed is the epoch's replay_probability on chain, set by governance when it "
        "schedules the epoch (the stake rule depends on it); remove replay_fraction"
    ),
    ("[round]", "duration_s"): f"a round's length is the epoch's round_length {_EPOCH_SPEC}; remove duration_s",
    ("[round]", "reward_per_round"): (
        f"what a round pays is the epoch's reward_per_round {_EPOCH_SPEC}; remove reward_per_round"
    ),
    ("[aggregation]", "outer_lr"): (
        f"the outer step's learning rate is the epoch's outer_lr {_EPOCH_SPEC}, equal to the recipe's; remove outer_lr"
    ),
    ("[aggregation]", "outer_momentum"): (
        f"the outer step's momentum is the epoch's outer_momentum {_EPOCH_SPEC}, equal to the recipe's; "
        "remove outer_momentum"
    ),
    ("[chain]", "registry"): (
        "the contract addresses come from the [aggregator] deployment file (gonka-node chain deploy writes it); "
        "remove registry"
    ),
    ("[chain]", "chain_id"): (
        "the chain id comes from the [aggregator] deployment file (gonka-node chain deploy writes it); "
        "remove chain_id"
    ),
}


def _section(cls: type, name: str, values: dict[str, Any]) -> Any:
    allowed = {f.name: f for f in fields(cls)}
    for key in values:
        if (name, key) in MOVED:
            raise ConfigError(f"{name} {key}: {MOVED[(name, key)]}")
    _only_keys(name, values, set(allowed))
    for key, value in values.items():
        if not _type_ok(allowed[key].default, value):
            raise ConfigError(f"{name} {key} must be a {type(allowed[key].default).__name__}, got {value!r}")
    return cls(**values)


def _type_ok(default: Any, value: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):  # TOML writes 600 for 600.0
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    return True  # fields with a default factory are validated by the dataclass


def _epoch_map(value: Any) -> dict[int, str]:
    if not isinstance(value, dict):
        raise ConfigError("[aggregation.per_epoch] must be a table of epoch = rule")
    try:
        return {int(k): v for k, v in value.items()}
    except ValueError as exc:
        raise ConfigError(f"[aggregation.per_epoch] keys must be epoch numbers: {exc}") from exc


def _only_keys(where: str, values: Mapping[str, Any], allowed: Set[str]) -> None:
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


def _resolve(base: Path, value: str | Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p
