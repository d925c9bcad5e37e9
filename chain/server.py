"""Serve the embedded chain over JSON-RPC on 127.0.0.1 so several local processes share one chain.

`ChainServer(backend).start()` binds (port 0 allowed), serves from a thread and exposes `url`. It speaks
standard Ethereum JSON-RPC (hex quantities, revert errors with the ABI-encoded reason in `data`, like
geth/anvil) plus anvil's development methods evm_snapshot / evm_revert / evm_increaseTime / evm_mine, so
`RpcBackend` treats it exactly like an anvil node.

The embedded EVM stamps a block when it is mined, so left alone its clock stands still between
transactions: a view or a transaction after a deadline would still see the time of the last transaction
("voting still open"). With `follow_clock` the server moves the chain's time along with the wall clock
before answering a request (one empty block when at least a second has passed), never backwards: after
`evm_increaseTime` it keeps the lead and runs on from there.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from eth_abi import encode
from web3 import Web3

from chain.backends import EmbeddedBackend

MAX_REQUEST_BYTES = 16 * 1024 * 1024
_ERROR_SELECTOR = bytes.fromhex("08c379a0")  # Error(string)


def to_json_rpc(value: Any) -> Any:
    """Python values as eth-tester returns them → JSON-RPC encoding (quantities and data as 0x-hex)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return hex(value)
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, Mapping):
        return {k: to_json_rpc(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_rpc(v) for v in value]
    raise TypeError(f"cannot encode {type(value).__name__} as JSON-RPC")


def _revert_error(message: str) -> dict[str, Any]:
    reason = message.removeprefix("execution reverted").removeprefix(":").strip()
    data = _ERROR_SELECTOR + encode(["string"], [reason])
    return {"code": 3, "message": f"execution reverted: {reason}", "data": "0x" + data.hex()}


_DEV_METHODS = ("evm_increaseTime", "evm_snapshot", "evm_revert", "evm_mine")


class ChainServer:
    def __init__(
        self,
        backend: EmbeddedBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        follow_clock: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.host = host
        self.port = port
        self.follow_clock = follow_clock
        self._clock = clock
        self._lead = 0.0  # seconds the chain's clock runs ahead of the wall clock (follow_clock)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._request: Callable[[str, Any], Any] | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("server not started")
        host, port = cast(tuple[str, int], self._httpd.server_address[:2])  # AF_INET: (host, port)
        return f"http://{host}:{port}"

    def start(self) -> ChainServer:
        provider = self.backend.provider
        # Only eth-tester's own formatting middleware: results come back in JSON-RPC shape (camelCase).
        bare = Web3(provider, middleware=[])
        self._request = provider.request_func(bare, bare.middleware_onion)
        self._httpd = ThreadingHTTPServer((self.host, self.port), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="chain-rpc", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> ChainServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def handle(self, request: Any) -> Any:
        if isinstance(request, list):
            return [self.handle(r) for r in request]
        if not isinstance(request, dict) or "method" not in request:
            return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "invalid request"}}
        rid = request.get("id")
        try:
            result = self._dispatch(str(request["method"]), request.get("params") or [])
        except _RpcError as exc:
            return {"jsonrpc": "2.0", "id": rid, "error": exc.error}
        except Exception as exc:  # every failure of one request becomes its JSON-RPC error; the server lives on
            error = (
                _revert_error(str(exc.args[0]) if exc.args else "")
                if type(exc).__name__ == "TransactionFailed"
                else {"code": -32000, "message": str(exc) or type(exc).__name__}
            )
            return {"jsonrpc": "2.0", "id": rid, "error": error}
        return {"jsonrpc": "2.0", "id": rid, "result": to_json_rpc(result)}

    def _dispatch(self, method: str, params: list[Any]) -> Any:
        tester = self.backend.tester
        with self.backend.lock:
            if self.follow_clock and method not in _DEV_METHODS:
                self._advance_clock()
            if method == "evm_increaseTime":
                pending = tester.get_block_by_number("pending")["timestamp"]
                tester.time_travel(pending + int(str(params[0]), 0))
                return int(str(params[0]), 0)
            if method == "evm_snapshot":
                return tester.take_snapshot()
            if method == "evm_revert":
                tester.revert_to_snapshot(int(str(params[0]), 0))
                return True
            if method == "evm_mine":
                tester.mine_blocks(1)
                return "0x0"
            assert self._request is not None
            response = self._request(method, params)
        if "error" in response:
            raise _RpcError(dict(response["error"]))
        return response.get("result")

    def _advance_clock(self) -> None:
        """Mine one empty block stamped with the chain time the wall clock says it is now (under the lock).

        Chain time = wall time + the chain's lead, where the lead is the most the chain was ever seen ahead
        of the wall clock (`evm_increaseTime`, blocks mined faster than one a second): kept, never undone,
        and never negative, so a chain left idle catches up with the wall clock at the next read."""
        tester = self.backend.tester
        latest = int(tester.get_block_by_number("latest")["timestamp"])
        now = self._clock()
        self._lead = max(self._lead, latest - now)
        due = int(now + self._lead)
        if due <= latest:
            return
        if int(tester.get_block_by_number("pending")["timestamp"]) > due:
            tester.mine_blocks(1)  # the pending block, stamped when the last one was mined, is late enough
        else:
            tester.time_travel(due + 1)  # eth-tester mines a block stamped `due`; the pending one gets due + 1

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_REQUEST_BYTES:
                    self.send_error(413 if length else 411, "bad Content-Length")
                    return
                try:
                    request = json.loads(self.rfile.read(length))
                except json.JSONDecodeError:
                    body = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse error"}}
                else:
                    body = server.handle(request)
                payload = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per request would drown the node's own logs

        return Handler


class _RpcError(Exception):
    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error
        super().__init__(error.get("message"))
