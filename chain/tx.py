"""Build, sign, send and confirm transactions: the one place that does it.

Uniform errors whatever the backend: a revert becomes `ChainRevert(reason)`, a node refusing the
transaction becomes `ChainRejected`. Retries are bounded and never send a transaction twice: the
transaction hash is known before sending (it is the hash of the signed bytes), so after a transport
error the node is asked whether it already has that hash before the same bytes are sent again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import requests
from eth_account.signers.local import LocalAccount
from eth_utils import ValidationError as EthValidationError
from hexbytes import HexBytes
from web3 import Web3
from web3.exceptions import ContractLogicError, TimeExhausted, TransactionNotFound, Web3RPCError
from web3.types import TxParams, TxReceipt

from chain.errors import ChainError, ChainRejected, ChainRevert, ChainTimeout

T = TypeVar("T")

_REVERT_PREFIXES = ("execution reverted: ", "execution reverted", "VM Exception while processing transaction: revert ")
_TRANSPORT_ERRORS = (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)
GAS_MARGIN = 1.25  # estimate * margin: block timestamps can move a branch between estimate and mining
DEFAULT_PRIORITY_FEE = 10**9  # 1 gwei


def _strip_revert_prefix(message: str) -> str:
    for prefix in _REVERT_PREFIXES:
        if message.startswith(prefix):
            return message[len(prefix) :].strip()
    return message.strip()


def _is_tester_revert(exc: BaseException) -> bool:
    # eth-tester raises its own TransactionFailed; imported lazily so an RPC-only install needs no tester.
    return type(exc).__name__ == "TransactionFailed" and type(exc).__module__.startswith("eth_tester")


def revert_reason(exc: BaseException) -> str | None:
    """The contract's reason string if `exc` is a revert on any backend, else None."""
    if isinstance(exc, ContractLogicError):
        return _strip_revert_prefix(str(exc.message or exc))
    if _is_tester_revert(exc):
        return _strip_revert_prefix(str(exc.args[0] if exc.args else ""))
    if isinstance(exc, Web3RPCError) and "revert" in str(exc.message).lower():
        return _strip_revert_prefix(str(exc.message))
    return None


def translate_call(fn: Callable[[], T]) -> T:
    """Run a read (eth_call / estimate) and turn any backend's revert into ChainRevert."""
    try:
        return fn()
    except Exception as exc:
        reason = revert_reason(exc)
        if reason is not None:
            raise ChainRevert(reason) from None
        raise


class TxSender:
    """Sends one account's transactions, one at a time (a lock), each confirmed before the next.

    The nonce comes from the node's pending count for every transaction: after a snapshot revert or
    another process using the same key, a cached nonce would be wrong, and a too-high nonce would make
    a node queue the transaction forever.
    """

    def __init__(
        self,
        w3: Web3,
        account: LocalAccount,
        *,
        receipt_timeout_s: float = 120.0,
        max_attempts: int = 3,
        retry_delay_s: float = 0.5,
        priority_fee: int = DEFAULT_PRIORITY_FEE,
    ) -> None:
        self.w3 = w3
        self.account = account
        self.receipt_timeout_s = receipt_timeout_s
        self.max_attempts = max_attempts
        self.retry_delay_s = retry_delay_s
        self.priority_fee = priority_fee
        self._lock = threading.Lock()
        self._chain_id: int | None = None

    @property
    def chain_id(self) -> int:
        if self._chain_id is None:
            self._chain_id = int(self.w3.eth.chain_id)
        return self._chain_id

    def send(self, tx: TxParams) -> TxReceipt:
        """Estimate, sign, send and wait for `tx` ({to, data} or {data} for a deployment)."""
        with self._lock:
            # One re-sign is allowed when the node says our nonce is stale and never saw our hash:
            # that transaction did not and cannot execute, so signing a new one sends nothing twice.
            for attempt in range(2):
                signed = self._sign(tx)
                try:
                    self._broadcast(signed.raw_transaction, signed.hash)
                except _StaleNonce:
                    if attempt == 1:
                        raise ChainRejected("nonce stale twice in a row; another sender uses this key") from None
                    continue
                return self._confirm(signed.hash, tx)
        raise AssertionError("unreachable")

    def _sign(self, tx: TxParams) -> Any:
        full: dict[str, Any] = dict(tx)
        full.setdefault("value", 0)
        full["from"] = self.account.address
        full["chainId"] = self.chain_id
        full["nonce"] = self.w3.eth.get_transaction_count(self.account.address, "pending")
        if "gas" not in full:
            full["gas"] = int(self._estimate(full) * GAS_MARGIN)
        full.setdefault("maxPriorityFeePerGas", self.priority_fee)
        full.setdefault("maxFeePerGas", self.max_fee_per_gas(full["maxPriorityFeePerGas"]))
        full["type"] = 2
        full.pop("from")
        return self.account.sign_transaction(full)

    def _estimate(self, tx: dict[str, Any]) -> int:
        """The node's gas estimate; a revert is ChainRevert, any other refusal (the sender cannot pay for
        the transaction's value and gas, …) ChainRejected, whatever the backend."""
        try:
            return int(translate_call(lambda: self.w3.eth.estimate_gas(cast(TxParams, tx))))
        except (Web3RPCError, EthValidationError) as exc:
            error = (getattr(exc, "rpc_response", None) or {}).get("error")
            message = error.get("message") if isinstance(error, dict) else str(exc)
            raise ChainRejected(f"node refused to estimate the transaction: {message}") from None

    def max_fee_per_gas(self, priority_fee: int | None = None) -> int:
        """The fee cap this sender signs with: twice the latest base fee plus the priority fee."""
        base_fee = int(self.w3.eth.get_block("latest").get("baseFeePerGas", 0) or 0)
        return 2 * base_fee + (self.priority_fee if priority_fee is None else priority_fee)

    def send_raw(self, raw: bytes) -> TxReceipt:
        """Send bytes signed elsewhere (e.g. to prove a node refuses them) and wait for the receipt."""
        tx_hash = HexBytes(Web3.keccak(raw))
        with self._lock:
            try:
                self._broadcast(raw, tx_hash)
            except _StaleNonce:
                raise ChainRejected("nonce too low") from None
            return self._confirm(tx_hash, None)

    def _broadcast(self, raw: bytes, tx_hash: HexBytes) -> None:
        for attempt in range(1, self.max_attempts + 1):
            try:
                self.w3.eth.send_raw_transaction(raw)
                return
            except _TRANSPORT_ERRORS as exc:
                if self._node_has(tx_hash):
                    return
                if attempt == self.max_attempts:
                    raise ChainError(f"could not reach the node after {attempt} attempts: {exc}") from exc
                time.sleep(self.retry_delay_s * attempt)
            except (Web3RPCError, EthValidationError, ValueError) as exc:
                message = str(getattr(exc, "message", None) or exc)
                lowered = message.lower()
                if "already known" in lowered or self._node_has(tx_hash):
                    return
                if "nonce too low" in lowered or "invalid transaction nonce" in lowered:
                    raise _StaleNonce from exc
                raise ChainRejected(f"node refused the transaction: {message}") from None

    def _node_has(self, tx_hash: HexBytes) -> bool:
        try:
            self.w3.eth.get_transaction(tx_hash)
            return True
        except TransactionNotFound:
            return False
        except _TRANSPORT_ERRORS:
            return False

    def _confirm(self, tx_hash: HexBytes, tx: TxParams | None) -> TxReceipt:
        try:
            receipt = self.w3.eth.wait_for_transaction_receipt(
                tx_hash, timeout=self.receipt_timeout_s, poll_latency=0.02
            )
        except TimeExhausted:
            raise ChainTimeout(
                f"no receipt for {tx_hash.to_0x_hex()} within {self.receipt_timeout_s}s", tx_hash.to_0x_hex()
            ) from None
        if receipt["status"] != 1:
            raise ChainRevert(self._replay_reason(receipt, tx), tx_hash.to_0x_hex())
        return receipt

    def _replay_reason(self, receipt: TxReceipt, tx: TxParams | None) -> str:
        """A mined transaction failed: re-run it as a call on the state before its block for the reason."""
        if tx is None:
            return ""
        call: dict[str, Any] = {"from": self.account.address, **tx}
        try:
            self.w3.eth.call(cast(TxParams, call), block_identifier=max(receipt["blockNumber"] - 1, 0))
        except Exception as exc:
            return revert_reason(exc) or ""
        return "out of gas or reverted only in its block"


class _StaleNonce(Exception):
    pass
