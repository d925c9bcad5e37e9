"""The host daemon's TOML configuration (`gonka-node run --config host.toml`).

```toml
[host]
key_dir = "keys"              # gonka-node keys init --key-dir keys
state_dir = "host-state"      # progress, so a killed node resumes
aggregator = "127.0.0.1:50051"  # optional: default, the endpoint the epoch's aggregator announced on chain
recipe = "recipe.json"        # checked against the epoch's model_spec_hash on chain
deployment = "deployment.json"
epoch = 0                     # 0: the latest epoch on chain
stake_gnk = 10
metrics_port = 0              # Prometheus on 127.0.0.1:PORT; 0: off
cache_dir = "cache"           # token cache

[aggregator]
tls_cert = "aggregator-cert.pem"  # the aggregator's certificate (its <data_dir>/tls/cert.pem): pinned

[chain]
rpc_url = "http://127.0.0.1:8545"
```

Relative paths are relative to the file (or to $GONKA_HOME). Environment: GONKA_RPC_URL overrides
[chain] rpc_url; GONKA_KEY_PASSPHRASE unlocks encrypted keys (both read by gonka_node.core.config).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from chain.units import NGONKA_PER_GNK
from gonka_node.core.config import ConfigError, read_env, read_toml
from gonka_node.core.config_file import TomlTables, TomlValue, toml_path

_HOST_KEYS = {
    "key_dir", "state_dir", "aggregator", "recipe", "deployment", "epoch", "stake_gnk", "metrics_port",
    "cache_dir", "log_level",
}


@dataclass(frozen=True)
class HostConfig:
    key_dir: Path
    state_dir: Path
    aggregator: str  # HOST:PORT; "": the endpoint the epoch's aggregator announced on chain
    recipe: Path
    deployment: Path
    rpc_url: str
    epoch: int = 0
    stake: int = 10 * NGONKA_PER_GNK  # ngonka
    metrics_port: int = 0
    cache_dir: Path | None = None
    log_level: str = "INFO"
    passphrase: str | None = None
    aggregator_tls_cert: Path | None = None  # the pinned certificate; None: the one announced on chain

    def toml_tables(self, base: Path) -> TomlTables:
        """What `load_host_config` reads this config from, in a file in folder `base`
        (gonka_node/core/config_file.py renders it). The passphrase is never written to a file."""
        if self.passphrase is not None:
            raise ConfigError("a host config with a passphrase is not written to a file: "
                              "give it with --passphrase-file or GONKA_KEY_PASSPHRASE")
        host: dict[str, TomlValue] = {
            "key_dir": toml_path(self.key_dir, base), "state_dir": toml_path(self.state_dir, base),
            **({"aggregator": self.aggregator} if self.aggregator else {}),
            "recipe": toml_path(self.recipe, base), "deployment": toml_path(self.deployment, base),
            "epoch": self.epoch, "stake_gnk": stake_gnk(self.stake), "metrics_port": self.metrics_port,
            **({"cache_dir": toml_path(self.cache_dir, base)} if self.cache_dir is not None else {}),
            "log_level": self.log_level,
        }
        pinned = self.aggregator_tls_cert
        return {"host": host, "aggregator": {"tls_cert": toml_path(pinned, base)} if pinned is not None else {},
                "chain": {"rpc_url": self.rpc_url}}


def stake_gnk(ngonka: int) -> int | float:
    """A stake in ngonka as the GNK number `stake_gnk` holds: whole GNK as an integer, else the float
    that reads back (through its shortest text, as the loader reads it) to exactly `ngonka`."""
    whole, part = divmod(ngonka, NGONKA_PER_GNK)
    if part == 0:
        return whole
    gnk = float(Decimal(ngonka) / NGONKA_PER_GNK)
    if Decimal(repr(gnk)) * NGONKA_PER_GNK != ngonka:
        raise ConfigError(f"a stake of {ngonka} ngonka has no exact stake_gnk number: round it to whole GNK")
    return gnk


def load_host_config(
    path: Path, environ: dict[str, str] | None = None, passphrase: str | None = None
) -> HostConfig:
    """Read `path`; `passphrase` (from --passphrase-file) takes precedence over GONKA_KEY_PASSPHRASE."""
    env = read_env(environ)
    raw = read_toml(path)
    try:
        return _build(raw, Path(env.get("GONKA_HOME", path.parent)), env, passphrase)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _build(raw: dict[str, Any], base: Path, env: dict[str, str], passphrase: str | None) -> HostConfig:
    unknown = sorted(set(raw) - {"host", "aggregator", "chain"})
    if unknown:
        raise ConfigError(f"unknown section(s) {unknown}; known: [host], [aggregator], [chain]")
    host = dict(raw.get("host", {}))
    chain = dict(raw.get("chain", {}))
    aggregator = dict(raw.get("aggregator", {}))
    bad = sorted(set(host) - _HOST_KEYS)
    if bad:
        raise ConfigError(f"[host] unknown key(s) {bad}; known: {sorted(_HOST_KEYS)}")
    bad = sorted(set(chain) - {"rpc_url"})
    if bad:
        raise ConfigError(f"[chain] unknown key(s) {bad}; known: ['rpc_url']")
    bad = sorted(set(aggregator) - {"tls_cert"})
    if bad:
        raise ConfigError(f"[aggregator] unknown key(s) {bad}; known: ['tls_cert']")
    tls_cert = aggregator.get("tls_cert")
    if tls_cert is not None and (not isinstance(tls_cert, str) or not tls_cert):
        raise ConfigError(f"[aggregator] tls_cert must be a file path, got {tls_cert!r}")
    for name in ("recipe", "deployment"):
        if not isinstance(host.get(name), str) or not host[name]:
            raise ConfigError(f"[host] {name} is required (a string)")
    if not isinstance(host.get("aggregator", ""), str):
        raise ConfigError(f"[host] aggregator must be HOST:PORT (a string), got {host['aggregator']!r}")
    rpc_url = env.get("GONKA_RPC_URL") or chain.get("rpc_url")
    if not isinstance(rpc_url, str) or not rpc_url.startswith(("http://", "https://")):
        raise ConfigError(f"[chain] rpc_url must be an http(s) URL, got {rpc_url!r}")
    for name in ("epoch", "metrics_port"):
        value = host.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"[host] {name} must be an integer >= 0, got {value!r}")
    try:
        stake = int(Decimal(str(host.get("stake_gnk", 10))) * NGONKA_PER_GNK)
    except InvalidOperation as exc:
        raise ConfigError(f"[host] stake_gnk must be a number of GNK, got {host.get('stake_gnk')!r}") from exc
    if stake <= 0:
        raise ConfigError("[host] stake_gnk must be > 0")

    def resolve(value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else base / p

    return HostConfig(
        key_dir=resolve(host.get("key_dir", "keys")),
        state_dir=resolve(host.get("state_dir", "host-state")),
        aggregator=host.get("aggregator", ""),
        aggregator_tls_cert=resolve(tls_cert) if tls_cert is not None else None,
        recipe=resolve(host["recipe"]),
        deployment=resolve(host["deployment"]),
        rpc_url=rpc_url,
        epoch=host.get("epoch", 0),
        stake=stake,
        metrics_port=host.get("metrics_port", 0),
        cache_dir=resolve(host["cache_dir"]) if "cache_dir" in host else None,
        log_level=str(host.get("log_level", "INFO")),
        passphrase=passphrase if passphrase is not None else env.get("GONKA_KEY_PASSPHRASE"),
    )
