"""The host's TOML: the `[aggregator] tls_cert` pin is a path relative to the file, and only that key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gonka_node.core.config import ConfigError
from gonka_node.host.config import load_host_config

BASE = (
    '[host]\naggregator = "agg.example.org:50051"\nrecipe = "recipe.json"\ndeployment = "deployment.json"\n'
    '[chain]\nrpc_url = "http://127.0.0.1:8545"\n'
)


def write(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "host.toml"
    path.write_text(BASE + extra)
    return path


def test_tls_cert_resolves_next_to_the_config_and_is_optional(tmp_path: Path) -> None:
    cfg = load_host_config(write(tmp_path, '[aggregator]\ntls_cert = "pins/agg.pem"\n'), environ={})
    assert cfg.aggregator_tls_cert == tmp_path / "pins" / "agg.pem"
    assert load_host_config(write(tmp_path, ""), environ={}).aggregator_tls_cert is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[aggregator]\ntls_cert = ""\n', "[aggregator] tls_cert must be a file path, got ''"),
        ("[aggregator]\ntls_cert = 3\n", "[aggregator] tls_cert must be a file path, got 3"),
        ('[aggregator]\ncert = "a.pem"\n', "[aggregator] unknown key(s) ['cert']; known: ['tls_cert']"),
        ('[tls]\ncert = "a.pem"\n', "unknown section(s) ['tls']; known: [host], [aggregator], [chain]"),
    ],
)
def test_bad_aggregator_sections_are_named(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_host_config(write(tmp_path, extra), environ={})
    assert str(caught.value) == f"{tmp_path / 'host.toml'}: {message}"
