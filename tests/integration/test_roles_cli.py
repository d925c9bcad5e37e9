"""Every role from the command line, against `gonka-node chain serve`: only `gonka-node` processes.

Governance plans an epoch from a recipe template (`init epoch`, `gov build-spec`, `gov check-spec`),
fills the Governor's treasury, proposes create + fund in one proposal, votes and executes it once the
vote is over (the served chain follows the wall clock: no retry). An aggregator with a fresh key is
funded by `transfer` and started from `init aggregator`'s template. A host with a fresh `keys init` key
is refused by the preflight in one line that names the transfer to make; after that transfer it trains
the epoch's two rounds, loses its state folder, and still claims everything it earned. A client lists
the checkpoints (with where to pull them), pulls the latest (the aggregator found on chain), exports it
and generates with transformers' `pipeline`.

Nothing here imports the project: every step is a subprocess, as a user would type it. Tiny model,
four inner steps, one host; most of the time is process start-up and the sign-in window.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stdlib_corpus import write_small_corpus

VOTING_S = 60  # two votes must fit in it, each a process start (on a loaded machine, seconds each)
SIGNIN_S = 75  # the host must be refused, funded and signed in within this (~30 s on a busy 2-core machine)
REWARD_GNK = 50


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("GONKA_")}
    return out | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                  "HF_HUB_DISABLE_TELEMETRY": "1", "COLUMNS": "200"}


class Cli:
    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.background: list[subprocess.Popen[str]] = []

    def __call__(self, *args: str, status: int = 0, timeout: float = 300) -> str:
        proc = subprocess.run([sys.executable, "-m", "gonka_node", *args], cwd=self.cwd, env=env(),
                              capture_output=True, text=True, timeout=timeout)
        both = proc.stdout + proc.stderr
        assert proc.returncode == status, f"gonka-node {' '.join(args)} exited {proc.returncode}:\n{both}"
        assert "Traceback" not in both, both
        return both

    def start(self, name: str, *args: str) -> subprocess.Popen[str]:
        log = open(self.cwd / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([sys.executable, "-m", "gonka_node", *args], cwd=self.cwd, env=env(),
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        self.background.append(proc)
        return proc

    def wait_for(self, path: Path, proc: subprocess.Popen[str], timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert proc.poll() is None, (self.cwd / f"{proc.args[3]}.log").read_text()
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.2)
        return path.read_text().strip()

    def stop(self) -> None:
        for proc in self.background:
            proc.terminate()
        for proc in self.background:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    c = Cli(tmp_path)
    yield c
    c.stop()


def dev(i: int) -> list[str]:
    return ["--deployment", "deployment.json", "--dev-account", str(i)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # ~150 s on 2 idle cores; ~30 process starts, each slower when the cores are shared
def test_every_role_from_the_command_line(cli: Cli, tmp_path: Path) -> None:
    chain = cli.start("chain", "chain", "serve", "--port", "0", "--url-file", "chain.url", "--deployment",
                      "deployment.json", "--governor", "--voting-period", str(VOTING_S), "--quorum-bps", "1000")
    url = cli.wait_for(tmp_path / "chain.url", chain)

    # ---- keys: an aggregator and a host, fresh (their accounts hold nothing yet)
    cli("keys", "init", "--key-dir", "agg-keys", "--insecure-plaintext")
    cli("keys", "init", "--key-dir", "host-keys", "--insecure-plaintext")
    agg = json.loads(cli("keys", "show", "--key-dir", "agg-keys", "--json").splitlines()[0])["evm_address"]

    # ---- governance: plan, fund the treasury, propose create + fund, vote, execute
    cli("init", "epoch", "--out", "recipe.toml", "--preset", "tiny", "--rounds", "2", "--inner-steps", "4")
    corpus = write_small_corpus(tmp_path)  # the epoch's data: a small file instead of Python's stdlib
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(recipe.read_text().replace('corpus = "builtin"', f'corpus = "{corpus}"'))
    built = cli("gov", "build-spec", "--recipe", "recipe.toml", "--aggregator", agg, "--reward-per-round",
                str(REWARD_GNK), "--replay-probability", "1", "--signin-window", str(SIGNIN_S), "--out", "epoch.toml")
    assert f"stake >= {REWARD_GNK} GNK" in built and "--fund 100" in built
    assert "a valid epoch spec and matches recipe.json" in cli("gov", "check-spec", "--spec", "epoch.toml",
                                                               "--recipe", "recipe.json")
    cli("gov", "treasury-deposit", "--amount", "100", *dev(2))
    for voter in (0, 1):
        cli("gov", "deposit", "--amount", "600000", *dev(voter))
    proposed = cli("gov", "create-epoch", "--spec", "epoch.toml", "--fund", "100", "--propose", "epoch 1", *dev(0))
    vote_ends = time.monotonic() + VOTING_S
    assert "proposing: create epoch 1 and fund it with 100 GNK" in proposed
    for voter in (0, 1):
        cli("gov", "vote", "--proposal", "1", "--support", "yes", *dev(voter))
    listed = cli("gov", "proposals", "--deployment", "deployment.json")
    assert "create epoch 1: 2 rounds, 50 GNK per round" in listed and "fund epoch 1 with 100 GNK" in listed

    # While the vote runs: the aggregator is funded for gas and configured, the host configured.
    cli("transfer", "--to", agg, "--eth", "10", "--gnk", "10", *dev(4))
    cli("init", "aggregator", "--out", "aggregator.toml", "--listen", "127.0.0.1:0", "--rpc-url", url,
        "--key-dir", "agg-keys", "--epoch", "1")
    cli("init", "host", "--out", "host.toml", "--rpc-url", url, "--key-dir", "host-keys", "--epoch", "1",
        "--stake", str(REWARD_GNK))
    time.sleep(max(0.0, vote_ends - time.monotonic()) + 2)  # the chain follows the wall clock: no retry needed
    assert "proposal 1 executed; epoch(s) 1 created" in cli("gov", "execute", "--proposal", "1", *dev(3))

    # ---- the aggregator: started from the template, found by everyone on chain
    aggregator = cli.start("aggregator", "aggregator", "--config", "aggregator.toml", "--port-file", "agg.port")
    port = cli.wait_for(tmp_path / "agg.port", aggregator)

    # ---- the host: refused before staking, funded by CLI, trains the epoch
    refused = cli("run", "--config", "host.toml", "--check", status=2).splitlines()
    assert len(refused) == 2 and refused[1].endswith("preflight: 1 problem(s); nothing was staked"), refused
    fix = re.search(r"`gonka-node (transfer --to (\S+) --gnk 50 --eth [\d.]+)`", refused[0])
    assert fix and "holds 0 GNK of the 50 to stake and 0 ETH" in refused[0], refused
    cli(*fix.group(1).split(), *dev(5))
    host = fix.group(2)
    assert f"GNK balance:      {REWARD_GNK} GNK" in cli("keys", "show", "--config", "host.toml")
    ran = cli("run", "--config", "host.toml", "--quiet", timeout=600)
    assert "epoch 1: 2 rounds" in ran and f"signed in to epoch 1 with {REWARD_GNK} GNK stake" in ran
    assert ran.count("submission accepted") == 2  # one log line per event

    shutil.rmtree(tmp_path / "host-state")  # lost: the chain and the aggregator still know
    status = cli("status", "--config", "host.toml")
    assert "rounds:         2 of 2 finalized" in status and "claimable:      100 GNK" in status
    claimed = cli("rewards", "--config", "host.toml", "--claim")
    assert "claimed 100 GNK; balance 100 GNK" in claimed and claimed.count("aggregator") >= 2
    assert f"GNK balance:      {2 * REWARD_GNK} GNK" in cli("keys", "show", "--config", "host.toml")
    locked = cli("stake", "withdraw", "--config", "host.toml", status=2)
    assert "the stake is locked until the epoch's challenge window closes: it unlocks" in locked

    # ---- a client: list (with where to pull), pull found on chain, export, generate with transformers
    listing = cli("checkpoint", "list", "--deployment", "deployment.json")
    assert f"127.0.0.1:{port}" in listing and agg in listing
    pulled = cli("checkpoint", "pull", "--deployment", "deployment.json", "--epoch", "1", "--round", "latest",
                 "--out", "model.safetensors")
    assert f"pulled epoch 1 round 2 from 127.0.0.1:{port} (certificate from the chain (announced by {agg})" in pulled
    cli("checkpoint", "export", "--checkpoint", "model.safetensors", "--out", "hf-model")
    generate = ("from transformers import pipeline; g = pipeline('text-generation', model='hf-model', device='cpu'); "
                "print(repr(g('def ', max_new_tokens=8, do_sample=False)[0]['generated_text']))")
    proc = subprocess.run([sys.executable, "-c", generate], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = eval(proc.stdout.strip().splitlines()[-1])  # the repr printed above
    assert text.startswith("def ") and len(text.encode()) > len("def ")
    assert host != agg
