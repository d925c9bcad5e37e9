"""The HTTP side: an aiohttp application with OpenAI's routes and error shape.

`GET /v1/models` lists the served rounds (newest first), `GET /v1/models/{id}` one of them, `POST
/v1/completions` completes. Every response names a verified checkpoint in `X-Gonka-*` headers: the
one that answered, or (errors before a model was chosen, the model list) the newest one served. Any
failure becomes `{"error": {...}}` with its status; a bug in the server is a 500 with no detail beyond
its class, and is logged here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from gonka_node.serve.completions import Completion, respond
from gonka_node.serve.errors import (
    ApiError,
    BodyTooLarge,
    EngineFailure,
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
)
from gonka_node.serve.models import ModelRegistry
from gonka_node.serve.protocol import Limits, parse_completion, requested_model

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class HttpSettings:
    limits: Limits
    max_body_bytes: int  # larger bodies are refused (413) before they are read
    request_timeout_s: float  # a completion not finished by then is cancelled (504)


REGISTRY = web.AppKey("registry", ModelRegistry)
SETTINGS = web.AppKey("settings", HttpSettings)


def build_app(registry: ModelRegistry, settings: HttpSettings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_errors])
    app[REGISTRY] = registry
    app[SETTINGS] = settings
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/v1/completions", _completions)
    return app


async def _models(request: web.Request) -> web.Response:
    served = request.app[REGISTRY].listed()
    return web.json_response({"object": "list", "data": [m.card() for m in served]})


async def _model(request: web.Request) -> web.Response:
    served = request.app[REGISTRY].get(request.match_info["model"])
    return web.json_response(served.card(), headers=served.provenance.headers())


async def _completions(request: web.Request) -> web.StreamResponse:
    settings, registry = request.app[SETTINGS], request.app[REGISTRY]
    body = await _json_body(request)
    # Every round of the epoch has the recipe's tokenizer: the one found here is the answering model's.
    tokenizer = registry.get(requested_model(body)).tokenizer
    parsed = parse_completion(body, settings.limits, tokenizer)
    completion = Completion(parsed, asyncio.get_running_loop(), tokenizer).submit(registry)
    return await respond(request, completion, settings.request_timeout_s)


async def _json_body(request: web.Request) -> object:
    raw = await request.read()  # aiohttp refuses a body over client_max_size here (413)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid JSON (UTF-8)") from None


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except ApiError as exc:
        response = _error_response(request, exc)
    except web.HTTPException as exc:
        response = _error_response(request, _http_error(request, exc))
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        response = _error_response(request, EngineFailure("the server failed on this request; report it"))
    newest = request.app[REGISTRY].newest()
    if newest is not None and not response.prepared:
        for name, value in newest.provenance.headers().items():
            response.headers.setdefault(name, value)
    return response


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[SETTINGS].max_body_bytes
        return BodyTooLarge(f"the request body exceeds this server's limit of {limit:,} bytes")
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound(f"no route {request.method} {request.path}: this server serves GET /v1/models and "
                             "POST /v1/completions")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
    error = ApiError(exc.text or exc.reason)
    error.status = exc.status
    return error


def _error_response(request: web.Request, exc: ApiError) -> web.Response:
    body = exc.body()
    newest = request.app[REGISTRY].newest()
    provenance = exc.provenance or (newest.provenance if newest is not None else None)
    if provenance is None:
        return web.json_response(body, status=exc.status)
    body["gonka"] = provenance.field()
    return web.json_response(body, status=exc.status, headers=provenance.headers())
