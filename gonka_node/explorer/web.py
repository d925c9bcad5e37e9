"""The explorer's web server (aiohttp): HTML pages, the JSON API, live updates and downloads.

Read-only: only GET routes exist, and every query runs on a read-only SQLite connection. Pages carry a
Content-Security-Policy that allows scripts and styles from this server only (no inline script), on
top of the escaping every page does. Live updates are server-sent events (`/api/stream`): an `update`
event whenever the index changes, after which a page fetches its own `?part=main` again.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from eth_utils import is_address, to_checksum_address

from chain.types import AggregatorEndpoint
from gonka_node.explorer import pages, queries
from gonka_node.explorer.db import open_readonly, read_cursor, read_events
from gonka_node.explorer.downloads import NoSource, open_checkpoint
from gonka_node.explorer.markup import Markup
from gonka_node.explorer.queries import Site

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
STATIC = {"style.css": "text/css", "live.js": "text/javascript"}
INT64_MAX = (1 << 63) - 1
STREAM_POLL_S = 0.5
KEEPALIVE_S = 15.0
SITE = web.AppKey("site", Site)
DB_PATH = web.AppKey("db_path", Path)
STOPPING = web.AppKey("stopping", asyncio.Event)
ENDPOINTS: web.AppKey[Callable[[int], list[AggregatorEndpoint]]] = web.AppKey("endpoints")


class BadRequest(ValueError):
    """A path parameter that names nothing (not a number, not an address)."""


@dataclass(frozen=True)
class Route:
    page: Callable[[dict[str, Any]], Markup]
    title: Callable[[dict[str, Any]], str]


async def _query(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    path = request.app[DB_PATH]

    def run() -> Any:
        db = open_readonly(path)
        try:
            return fn(db, *args)
        finally:
            db.close()

    return await asyncio.to_thread(run)


def _int(request: web.Request, name: str) -> int:
    text = request.match_info[name]
    if not text.isdigit() or int(text) > INT64_MAX:
        raise BadRequest(f"{name} must be a whole number, got {text[:40]!r}")
    return int(text)


def _address(request: web.Request) -> str:
    text = request.match_info["address"]
    if not is_address(text):
        raise BadRequest(f"not an address: {text[:60]!r} (give 0x and 40 hex digits)")
    return to_checksum_address(text)


def _error(request: web.Request, status: int, message: str) -> web.Response:
    if request.path.startswith("/api/"):
        return web.json_response({"error": message}, status=status)
    title = "Not found" if status == 404 else "Cannot show this"
    return web.Response(text=str(pages.layout(title, pages.error_page(title, message), "", {})), status=status,
                        content_type="text/html")


def _loader(request: web.Request) -> tuple[Callable[..., Any], tuple[Any, ...], str]:
    """Which query a path asks for, its arguments, and what is missing when it returns None."""
    site = request.app[SITE]
    kind = (request.match_info.route.name or "").removeprefix("api-")
    if kind == "network":
        return queries.network, (site,), ""
    if kind == "epoch":
        epoch = _int(request, "epoch")
        return queries.epoch_detail, (site, epoch), f"no epoch {epoch} on chain (yet)"
    if kind == "round":
        epoch, round_ = _int(request, "epoch"), _int(request, "round")
        return queries.round_detail, (site, epoch, round_), f"no round {round_} in epoch {epoch}"
    if kind == "host":
        return queries.host_detail, (site, _address(request)), ""
    raise BadRequest(f"unknown view {kind!r}")


async def _load(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        fn, args, missing = _loader(request)
    except BadRequest as exc:
        return _error(request, 400, str(exc))
    data = await _query(request, fn, *args)
    if data is None:
        return _error(request, 404, missing)
    return dict(data)


ROUTES: dict[str, Route] = {
    "network": Route(pages.network_page, lambda d: "Network"),
    "epoch": Route(pages.epoch_page, lambda d: f"Epoch {d['epoch']}"),
    "round": Route(pages.round_page, lambda d: f"Epoch {d['epoch']} round {d['round']}"),
    "host": Route(pages.host_page, lambda d: f"Host {d['host']}"),
}


async def page(request: web.Request) -> web.StreamResponse:
    data = await _load(request)
    if isinstance(data, web.Response):
        return data
    route = ROUTES[request.match_info.route.name or ""]
    main = route.page(data)
    if request.query.get("part") == "main":
        return web.Response(text=str(main), content_type="text/html")
    live = f"{request.path}?part=main"
    return web.Response(text=str(pages.layout(route.title(data), main, live, data["status"])), content_type="text/html")


async def api(request: web.Request) -> web.StreamResponse:
    data = await _load(request)
    return data if isinstance(data, web.Response) else web.json_response(data)


async def api_status(request: web.Request) -> web.StreamResponse:
    return web.json_response(await _query(request, queries.status, request.app[SITE]))


async def stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: `update` with the index's block and version each time the index changes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    stopping = request.app[STOPPING]
    last, quiet = None, 0.0
    while not stopping.is_set():
        cursor = await _query(request, read_cursor)
        now = (cursor.block, cursor.version) if cursor else (None, 0)
        if now != last:
            await response.write(f"event: update\ndata: {json.dumps({'block': now[0], 'version': now[1]})}\n\n".encode())
            last, quiet = now, 0.0
        elif quiet >= KEEPALIVE_S:
            await response.write(b": keep-alive\n\n")
            quiet = 0.0
        await asyncio.sleep(STREAM_POLL_S)
        quiet += STREAM_POLL_S
    return response


def _finalized_sha(db: sqlite3.Connection, epoch: int, round_: int) -> bytes | None:
    rows = read_events(db, "name='RoundFinalized' AND epoch=? AND round=?", [epoch, round_])
    return bytes.fromhex(rows[0].args["checkpoint_sha256"][2:]) if rows else None


async def download(request: web.Request) -> web.StreamResponse:
    """The round's checkpoint, streamed from an aggregator that announces the chain's sha256 for it."""
    try:
        epoch, round_ = _int(request, "epoch"), _int(request, "round")
    except BadRequest as exc:
        return _error(request, 400, str(exc))
    want = await _query(request, _finalized_sha, epoch, round_)
    if want is None:
        return _error(request, 404, f"round {round_} of epoch {epoch} is not finalized")
    endpoints: list[AggregatorEndpoint] = await asyncio.to_thread(request.app[ENDPOINTS], epoch)
    try:
        source = await asyncio.to_thread(open_checkpoint, endpoints, epoch, round_, want, 60.0)
    except NoSource as exc:
        return _error(request, 502, str(exc))
    try:
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(source.length),
            "Content-Disposition": f'attachment; filename="epoch-{epoch}-round-{round_}.safetensors"',
        })
        await response.prepare(request)
        while (chunk := await asyncio.to_thread(next, source.chunks, None)) is not None:
            await response.write(chunk)
        return response
    finally:
        source.close()


def _static(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    body = resources.files("gonka_node.explorer").joinpath("static", name).read_bytes()

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type=STATIC[name], headers={"Cache-Control": "max-age=300"})

    return handler


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:  # unknown path, wrong method: one line, no traceback
        return _error(request, exc.status, exc.reason)


def build_app(site: Site, db_path: Path, endpoints: Callable[[int], list[AggregatorEndpoint]]) -> web.Application:
    app = web.Application(middlewares=[_errors])
    app[SITE], app[DB_PATH], app[STOPPING], app[ENDPOINTS] = site, db_path, asyncio.Event(), endpoints
    app.on_response_prepare.append(_security_headers)
    app.on_shutdown.append(_stop_streams)
    r = app.router
    r.add_get("/", page, name="network")
    r.add_get("/epochs/{epoch}", page, name="epoch")
    r.add_get("/epochs/{epoch}/rounds/{round}", page, name="round")
    r.add_get("/epochs/{epoch}/rounds/{round}/checkpoint.safetensors", download)
    r.add_get("/hosts/{address}", page, name="host")
    r.add_get("/api/status", api_status)
    r.add_get("/api/network", api, name="api-network")
    r.add_get("/api/epochs/{epoch}", api, name="api-epoch")
    r.add_get("/api/epochs/{epoch}/rounds/{round}", api, name="api-round")
    r.add_get("/api/hosts/{address}", api, name="api-host")
    r.add_get("/api/stream", stream)
    for name in STATIC:
        r.add_get(f"/static/{name}", _static(name))
    return app


async def _stop_streams(app: web.Application) -> None:
    app[STOPPING].set()
