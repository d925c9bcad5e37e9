"""ChainClient behaviour that must be the same on every backend: errors, replay, retries, deployments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
from conftest import GNK, World, make_spec, sha

from chain.backends import RpcBackend, embedded_accounts
from chain.client import ChainClient
from chain.errors import ChainError, ChainRejected, ChainRevert, DeploymentError, SpecError
from chain.types import Deployment


def test_reads_and_transactions_revert_with_the_contract_reason(world: World) -> None:
    client = world.client(9)
    with pytest.raises(ChainRevert) as read_err:
        client.get_epoch(42)
    assert read_err.value.reason == "registry: unknown epoch"
    with pytest.raises(ChainRevert) as tx_err:
        client.transfer(world.address(2), 10**30)
    assert tx_err.value.reason == "gnk: insufficient balance"


def _signed_transfer(client: ChainClient, to: str, amount: int, chain_id: int) -> bytes:
    w3 = client.w3
    tx = {
        "to": client.gnk.address,
        "data": client.gnk.encode_abi("transfer", args=[to, amount]),
        "gas": 100_000,
        "maxFeePerGas": 2 * int(w3.eth.get_block("latest")["baseFeePerGas"]) + 10**9,
        "maxPriorityFeePerGas": 10**9,
        "nonce": w3.eth.get_transaction_count(client.address, "pending"),
        "chainId": chain_id,
        "type": 2,
        "value": 0,
    }
    return bytes(client.account.sign_transaction(tx).raw_transaction)


def test_a_transaction_signed_for_another_chain_is_rejected(world: World) -> None:
    client = world.client(2)
    before = client.gnk_balance(world.address(9))
    raw = _signed_transfer(client, world.address(9), GNK, chain_id=client.chain_id + 1)
    with pytest.raises(ChainRejected, match="chain id"):
        client.sender.send_raw(raw)
    assert client.gnk_balance(world.address(9)) == before


def test_replaying_the_same_signed_bytes_executes_once(world: World) -> None:
    client = world.client(2)
    before = client.gnk_balance(world.address(9))
    raw = _signed_transfer(client, world.address(9), GNK, chain_id=client.chain_id)
    first = client.sender.send_raw(raw)
    again = client.sender.send_raw(raw)  # the node knows this hash: nothing is sent a second time
    assert first["transactionHash"] == again["transactionHash"]
    assert client.gnk_balance(world.address(9)) - before == GNK


def test_a_lost_response_is_not_sent_twice(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    client = world.client(2)
    real_send = client.w3.eth.send_raw_transaction
    calls: list[bytes] = []

    def send_then_drop_response(raw: bytes) -> object:
        calls.append(bytes(raw))
        real_send(raw)
        raise requests.ConnectionError("connection reset after the request was written")

    monkeypatch.setattr(client.w3.eth, "send_raw_transaction", send_then_drop_response)
    nonce = client.w3.eth.get_transaction_count(client.address)
    before = client.gnk_balance(world.address(9))
    receipt = client.transfer(world.address(9), GNK)
    assert receipt["status"] == 1 and len(calls) == 1
    assert client.w3.eth.get_transaction_count(client.address) == nonce + 1
    assert client.gnk_balance(world.address(9)) - before == GNK


def test_a_request_that_never_arrived_is_retried_with_the_same_bytes(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = world.client(2)
    client.sender.retry_delay_s = 0.0
    real_send = client.w3.eth.send_raw_transaction
    calls: list[bytes] = []

    def fail_first(raw: bytes) -> object:
        calls.append(bytes(raw))
        if len(calls) == 1:
            raise requests.ConnectionError("connection refused")
        return real_send(raw)

    monkeypatch.setattr(client.w3.eth, "send_raw_transaction", fail_first)
    nonce = client.w3.eth.get_transaction_count(client.address)
    client.transfer(world.address(9), GNK)
    assert len(calls) == 2 and calls[0] == calls[1]
    assert client.w3.eth.get_transaction_count(client.address) == nonce + 1


def test_nonces_follow_the_node_after_a_revert_to_snapshot(world: World) -> None:
    client = world.client(2)
    snapshot = world.backend.snapshot()
    client.transfer(world.address(9), GNK)
    client.transfer(world.address(9), GNK)
    world.backend.revert(snapshot)
    client.transfer(world.address(9), GNK)  # a cached nonce would now be 2 too high and hang
    assert client.w3.eth.get_transaction_count(client.address) >= 1


def test_deployment_round_trips_and_binds_only_to_its_chain(world: World, tmp_path: Path) -> None:
    path = tmp_path / "deployment.json"
    world.deployment.save(path)
    loaded = Deployment.load(path)
    assert loaded == world.deployment
    assert ChainClient(world.backend, world.accounts[0], loaded).connect().gnk_balance() > 0
    wrong = Deployment(**{**json.loads(path.read_text()), "chain_id": 1})
    with pytest.raises(DeploymentError, match="chain id 1"):
        ChainClient(world.backend, world.accounts[0], wrong).connect()
    nowhere = Deployment(**{**json.loads(path.read_text()), "registry": "0x" + "11" * 20})
    with pytest.raises(DeploymentError, match="no Registry contract"):
        ChainClient(world.backend, world.accounts[0], nowhere).connect()


def test_node_key_must_be_32_bytes(world: World) -> None:
    epoch = world.client(0).create_epoch(world.spec())
    with pytest.raises(ValueError, match="node_key must be 32 bytes"):
        world.client(2).join(epoch, 100 * GNK, b"short")
    world.client(2).join(epoch, 100 * GNK, "0x" + sha("k").hex())
    assert world.client(0).host_info(epoch, world.address(2)).node_key == sha("k")


def test_deployment_file_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DeploymentError, match="no such deployment file"):
        Deployment.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"chain_id": 1, "gnk": "0x00"}')
    with pytest.raises(DeploymentError, match="missing field"):
        Deployment.load(bad)


def test_spec_validation_names_the_field() -> None:
    aggregator = embedded_accounts()[1].address
    with pytest.raises(SpecError, match=r"field 'inner_lr'.*more than 9 decimals"):
        make_spec(aggregator, inner_lr=1e-12)
    with pytest.raises(SpecError, match="field 'aggregator_quorum'"):
        make_spec(aggregator, aggregator_quorum=2)
    with pytest.raises(SpecError, match="field 'init_checkpoint_hash'"):
        make_spec(aggregator, init_checkpoint_hash=bytes(32))
    with pytest.raises(SpecError, match="field 'aggregators'"):
        make_spec(aggregator, aggregators=(aggregator, aggregator.lower()))
    assert make_spec(aggregator, inner_lr=1.5e-4).to_abi()[5] == 150_000
    with pytest.raises(SpecError, match=r"field 'replay_probability': must be in \[0, 1\]"):
        make_spec(aggregator, replay_probability=1.5)
    with pytest.raises(SpecError, match="field 'challenge_window'"):
        make_spec(aggregator, challenge_window=0)
    with pytest.raises(SpecError, match="field 'challenge_bond'"):
        make_spec(aggregator, challenge_bond=0)


def test_the_stake_rule_is_checked_before_anything_is_sent() -> None:
    aggregator = embedded_accounts()[1].address
    with pytest.raises(SpecError, match=r"field 'min_stake'.*stake must be >= reward / p: >= 400000000000 ngonka"):
        make_spec(aggregator, min_stake=400 * GNK - 1, reward_per_round=100 * GNK, replay_probability=0.25)
    with pytest.raises(SpecError, match="impossible with replay_probability 0"):
        make_spec(aggregator, reward_per_round=1, replay_probability=0.0)
    boundary = make_spec(aggregator, min_stake=400 * GNK, reward_per_round=100 * GNK, replay_probability=0.25)
    assert boundary.to_abi()[18:] == (250_000_000, 3600, GNK)
    assert make_spec(aggregator, reward_per_round=0, replay_probability=0.0).to_abi()[18] == 0


def test_the_registry_fits_under_the_eip170_code_size_limit(world: World) -> None:
    client = world.client(0)
    size = len(client.w3.eth.get_code(client.registry.address))
    assert 20_000 < size <= 24_576 - 1024  # keep 1 KiB of headroom for the next rule


def test_constructors_store_and_connect_dials() -> None:
    client = ChainClient(RpcBackend("http://127.0.0.1:9", timeout_s=0.5), embedded_accounts()[0])
    assert client.deployment is None  # nothing dialled yet
    with pytest.raises(ChainError, match="no JSON-RPC node answers"):
        client.connect()


def test_an_account_holding_little_eth_can_transact_and_an_empty_one_cannot(world: World) -> None:
    """Gas estimates are capped at what the sender can pay for (geth and anvil do; the embedded chain
    too): 0.002 ETH pays for a token transfer, while nothing at all is refused by the node."""
    from eth_account import Account

    funder = world.client(0)
    small = Account.create()
    funder.transfer_eth(small.address, 2 * 10**15)
    funder.transfer(small.address, 5 * GNK)
    client = funder.with_account(small)
    client.transfer(world.address(3), GNK)
    assert client.gnk_balance() == 4 * GNK and 0 < client.eth_balance() < 2 * 10**15
    empty = funder.with_account(Account.create())
    with pytest.raises(ChainRejected, match=r"(?i)node refused .*(enough balance|insufficient funds)"):
        empty.transfer_eth(world.address(3), 1)  # refused at the estimate (embedded) or the send (anvil)
