"""`gonka-node chain …` and `gov …` against `gonka-node chain serve` running as its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GNK, sha

from chain.backends import RpcBackend
from chain.client import ChainClient
from chain.types import Deployment
from gonka_node.cli import main

SPEC = """
model_spec_hash = "0x{h}"
model_uri = "https://example.org/llama-tiny.json"
data_manifest_hash = "{h}"
init_checkpoint_hash = "0x{h}"
inner_steps = 50
inner_lr = 3e-4
batch_size = 8
outer_lr = 0.7
outer_momentum = 0.9
codec = "topk-int8"
n_rounds = 3
round_length = 600
signin_window = 3600
min_stake_gnk = "100"
max_hosts = 4
aggregators = ["{agg}"]
reward_per_round_gnk = "40.5"
replay_probability = 0.5
challenge_window = 7200
challenge_bond_gnk = "2.5"
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("serve")
    url_file, deployment = tmp / "url", tmp / "deployment.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gonka_node", "chain", "serve", "--port", "0",
         "--url-file", str(url_file), "--deployment", str(deployment)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 90
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"chain serve did not start: {proc.communicate()[0]}")
        time.sleep(0.1)
    yield url_file.read_text().strip(), deployment
    proc.terminate()
    assert proc.wait(timeout=20) == 0


def write_spec(tmp_path: Path, aggregator: str, **replace: str) -> Path:
    text = SPEC.format(h=sha("x").hex(), agg=aggregator)
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / "epoch.toml"
    path.write_text(text)
    return path


def key_file(tmp_path: Path, key: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "gov.key"
    path.write_text(key.hex() + "\n")
    os.chmod(path, mode)
    return path


def test_governance_by_cli(served: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, deployment = served
    dep = ["--deployment", str(deployment)]
    accounts = RpcBackend(url).dev_accounts()
    assert Deployment.load(deployment).extra["rpc_url"] == url

    spec = write_spec(tmp_path, accounts[1].address)
    assert main(["gov", "create-epoch", "--spec", str(spec), *dep]) == 0
    assert "epoch 1 created" in capsys.readouterr().out
    assert main(["gov", "fund", "--epoch", "1", "--amount", "2500", *dep]) == 0

    client = ChainClient(RpcBackend(url), accounts[2], Deployment.load(deployment)).connect()
    info = client.get_epoch(1)
    assert (info.pool, info.spec.reward_per_round, info.spec.min_stake) == (2500 * GNK, 40_500_000_000, 100 * GNK)
    assert (info.spec.replay_probability, info.spec.challenge_window, info.spec.challenge_bond) == (0.5, 7200, 2_500_000_000)
    client.join(1, 100 * GNK, sha("node"))

    key = bytes(accounts[0].key)
    loose = key_file(tmp_path, key, 0o644)
    assert main(["gov", "slash", "--epoch", "1", "--host", accounts[2].address, "--amount", "1",
                 "--evidence", sha("e").hex(), "--key-file", str(loose), *dep]) == 2
    assert "chmod 600" in capsys.readouterr().err
    tight = key_file(tmp_path, key)
    assert main(["gov", "slash", "--epoch", "1", "--host", accounts[2].address, "--amount", "1",
                 "--evidence", sha("e").hex(), "--key-file", str(tight), *dep]) == 0
    out = capsys.readouterr()
    assert key.hex() not in out.out + out.err
    assert client.host_info(1, accounts[2].address).slashed == GNK

    # A stranger's key is refused by the contract, reason included.
    assert main(["gov", "fund", "--epoch", "1", "--amount", "1", "--dev-account", "9", *dep]) == 2
    assert "registry: only governance" in capsys.readouterr().err

    assert main(["chain", "status", "--epoch", "1", *dep]) == 0
    out = capsys.readouterr().out
    assert accounts[2].address in out and "1/4" in out


def test_spec_mistakes_name_the_file_and_field(served: tuple[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _, deployment = served
    aggregator = RpcBackend(served[0]).dev_accounts()[1].address
    cases = {
        "inner_lr = 3e-4": ("inner_lr = \"fast\"", "field 'inner_lr'"),
        "max_hosts = 4": ("max_hosts = 0", "field 'max_hosts'"),
        "codec = \"topk-int8\"": ("codec = \"topk-int8\"\ncolour = 1", "field 'colour': unknown"),
        "n_rounds = 3": ("", "field 'n_rounds': missing"),
        "replay_probability = 0.5": ("replay_probability = 0.25", "field 'min_stake_gnk': min_stake x replay_probability"),
        "challenge_bond_gnk = \"2.5\"": ("challenge_bond_gnk = \"0\"", "field 'challenge_bond_gnk'"),
    }
    for old, (new, expected) in cases.items():
        spec = write_spec(tmp_path, aggregator, **{old: new})
        assert main(["gov", "create-epoch", "--spec", str(spec), "--deployment", str(deployment)]) == 2
        err = capsys.readouterr().err
        assert str(spec) in err and expected in err, err


def test_deploy_writes_a_deployment_file(served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    out = tmp_path / "governed.json"
    assert main(["chain", "deploy", "--rpc-url", url, "--deployment", str(out), "--governor", "--mint-dev", "5"]) == 0
    deployment = Deployment.load(out)
    assert deployment.governance == deployment.governor and deployment.extra["rpc_url"] == url
    client = ChainClient(RpcBackend(url), RpcBackend(url).dev_accounts()[3], deployment).connect()
    assert client.gnk_balance() == 5 * GNK
