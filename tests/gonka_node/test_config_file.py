"""Config objects written as TOML read back equal (gonka_node/core/config_file.py), whatever their strings
hold, and the devnet's written configs load to the values the devnet means."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from chain.units import NGONKA_PER_GNK
from gonka_node.core.config import (
    AggregationSettings,
    AggregatorConfig,
    ChainSettings,
    ConfigError,
    RoundSettings,
    StoreSettings,
    load_aggregator_config,
)
from gonka_node.core.config_file import render_config, render_tables, write_config
from gonka_node.devnet import DevnetOptions, write_configs
from gonka_node.devnet_procs import aggregator_cert, point_host_at
from gonka_node.host.config import HostConfig, load_host_config, stake_gnk

# Quotes, backslashes, a TOML comment sign, a newline, a control character, non-ASCII, an emoji.
AWKWARD = 'a "quoted" \\ back\\slash # not a comment\nline\x01 ünï 世界 🙂'


def aggregator_everything_changed(base: Path) -> AggregatorConfig:
    return AggregatorConfig(
        data_dir=base / "data dir" / AWKWARD,
        listen="[::1]:7001",
        public_endpoint="agg.example:443",
        node_key=Path("/elsewhere") / AWKWARD / "node.json",  # absolute, outside the folder
        evm_key=base / "k" / "evm.json",
        recipe=base / "recipe.json",
        deployment=base / "déploiement.json",
        epoch=4,
        initial_checkpoint=base / "init.safetensors",
        scoring=False,
        metrics_port=9100,
        chain=ChainSettings(backend="rpc", rpc_url='http://h:1/"x"\\y?z=ü'),
        round=RoundSettings(quorum=3, extend_s=7.5, max_extensions=5, max_payload_bytes=1000,
                            max_chunk_bytes=999, max_update_norm=3.25, max_clock_skew_s=9.0, stream_idle_s=0.1,
                            stream_setup_s=1e-5, min_upload_kib_per_s=1e300),
        aggregation=AggregationSettings(rule="mean", per_epoch={2: "centered_clip", 10: "mean"},
                                        centered_clip_iters=7, copy_cosine=0.5, consensus_fraction=0.0,
                                        min_score=-0.25, heldout_windows=9, score_rule="assignment_gap",
                                        mix_residual=0.0, challenge=False, replay_min_cosine=0.75,
                                        replay_norm_tolerance=0.3, opening_timeout_s=45.5),
        log_level="DEBUG",
        store=StoreSettings(uri='s3://bucket/pre"fix?endpoint=http://127.0.0.1:9000', url_expiry_s=60,
                            direct_upload=True),
    )


def host_everything_changed(base: Path) -> HostConfig:
    return HostConfig(
        key_dir=base / AWKWARD,
        state_dir=Path("/var/state") / "ünï",
        aggregator='agg "1":50051',
        recipe=base / "r" / "recipe.json",
        deployment=base / "deployment.json",
        rpc_url="https://chain.example/\\path?q=\"1\"",
        epoch=3,
        stake=12_345_678_901,  # 12.345678901 GNK
        metrics_port=9200,
        cache_dir=base / "cache",
        log_level="WARNING",
        aggregator_tls_cert=base / "tls" / "cert.pem",
    )


def test_every_aggregator_setting_round_trips(tmp_path: Path) -> None:
    folder = tmp_path / 'cfg "folder" \\ ü'
    config = aggregator_everything_changed(folder)
    write_config(config, folder / "aggregator.toml")
    assert load_aggregator_config(folder / "aggregator.toml", environ={}) == config


def test_an_aggregator_config_at_its_defaults_round_trips(tmp_path: Path) -> None:
    config = AggregatorConfig(data_dir=tmp_path / "aggregator-data")
    text = render_config(config, tmp_path)
    assert "[round]" not in text and "[aggregation]" not in text and "[store]" not in text  # defaults: the loader's
    (tmp_path / "a.toml").write_text(text)
    assert load_aggregator_config(tmp_path / "a.toml", environ={}) == config


def test_every_host_setting_round_trips(tmp_path: Path) -> None:
    folder = tmp_path / "hôte"
    config = host_everything_changed(folder)
    write_config(config, folder / "host.toml")
    assert load_host_config(folder / "host.toml", environ={}) == config


def test_paths_under_the_folder_are_written_relative(tmp_path: Path) -> None:
    tables = host_everything_changed(tmp_path).toml_tables(tmp_path)
    assert tables["host"]["cache_dir"] == "cache" and tables["host"]["state_dir"] == "/var/state/ünï"
    assert tables["aggregator"] == {"tls_cert": "tls/cert.pem"}


def test_a_passphrase_is_never_written(tmp_path: Path) -> None:
    config = HostConfig(key_dir=tmp_path, state_dir=tmp_path, aggregator="", recipe=tmp_path / "r",
                        deployment=tmp_path / "d", rpc_url="http://x", passphrase="secret")
    with pytest.raises(ConfigError, match="passphrase"):
        render_config(config, tmp_path)


@pytest.mark.parametrize(("ngonka", "written"), [(10 * NGONKA_PER_GNK, 10), (1, 1e-9), (2_500_000_001, 2.500000001)])
def test_a_stake_is_written_as_the_gnk_number_that_reads_back_exactly(ngonka: int, written: float) -> None:
    assert stake_gnk(ngonka) == written and type(stake_gnk(ngonka)) is type(written)


def test_a_stake_with_no_exact_gnk_number_is_refused() -> None:
    with pytest.raises(ConfigError, match="round it to whole GNK"):
        stake_gnk(123_456_789_012_345_678_901)


def test_strings_numbers_and_keys_read_back_as_written() -> None:
    tables = {"t": {"s": AWKWARD + "\x7f\t\r\b\f", "i": -(2**63), "f": 1e-300, "g": float("inf"), "b": True,
                    "weird key.x": "v", "sub": {"7": "seven", "k\u00e9y": 0.5}}}
    assert tomllib.loads(render_tables(tables)) == tables


def test_the_devnet_writes_configs_that_load_to_what_it_means(tmp_path: Path) -> None:
    out = tmp_path / 'dev"net \\ ü'
    out.mkdir()
    url = 'http://127.0.0.1:8545/"odd"\\path'
    opts = DevnetOptions(out=out, hosts=2, heldout_windows=17)
    write_configs(opts, url, epoch=3, stake_gnk=250)
    agg = load_aggregator_config(out / "aggregator.toml", environ={})
    assert agg == AggregatorConfig(
        data_dir=out / "aggregator", listen="127.0.0.1:0", node_key=out / "keys/aggregator/node_key.json",
        evm_key=out / "keys/aggregator/evm_key.json", recipe=out / "recipe.json", deployment=out / "deployment.json",
        epoch=3, chain=ChainSettings(backend="rpc", rpc_url=url), round=RoundSettings(quorum=2),
        aggregation=AggregationSettings(heldout_windows=17),
    )
    for i in (1, 2):
        host = load_host_config(out / f"host{i}.toml", environ={})
        assert host == HostConfig(
            key_dir=out / f"keys/host{i}", state_dir=out / f"host{i}", aggregator="", recipe=out / "recipe.json",
            deployment=out / "deployment.json", rpc_url=url, epoch=3, stake=250 * NGONKA_PER_GNK,
            cache_dir=out / "cache", aggregator_tls_cert=aggregator_cert(out),
        )
    point_host_at(out, 2, "127.0.0.1:40001")
    assert load_host_config(out / "host2.toml", environ={}).aggregator == "127.0.0.1:40001"
    assert load_host_config(out / "host1.toml", environ={}).aggregator == ""
