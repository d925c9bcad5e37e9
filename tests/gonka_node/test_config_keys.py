"""Every key the config loaders accept reaches the loaded config and is read by the module that acts on
it; a key that would do nothing (its value comes from the chain or the deployment file) is refused with
one line naming where the value really comes from (issue 17)."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest

from gonka_node.core.config import (
    AGGREGATOR_KEYS,
    MOVED,
    AggregationSettings,
    ChainSettings,
    ConfigError,
    RoundSettings,
    StoreSettings,
    load_aggregator_config,
)
from gonka_node.host.config import _HOST_KEYS, load_host_config

ROOT = Path(__file__).resolve().parents[2]
CLI_AGG, ROUNDS, CLOSE = "gonka_node/cli/aggregator.py", "gonka_node/aggregator/rounds.py", "gonka_node/aggregator/close.py"
ACCEPT = "gonka_node/aggregator/acceptance.py"  # the engine's acceptance half
CLI_HOST = "gonka_node/cli/host.py"

# (section, key) -> (TOML line with a value unlike the default, module that reads it, attribute it reads)
AGGREGATOR: dict[tuple[str, str], tuple[str, str, str]] = {
    ("aggregator", "listen"): ('listen = "127.0.0.1:7001"', CLI_AGG, "listen"),
    ("aggregator", "public_endpoint"): ('public_endpoint = "agg.example:443"', CLI_AGG, "public_endpoint"),
    ("aggregator", "data_dir"): ('data_dir = "elsewhere"', CLI_AGG, "data_dir"),
    ("aggregator", "node_key"): ('node_key = "node.json"', CLI_AGG, "node_key"),
    ("aggregator", "evm_key"): ('evm_key = "evm.json"', CLI_AGG, "evm_key"),
    ("aggregator", "log_level"): ('log_level = "debug"', CLI_AGG, "log_level"),
    ("aggregator", "recipe"): ('recipe = "recipe.json"', CLI_AGG, "recipe"),
    ("aggregator", "deployment"): ('deployment = "deployment.json"', CLI_AGG, "deployment"),
    ("aggregator", "epoch"): ("epoch = 4", CLI_AGG, "epoch"),
    ("aggregator", "initial_checkpoint"): ('initial_checkpoint = "init.safetensors"', CLI_AGG, "initial_checkpoint"),
    ("aggregator", "scoring"): ("scoring = false", CLI_AGG, "scoring"),
    ("aggregator", "metrics_port"): ("metrics_port = 9100", CLI_AGG, "metrics_port"),
    ("aggregator", "shard_exchange"): ('shard_exchange = "exchange"', CLI_AGG, "shard_exchange"),
    ("aggregator", "shard_transport"): ('shard_transport = "dir"', CLI_AGG, "shard_transport"),
    ("chain", "backend"): ('backend = "rpc"', CLI_AGG, "backend"),
    ("chain", "rpc_url"): ('rpc_url = "http://10.0.0.1:8545"', CLI_AGG, "rpc_url"),
    ("round", "quorum"): ("quorum = 3", ROUNDS, "quorum"),
    ("round", "extend_s"): ("extend_s = 7", ROUNDS, "extend_s"),
    ("round", "max_extensions"): ("max_extensions = 5", ROUNDS, "max_extensions"),
    ("round", "max_payload_bytes"): ("max_payload_bytes = 1000", ACCEPT, "max_payload_bytes"),
    ("round", "max_chunk_bytes"): ("max_chunk_bytes = 1000", "gonka_node/aggregator/server.py", "max_chunk_bytes"),
    ("round", "max_update_norm"): ("max_update_norm = 3.5", ROUNDS, "max_update_norm"),
    ("round", "max_clock_skew_s"): ("max_clock_skew_s = 9", ACCEPT, "max_clock_skew_s"),
    ("round", "stream_idle_s"): ("stream_idle_s = 9", ROUNDS, "stream_idle_s"),
    ("round", "stream_setup_s"): ("stream_setup_s = 9", ROUNDS, "stream_setup_s"),
    ("round", "min_upload_kib_per_s"): ("min_upload_kib_per_s = 9", ROUNDS, "min_upload_kib_per_s"),
    ("aggregation", "rule"): ('rule = "mean"', CLOSE, "rule_for"),
    ("aggregation", "per_epoch"): ('per_epoch = { 2 = "mean" }', CLOSE, "rule_for"),
    ("aggregation", "centered_clip_iters"): ("centered_clip_iters = 7", CLOSE, "centered_clip_iters"),
    ("aggregation", "copy_cosine"): ("copy_cosine = 0.5", CLOSE, "copy_cosine"),
    ("aggregation", "consensus_fraction"): ("consensus_fraction = 0.5", CLOSE, "consensus_fraction"),
    ("aggregation", "min_score"): ("min_score = 0.5", CLOSE, "min_score"),
    ("aggregation", "heldout_windows"): ("heldout_windows = 2", CLI_AGG, "heldout_windows"),
    ("aggregation", "score_rule"): ('score_rule = "assignment_gap"', CLOSE, "score_rule"),
    ("aggregation", "mix_residual"): ("mix_residual = 0.5", CLOSE, "mix_residual"),
    ("aggregation", "challenge"): ("challenge = false", CLI_AGG, "challenge"),
    ("aggregation", "replay_min_cosine"): ("replay_min_cosine = 0.5", CLOSE, "replay_min_cosine"),
    ("aggregation", "replay_norm_tolerance"): ("replay_norm_tolerance = 0.5", CLOSE, "replay_norm_tolerance"),
    ("aggregation", "opening_timeout_s"): ("opening_timeout_s = 30", ROUNDS, "opening_timeout_s"),
    ("store", "uri"): ('uri = "s3://bucket/run"', CLI_AGG, "uri"),
    ("store", "public_url"): ('public_url = "https://cdn.example/run"', CLI_AGG, "public_url"),
    ("store", "url_expiry_s"): ("url_expiry_s = 60", CLI_AGG, "url_expiry_s"),
    ("store", "direct_upload"): ('uri = "s3://b/run"\ndirect_upload = true', CLI_AGG, "direct_upload"),
}
AGGREGATOR_BASE = {"aggregator": {"data_dir": 'data_dir = "state"'}, "chain": {"rpc_url": 'rpc_url = "http://127.0.0.1:8545"'}}

HOST: dict[tuple[str, str], tuple[str, str, str]] = {
    ("host", "key_dir"): ('key_dir = "other-keys"', CLI_HOST, "key_dir"),
    ("host", "state_dir"): ('state_dir = "other-state"', CLI_HOST, "state_dir"),
    ("host", "aggregator"): ('aggregator = "10.0.0.2:50051"', "gonka_node/host/pin.py", "aggregator"),
    ("host", "recipe"): ('recipe = "other.json"', CLI_HOST, "recipe"),
    ("host", "deployment"): ('deployment = "other.json"', CLI_HOST, "deployment"),
    ("host", "epoch"): ("epoch = 4", CLI_HOST, "epoch"),
    ("host", "stake_gnk"): ("stake_gnk = 25", CLI_HOST, "stake"),
    ("host", "metrics_port"): ("metrics_port = 9100", CLI_HOST, "metrics_port"),
    ("host", "cache_dir"): ('cache_dir = "cache"', CLI_HOST, "cache_dir"),
    ("host", "log_level"): ('log_level = "DEBUG"', CLI_HOST, "log_level"),
    ("aggregator", "tls_cert"): ('tls_cert = "agg.pem"', "gonka_node/host/pin.py", "aggregator_tls_cert"),
    ("chain", "rpc_url"): ('rpc_url = "http://10.0.0.1:8545"', CLI_HOST, "rpc_url"),
}
HOST_BASE = {
    "host": {"recipe": 'recipe = "recipe.json"', "deployment": 'deployment = "deployment.json"'},
    "chain": {"rpc_url": 'rpc_url = "http://127.0.0.1:8545"'},
}


def _toml(base: dict[str, dict[str, str]], section: str | None = None, line: str = "") -> str:
    """`base`'s tables (name -> key -> line), with `line` setting its key in `section`."""
    tables = {name: dict(lines) for name, lines in base.items()}
    if section is not None:
        tables.setdefault(section, {})[line.split("=")[0].strip()] = line
    return "".join(f"[{name}]\n" + "".join(f"{text}\n" for text in lines.values()) for name, lines in tables.items())


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


@functools.cache
def _attributes_read(module: str) -> frozenset[str]:
    """Attributes the module reads: `x.name`, or by name as a string (`_require(cfg, where, "name")`)."""
    nodes = list(ast.walk(ast.parse((ROOT / module).read_text())))
    return frozenset(n.attr for n in nodes if isinstance(n, ast.Attribute)) | frozenset(
        n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()
    )


def test_the_tables_cover_every_key_the_loaders_accept() -> None:
    sections = {"chain": ChainSettings, "round": RoundSettings, "aggregation": AggregationSettings,
                "store": StoreSettings}
    accepted = {("aggregator", k) for k in AGGREGATOR_KEYS} | {
        (name, f.name) for name, cls in sections.items() for f in dataclasses.fields(cls)
    }
    assert set(AGGREGATOR) == accepted
    assert set(HOST) == {("host", k) for k in _HOST_KEYS} | {("aggregator", "tls_cert"), ("chain", "rpc_url")}


@pytest.mark.parametrize("key", sorted(AGGREGATOR), ids="{0[0]}.{0[1]}".format)
def test_each_aggregator_key_changes_the_config_that_its_module_reads(tmp_path: Path, key: tuple[str, str]) -> None:
    line, module, attribute = AGGREGATOR[key]
    base = load_aggregator_config(_write(tmp_path, _toml(AGGREGATOR_BASE)), environ={})
    changed = load_aggregator_config(_write(tmp_path, _toml(AGGREGATOR_BASE, key[0], line)), environ={})
    assert changed != base
    assert attribute in _attributes_read(module)


@pytest.mark.parametrize("key", sorted(HOST), ids="{0[0]}.{0[1]}".format)
def test_each_host_key_changes_the_config_that_its_module_reads(tmp_path: Path, key: tuple[str, str]) -> None:
    line, module, attribute = HOST[key]
    base = load_host_config(_write(tmp_path, _toml(HOST_BASE)), environ={})
    changed = load_host_config(_write(tmp_path, _toml(HOST_BASE, key[0], line)), environ={})
    assert getattr(changed, attribute) != getattr(base, attribute)
    assert attribute in _attributes_read(module)


@pytest.mark.parametrize("key", sorted(MOVED), ids="{0[0]}{0[1]}".format)
def test_a_key_that_would_do_nothing_is_refused_naming_where_the_value_comes_from(
    tmp_path: Path, key: tuple[str, str]
) -> None:
    section, name = key[0].strip("[]"), key[1]
    path = _write(tmp_path, _toml(AGGREGATOR_BASE, section, f"{name} = 1"))
    with pytest.raises(ConfigError) as info:
        load_aggregator_config(path, environ={})
    message = str(info.value)
    assert message.startswith(f"{path}: [{section}] {name}: ") and "\n" not in message
    assert ("on chain" in message or "deployment file" in message) and message.endswith(f"remove {name}")
