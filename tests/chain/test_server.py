"""The embedded chain served over JSON-RPC: other processes see a standard Ethereum node."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import GNK, make_spec, sha

from chain.backends import EmbeddedBackend, RpcBackend, embedded_accounts
from chain.client import ChainClient
from chain.errors import ChainRejected, ChainRevert
from chain.server import ChainServer


@pytest.fixture(scope="module")
def server() -> Iterator[ChainServer]:
    with ChainServer(EmbeddedBackend()) as srv:
        yield srv


def post(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_binds_port_zero_on_loopback_and_answers_in_hex(server: ChainServer) -> None:
    assert server.url.startswith("http://127.0.0.1:") and not server.url.endswith(":0")
    answer = post(server.url, [{"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []},
                               {"jsonrpc": "2.0", "id": 2, "method": "eth_getBlockByNumber", "params": ["latest", False]}])
    assert answer[0]["result"] == hex(EmbeddedBackend().connect().eth.chain_id)
    block = answer[1]["result"]
    assert block["number"].startswith("0x") and block["hash"].startswith("0x") and "gasLimit" in block


def test_malformed_requests_get_json_rpc_errors(server: ChainServer) -> None:
    request = urllib.request.Request(server.url, b"{not json", {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["error"]["code"] == -32700
    assert post(server.url, {"jsonrpc": "2.0", "id": 3, "method": "eth_noSuchThing", "params": []})["error"]


def test_clients_in_other_processes_get_the_same_behaviour(server: ChainServer) -> None:
    backend = RpcBackend(server.url)
    accounts = backend.dev_accounts()
    assert [a.address for a in accounts] == [a.address for a in embedded_accounts()]
    gov = ChainClient(backend, accounts[0]).connect()
    gov.deploy_all(initial_mint={accounts[2].address: 1000 * GNK})
    epoch = gov.create_epoch(make_spec(accounts[1].address))
    host = gov.with_account(accounts[2])
    snapshot = backend.snapshot()
    assert host.join(epoch, 100 * GNK, sha("k")) == 0
    with pytest.raises(ChainRevert) as err:
        host.join(epoch, 100 * GNK, sha("k"))
    assert err.value.reason == "registry: already joined"
    backend.revert(snapshot)
    assert gov.get_epoch(epoch).n_hosts == 0
    backend.increase_time(3601)
    with pytest.raises(ChainRevert, match="sign-in window closed"):
        host.join(epoch, 100 * GNK, sha("k"))
    raw = accounts[2].sign_transaction(
        {"to": accounts[3].address, "value": 1, "gas": 21000, "maxFeePerGas": 10**11,
         "maxPriorityFeePerGas": 1, "nonce": 0, "chainId": 1, "type": 2}
    ).raw_transaction
    with pytest.raises(ChainRejected, match="chain id"):
        host.sender.send_raw(bytes(raw))


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def test_follow_clock_passes_deadlines_without_a_transaction() -> None:
    backend = EmbeddedBackend()
    latest = int(backend.connect().eth.get_block("latest")["timestamp"])
    clock = FakeClock(latest + 0.5)
    with ChainServer(backend, follow_clock=True, clock=clock) as srv:
        rpc = RpcBackend(srv.url)
        accounts = rpc.dev_accounts()
        gov = ChainClient(rpc, accounts[0]).connect()
        deployment = gov.deploy_all(use_governor=True, voting_period_s=600, quorum_bps=1000,
                                    initial_mint={a.address: 1000 * GNK for a in accounts[:2]})
        voter = ChainClient(rpc, accounts[1], deployment).connect()
        voter.gov_deposit(500 * GNK)
        pid = voter.propose([voter.action_mint(accounts[3].address, GNK)], "mint one")
        voter.vote(pid, True)
        end = voter.proposal(pid).vote_end
        clock.now += 100
        assert voter.proposal(pid).state == "voting"
        before = voter.chain_time()
        clock.now += 30
        assert voter.chain_time() == before + 30  # time moves on a read, at the wall clock's rate
        clock.now += end - voter.chain_time() + 1  # the wall clock passes the vote's end; nothing is mined
        assert voter.proposal(pid).state == "passed"
        voter.execute(pid)  # first try: the execution sees the clock past the deadline too
        assert voter.gnk_balance(accounts[3].address) == GNK
        # A jump ahead (evm_increaseTime) is kept, and time runs on from there.
        rpc.increase_time(3600)
        ahead = voter.chain_time()
        clock.now += 10
        assert voter.chain_time() == ahead + 10


def test_without_follow_clock_the_chain_waits_for_a_transaction() -> None:
    backend = EmbeddedBackend()
    latest = int(backend.connect().eth.get_block("latest")["timestamp"])
    clock = FakeClock(latest + 1000)
    with ChainServer(backend, clock=clock) as srv:
        assert int(RpcBackend(srv.url).connect().eth.get_block("latest")["timestamp"]) == latest


def test_follow_clock_never_turns_the_pending_block_back() -> None:
    """The node stamps a pending block with the real time its parent was mined; a chain clock that runs
    from an earlier anchor can be behind that stamp. The read then mines the pending block as it is,
    instead of asking eth-tester to travel back in time (which it refuses, failing every request)."""
    import time

    backend = EmbeddedBackend()
    latest = int(backend.connect().eth.get_block("latest")["timestamp"])
    clock = FakeClock(latest)
    with ChainServer(backend, follow_clock=True, clock=clock) as srv:
        time.sleep(4)  # an idle node: real time moves on, so the block after the next is stamped ~4 s later
        rpc = RpcBackend(srv.url)
        client = ChainClient(rpc, rpc.dev_accounts()[0]).connect()
        client.transfer_eth(rpc.dev_accounts()[1].address, 1)
        for _ in range(4):
            clock.now += 1
            before = client.chain_time()
            assert rpc.client_version().startswith("EthereumTester")  # answers: no "travelling backwards"
            assert client.chain_time() >= before
