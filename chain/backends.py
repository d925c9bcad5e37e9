"""Where the chain runs: the embedded in-process EVM, or any JSON-RPC URL.

A backend makes the `Web3` connection (in `connect()`, never in the constructor), names the funded
development accounts if it has any, and offers the development controls tests need (snapshot/revert,
time travel). `ChainClient` uses nothing else of it, so the same client code runs on every backend.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from eth_account import Account
from eth_account.signers.local import LocalAccount
from web3 import HTTPProvider, Web3
from web3.providers.eth_tester import EthereumTesterProvider
from web3.types import RPCEndpoint, RPCResponse

from chain.errors import ChainError

# Anvil's (and Hardhat's) well-known development mnemonic; its accounts are funded on every anvil.
ANVIL_MNEMONIC = "test test test test test test test test test test test junk"
N_DEV_ACCOUNTS = 10


class ChainBackend(Protocol):
    name: str

    def connect(self) -> Web3: ...
    def dev_accounts(self) -> list[LocalAccount]: ...
    def snapshot(self) -> Any: ...
    def revert(self, snapshot_id: Any) -> None: ...
    def increase_time(self, seconds: int) -> None: ...


def embedded_accounts() -> list[LocalAccount]:
    """eth-tester's funded accounts (private keys 1..10): the same in every process."""
    return [Account.from_key(i.to_bytes(32, "big")) for i in range(1, N_DEV_ACCOUNTS + 1)]


def anvil_accounts() -> list[LocalAccount]:
    Account.enable_unaudited_hdwallet_features()
    return [
        Account.from_mnemonic(ANVIL_MNEMONIC, account_path=f"m/44'/60'/0'/0/{i}") for i in range(N_DEV_ACCOUNTS)
    ]


def raw_tx_chain_id(raw: bytes) -> int | None:
    """The chain id a signed transaction commits to (None: a pre-EIP-155 transaction, replayable)."""
    from eth.vm.forks.cancun.transactions import CancunTransactionBuilder

    tx = CancunTransactionBuilder.decode(raw)
    return getattr(tx, "chain_id", None)


def one_pass_gas_estimate(state: Any, transaction: Any) -> int:
    """Gas estimate from one execution at the block gas limit (or the sender's allowance, `_gas_cap`),
    instead of py-evm's binary search (~13 executions per estimate, half of the embedded chain's time per
    transaction).

    Gas used before refunds, plus 1/63 for the 63/64 rule on nested calls, plus a call stipend. An
    upper bound for this project's contracts (one or two levels of calls); receipts report the exact
    gas used, so benchmarks are unaffected.
    """
    from eth.vm.spoof import SpoofTransaction

    gas = _gas_cap(state, transaction)
    probe = SpoofTransaction(transaction, gas=gas, gas_price=0)
    snapshot = state.snapshot()
    try:
        computation = state.apply_transaction(probe)
        if computation.is_error:
            raise computation.error
        used = gas - computation.get_gas_remaining()
    finally:
        state.revert(snapshot)
    return int(min(state.gas_limit, used + used // 63 + 2300))


def _gas_cap(state: Any, transaction: Any) -> int:
    """The gas an estimate may use: the block's limit, or what the sender can pay for at the transaction's
    fee cap if that is less (as geth and anvil do). Without this cap an account must hold a whole block's
    gas in ETH before the node estimates even a transfer (30M gas at 1 gwei: 0.03 ETH)."""
    fee = int(getattr(transaction, "max_fee_per_gas", 0) or getattr(transaction, "gas_price", 0) or 0)
    if fee == 0:
        return int(state.gas_limit)
    spendable = state.get_balance(transaction.sender) - int(getattr(transaction, "value", 0) or 0)
    return int(max(0, min(state.gas_limit, spendable // fee)))


def _tester_chain(provider: EthereumTesterProvider) -> Any:
    """The py-evm chain behind an eth-tester provider (whose constructor always sets `ethereum_tester`)."""
    tester = provider.ethereum_tester
    assert tester is not None
    return tester.backend.chain


class _ChainIdCheckingProvider(EthereumTesterProvider):
    """eth-tester executes transactions signed for any chain; a real node does not. This one refuses
    them like geth/anvil do, so a transaction signed for another chain cannot be replayed here.
    py-evm is not thread-safe: every request holds one lock (the JSON-RPC server is threaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.RLock()

    def make_request(self, method: RPCEndpoint, params: Any) -> RPCResponse:
        with self.lock:
            return self._checked_request(method, params)

    def _checked_request(self, method: RPCEndpoint, params: Any) -> RPCResponse:
        if method == "eth_sendRawTransaction":
            raw = bytes.fromhex(params[0][2:]) if isinstance(params[0], str) else bytes(params[0])
            want = _tester_chain(self).chain_id
            have = raw_tx_chain_id(raw)
            if have != want:
                return {
                    "jsonrpc": "2.0",
                    "id": self._current_request_id,
                    "error": {"code": -32000, "message": f"invalid chain id for signer: have {have} want {want}"},
                }
        return super().make_request(method, params)


class EmbeddedBackend:
    """py-evm in this process (web3[tester]); zero setup. Several processes share it through
    `chain.server.ChainServer`, which serves it over JSON-RPC on 127.0.0.1."""

    name = "embedded"

    def __init__(self) -> None:
        self._provider: _ChainIdCheckingProvider | None = None
        self._w3: Web3 | None = None

    def connect(self) -> Web3:
        if self._w3 is None:
            self._provider = _ChainIdCheckingProvider()
            # Class and instance: eth-tester rebuilds the chain object (same class) on every revert.
            chain = _tester_chain(self._provider)
            type(chain).gas_estimator = staticmethod(one_pass_gas_estimate)
            chain.gas_estimator = one_pass_gas_estimate
            self._w3 = Web3(self._provider)
        return self._w3

    @property
    def provider(self) -> _ChainIdCheckingProvider:
        self.connect()
        assert self._provider is not None
        return self._provider

    @property
    def lock(self) -> threading.RLock:
        return self.provider.lock

    @property
    def tester(self) -> Any:
        return self.provider.ethereum_tester

    def dev_accounts(self) -> list[LocalAccount]:
        return embedded_accounts()

    def snapshot(self) -> int:
        with self.lock:
            return int(self.tester.take_snapshot())

    def revert(self, snapshot_id: Any) -> None:
        with self.lock:
            self.tester.revert_to_snapshot(int(snapshot_id))

    def increase_time(self, seconds: int) -> None:
        with self.lock:
            pending = self.tester.get_block_by_number("pending")["timestamp"]
            self.tester.time_travel(pending + int(seconds))
            self.tester.mine_blocks(1)


class RpcBackend:
    """Any JSON-RPC URL: anvil, `gonka-node chain serve`, a testnet."""

    name = "rpc"

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._w3: Web3 | None = None

    def connect(self) -> Web3:
        if self._w3 is None:
            w3 = Web3(HTTPProvider(self.url, request_kwargs={"timeout": self.timeout_s}))
            if not w3.is_connected():
                raise ChainError(f"no JSON-RPC node answers at {self.url}")
            self._w3 = w3
        return self._w3

    def client_version(self) -> str:
        return str(self.connect().client_version)

    def dev_accounts(self) -> list[LocalAccount]:
        """Funded development accounts when the node is a known devnet (anvil, our embedded server)."""
        version = self.client_version().lower()
        if version.startswith("anvil"):
            return anvil_accounts()
        if version.startswith("ethereumtester"):
            return embedded_accounts()
        return []

    def _rpc(self, method: str, params: list[Any]) -> Any:
        response = self.connect().provider.make_request(RPCEndpoint(method), params)
        if "error" in response:
            raise ChainError(f"{method} failed at {self.url}: {response['error']}")
        return response.get("result")

    def snapshot(self) -> Any:
        return self._rpc("evm_snapshot", [])

    def revert(self, snapshot_id: Any) -> None:
        if self._rpc("evm_revert", [snapshot_id]) is False:
            raise ChainError(f"evm_revert({snapshot_id}) refused at {self.url}")

    def increase_time(self, seconds: int) -> None:
        self._rpc("evm_increaseTime", [int(seconds)])
        self._rpc("evm_mine", [])
