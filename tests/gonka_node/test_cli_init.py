"""`gonka-node init host|aggregator|epoch`: each template is read by the loader of its kind, with the
values given as flags, and every key it sets is explained by a comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from gonka_node.cli import main
from gonka_node.core.config import load_aggregator_config
from gonka_node.core.recipe import Recipe
from gonka_node.host.config import load_host_config
from training.model import ModelConfig


def commented(path: Path) -> None:
    """Every `key = value` line of the template says what it is for."""
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert "  # " in line, f"{path.name}: no comment on {line!r}"


def test_host_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "host.toml"
    assert main(["init", "host", "--out", str(out), "--rpc-url", "http://10.0.0.5:8545", "--epoch", "3",
                 "--stake", "12.5"]) == 0
    assert "next: gonka-node keys init --key-dir keys" in capsys.readouterr().out
    cfg = load_host_config(out, environ={})
    assert (cfg.rpc_url, cfg.epoch, cfg.stake) == ("http://10.0.0.5:8545", 3, 12_500_000_000)
    assert cfg.aggregator == "" and cfg.aggregator_tls_cert is None  # found on chain by default
    assert (cfg.key_dir, cfg.recipe, cfg.deployment) == (tmp_path / "keys", tmp_path / "recipe.json",
                                                         tmp_path / "deployment.json")
    commented(out)
    assert main(["init", "host", "--out", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["init", "host", "--out", str(out), "--stake", "lots", "--force"]) == 2
    assert "--stake: not a GNK amount: 'lots'" in capsys.readouterr().err


def test_aggregator_template(tmp_path: Path) -> None:
    out = tmp_path / "agg.toml"
    assert main(["init", "aggregator", "--out", str(out), "--listen", "127.0.0.1:0", "--key-dir", "agg-keys"]) == 0
    cfg = load_aggregator_config(out, environ={})
    assert cfg.listen == "127.0.0.1:0" and cfg.chain.backend == "rpc" and cfg.metrics_port == 0
    assert cfg.node_key == tmp_path / "agg-keys" / "node_key.json" and cfg.recipe == tmp_path / "recipe.json"
    assert cfg.aggregation.rule == "clip_median" and cfg.round.quorum == 1
    assert cfg.store.uri == ""  # the data directory is the store until [store] is uncommented
    commented(out)
    # The commented [store] block is what the loader accepts once its leading "# " is removed.
    lines = out.read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("# [store]")))
    out.write_text("\n".join(lines[:start] + [line.removeprefix("# ") for line in lines[start:]]) + "\n")
    store = load_aggregator_config(out, environ={}).store
    assert store.uri.startswith("s3://bucket/gonka?endpoint=https://")
    assert (store.public_url, store.url_expiry_s, store.direct_upload) == ("https://models.example.org/gonka", 3600, False)


def test_epoch_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "recipe.toml"
    assert main(["init", "epoch", "--out", str(out), "--preset", "tiny", "--rounds", "4", "--inner-steps", "6",
                 "--codec", "int4"]) == 0
    assert "next: gonka-node gov build-spec --recipe" in capsys.readouterr().out
    recipe = Recipe.load(out)
    assert recipe.model == ModelConfig.preset("tiny")
    assert (recipe.n_rounds, recipe.inner_steps, recipe.codec, recipe.round_state) == (4, 6, "int4", "fresh")
    assert recipe.data_manifest_sha256 == ""  # gov build-spec fills it in
    assert recipe.assignment_seed == "signin-block"  # a real epoch: no host knows its windows before sign-in
    commented(out)
    assert main(["init", "epoch", "--out", str(tmp_path / "e.toml"), "--assignment-seed", "epoch"]) == 0
    assert Recipe.load(tmp_path / "e.toml").assignment_seed == "epoch"
    assert main(["init", "epoch", "--out", str(tmp_path / "x.toml"), "--codec", "zip"]) == 2
    assert "unknown codec 'zip'" in capsys.readouterr().err
