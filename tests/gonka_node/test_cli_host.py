"""The host's verbs from the command line, against the embedded chain served over JSON-RPC and a real
aggregator (gRPC, TLS, 127.0.0.1:0): the preflight before any stake (a fresh key is refused in one line
naming the transfer that fixes it; funded by `gonka-node transfer`, it passes), `status`, `rewards` that
still see and claim everything after the state folder is lost, and `stake withdraw` refusing while the
stake is locked or frozen by a challenge, saying until when."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_host_node import AGG, GNK, TLS, AggregatorThread, World, make_node, rpc_url, world  # noqa: F401

from chain.types import Deployment
from gonka_node.cli import main
from gonka_node.core.keys import init_keys, load_keys
from gonka_node.epoch_setup import EpochTerms, epoch_spec

UNLOCK_RE = r"unlocks \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+ \(in \d+ (h|min)[^)]*\)"  # a date, and how far


def host_config(world: World, tmp_path: Path, rpc_url: str, key_dir: Path, epoch: int, state: str = "state") -> Path:  # noqa: F811
    """`gonka-node init host`'s template, pointed at this world (the aggregator found on chain)."""
    world.recipe.save(tmp_path / "recipe.json")
    deployment = Deployment(**{**world.deployment.__dict__, "extra": {"rpc_url": rpc_url}})
    deployment.save(tmp_path / "deployment.json")
    config = tmp_path / "host.toml"
    assert main(["init", "host", "--out", str(config), "--rpc-url", rpc_url, "--key-dir", str(key_dir),
                 "--epoch", str(epoch), "--stake", "100", "--force"]) == 0
    config.write_text(config.read_text().replace('state_dir = "host-state"', f'state_dir = "{state}"'))
    return config


def open_epoch(world: World) -> int:  # noqa: F811
    """A second epoch of the same recipe whose sign-in stays open for an hour."""
    gov = world.client(0)
    terms = EpochTerms(aggregators=[world.accounts[AGG].address], signin_window_s=3600, min_stake=100 * GNK,
                       max_hosts=4, reward_per_round=100 * GNK)
    init = gov.get_epoch(world.epoch).spec.init_checkpoint_hash
    return gov.create_epoch(epoch_spec(world.recipe, init, terms, "file:recipe.json"))


def test_preflight_refuses_a_fresh_key_in_one_line_then_passes_once_funded_by_cli(
    world: World, rpc_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    epoch = open_epoch(world)
    assert main(["keys", "init", "--key-dir", str(tmp_path / "keys"), "--insecure-plaintext"]) == 0
    address = load_keys(tmp_path / "keys").evm_address
    config = host_config(world, tmp_path, rpc_url, tmp_path / "keys", epoch)
    capsys.readouterr()
    with AggregatorThread(world, tmp_path / "agg") as target:
        world.client(AGG).announce_aggregator(epoch, target, TLS.cert_pem)
        assert main(["run", "--config", str(config), "--check"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and err[1] == "gonka-node run: error: preflight: 1 problem(s); nothing was staked"
        fix = re.search(r"`gonka-node (transfer --to \S+ --gnk 100 --eth [\d.]+)`", err[0])
        assert f"account {address} holds 0 GNK of the 100 to stake and 0 ETH of the ~" in err[0] and fix, err

        # The fix, as printed, from a funded account: then the same check passes and nothing was sent.
        assert main([*fix.group(1).split(), "--deployment", str(tmp_path / "deployment.json")]) == 0
        assert main(["run", "--config", str(config), "--check"]) == 0
        out = capsys.readouterr().out
        assert f"preflight passed: {address} can sign in to epoch {epoch} with 100 GNK stake" in out
        assert f"aggregator {target} answers" in out
        assert world.client(0).get_epoch(epoch).n_hosts == 0

        # The wrong recipe, an epoch that does not exist: each one line naming the fix.
        other = world.recipe.__class__(**{**world.recipe.__dict__, "n_rounds": 3})
        other.save(tmp_path / "recipe.json")
        assert main(["run", "--config", str(config), "--check"]) == 2
        assert f"recipe {tmp_path / 'recipe.json'} is not epoch {epoch}'s (model_spec_hash" in capsys.readouterr().err
        world.recipe.save(tmp_path / "recipe.json")
        config.write_text(config.read_text().replace(f"epoch = {epoch}", "epoch = 99"))
        assert main(["run", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"epoch 99 does not exist on chain {world.deployment.chain_id} (it has " \
            f"epochs 1..{epoch}): set [host] epoch" in err
        config.write_text(config.read_text().replace("epoch = 99", f"epoch = {epoch}"))
    # The aggregator has gone: named, with the address the chain gave.
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"aggregator {target} (from the chain (announced by {world.accounts[AGG].address})) does not answer" in err
    assert world.client(0).get_epoch(epoch).n_hosts == 0  # nothing was staked by any of these runs


def test_a_host_that_lost_its_state_folder_still_sees_and_claims_everything(
    world: World, rpc_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    init_keys(tmp_path / "keys", None, insecure_plaintext=True, node_seed=bytes([1]) * 32,
              evm_private_key=bytes(world.accounts[1].key))
    config = host_config(world, tmp_path, rpc_url, tmp_path / "keys", world.epoch, state="never-written")
    host = world.client(1)
    with AggregatorThread(world, tmp_path / "agg") as target:
        world.client(AGG).announce_aggregator(world.epoch, target, TLS.cert_pem)
        nodes = [make_node(world, i, target, tmp_path / f"host{i}") for i in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            progress, _ = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        earned = progress.rewards["1"] + progress.rewards["2"]
        assert progress.rewards["1"] > 0 and progress.rewards["2"] > 0

        assert main(["status", "--config", str(config)]) == 0
        status = capsys.readouterr().out
        assert "rounds:         2 of 2 finalized" in status and "slot:           0" in status
        assert f"earned:         {earned / GNK:g} GNK in 2 round(s)" in status
        assert f"claimable:      {earned / GNK:g} GNK" in status and re.search(f"next deadline:  stake {UNLOCK_RE}", status)

        before = host.gnk_balance()
        assert main(["rewards", "--config", str(config), "--claim", "--ngonka"]) == 0
        out = capsys.readouterr().out
        assert f"{progress.rewards['1']:,} ngonka" in out and "aggregator" in out
        assert f"claimed {earned:,} ngonka" in out
        assert host.gnk_balance() - before == earned
        assert not (tmp_path / "never-written").exists()  # nothing came from (or went to) a state folder
    # With the aggregator gone, claimed rewards still come from the chain (it is not even asked).
    assert main(["rewards", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.count("yes │ chain") == 2
    assert f"earned {earned / GNK:g} GNK; unclaimed 0 GNK" in out


def test_stake_withdraw_says_until_when_the_stake_is_locked_or_frozen(
    world: World, rpc_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    init_keys(tmp_path / "keys", None, insecure_plaintext=True, node_seed=bytes([2]) * 32,
              evm_private_key=bytes(world.accounts[2].key))
    config = host_config(world, tmp_path, rpc_url, tmp_path / "keys", world.epoch)
    capsys.readouterr()
    assert main(["stake", "withdraw", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the stake is locked until the epoch's challenge window closes: it " in err
    assert re.search(UNLOCK_RE, err), err

    gov, host = world.client(0), world.client(2)
    challenge = gov.challenge(world.epoch, host.address, b"\x07" * 32, "https://example.org/e.json")
    assert main(["stake", "withdraw", "--config", str(config)]) == 2
    assert "frozen by 1 open challenge(s)" in capsys.readouterr().err
    gov.resolve_challenge(challenge, False)  # rejected: the bond goes to the host
    world.backend.increase_time(gov.stake_unlock_time(world.epoch) - gov.chain_time() + 1)
    before = host.gnk_balance()
    assert main(["stake", "withdraw", "--config", str(config)]) == 0
    assert "withdrew 100 GNK from epoch" in capsys.readouterr().out
    assert host.gnk_balance() - before == 100 * GNK
