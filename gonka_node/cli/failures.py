"""Failures as one line a person can act on: chain reverts and refusals, an unreachable node or
aggregator, bad files. The CLI prints `explain(exc)` instead of a traceback (unless `--debug`); an
exception it cannot explain is a bug, reported in one line too, with the advice to rerun with --debug.

Distinctions are made by exception class, never by message text, except where a library gives only text
(a node's refusal of a transaction), and then only to add a hint.
"""

from __future__ import annotations

from typing import Any

# The node's words for a transaction its sender cannot pay for (geth and anvil; eth-tester), with the fix.
_NO_GAS = ("the account has too little ETH for gas: send it some, e.g. `gonka-node transfer --to ADDRESS --eth 1` "
           "from a funded account")
_REFUSAL_HINTS = {"insufficient funds": _NO_GAS, "cannot afford txn gas": _NO_GAS, "not have enough balance": _NO_GAS}


def _hinted(text: str) -> str:
    hint = next((h for words, h in _REFUSAL_HINTS.items() if words in text.lower()), None)
    return f"{text}; {hint}" if hint else text


def explain(exc: BaseException) -> str | None:
    """A one-line message for a failure of the outside world or of the user's input; None for a bug."""
    for kinds, say in _EXPLAINERS:
        if isinstance(exc, kinds()):
            return say(exc)
    return None


def _chain() -> tuple[type[BaseException], ...]:
    from chain.errors import ChainError

    return (ChainError,)


def _say_chain(exc: Any) -> str:
    from chain.errors import ChainRejected, ChainRevert

    text = str(exc)
    if isinstance(exc, ChainRevert):
        return f"the chain refused the transaction: {exc.reason or 'reverted without a reason'}"
    if isinstance(exc, ChainRejected):
        return _hinted(text)
    return text


def _transport() -> tuple[type[BaseException], ...]:
    import requests
    from web3.exceptions import ProviderConnectionError, RequestTimedOut, TimeExhausted

    return (requests.ConnectionError, requests.Timeout, ProviderConnectionError, RequestTimedOut, TimeExhausted)


def _say_transport(exc: Any) -> str:
    url = getattr(getattr(exc, "request", None), "url", None)
    where = f" at {url}" if url else ""
    return (f"cannot reach the chain's JSON-RPC node{where} ({type(exc).__name__}); is it running "
            "(`gonka-node chain serve`), and is --rpc-url / [chain] rpc_url right?")


def _web3() -> tuple[type[BaseException], ...]:
    from web3.exceptions import Web3Exception

    return (Web3Exception,)


def _say_web3(exc: Any) -> str:
    error = (getattr(exc, "rpc_response", None) or {}).get("error")
    message = error.get("message") if isinstance(error, dict) else getattr(exc, "message", None) or str(exc)
    return _hinted(f"the chain node answered with an error: {str(message).splitlines()[0][:300]}")


def _grpc() -> tuple[type[BaseException], ...]:
    import grpc

    return (grpc.RpcError,)


def _say_grpc(exc: Any) -> str:
    code = exc.code().name if hasattr(exc, "code") else "?"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"the aggregator call failed: {code}: {details}"


def _ours() -> tuple[type[BaseException], ...]:
    from gonka_node.core.config import ConfigError
    from gonka_node.core.keys import KeyStoreError
    from gonka_node.core.recipe import RecipeError
    from gonka_node.core.storage import StoreError
    from gonka_node.core.tls import TlsError
    from training.dataset import DatasetError
    from training.tokenizer import TokenizerError

    return (ConfigError, KeyStoreError, RecipeError, TlsError, StoreError, DatasetError, TokenizerError)


def _say_os(exc: Any) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc) or type(exc).__name__


_EXPLAINERS: list[tuple[Any, Any]] = [
    (_chain, _say_chain),
    (_transport, _say_transport),  # before OSError: requests' errors are OSErrors
    (_web3, _say_web3),
    (_grpc, _say_grpc),
    (_ours, lambda exc: str(exc)),
    (lambda: (OSError,), _say_os),
]
