"""The OpenAI API's errors, one class per kind: each knows its HTTP status and its JSON shape.

The body is what OpenAI sends, `{"error": {"message", "type", "param", "code"}}`, so every client
library raises its own matching exception (`openai.BadRequestError` for 400, `NotFoundError` for 404,
`RateLimitError` for 429, ...). Handlers raise these; one middleware (`app.py`) writes them.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server answers with an error; subclasses fix the status, type and code."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.provenance: Any = None  # models.Provenance of the round that was answering, if one was

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    """A field is missing, of the wrong type, out of range or not supported by this server."""


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(ApiError):
    status = 404
    code = "model_not_found"


class RouteNotFound(ApiError):
    status = 404
    code = "unknown_url"


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"


class BodyTooLarge(ApiError):
    status = 413
    code = "request_too_large"


class QueueFull(ApiError):
    """Every batch slot is busy and the waiting queue is full: the client should retry later."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class NoModelLoaded(ApiError):
    status = 503
    type = "server_error"
    code = "model_not_loaded"


class GenerationTimeout(ApiError):
    status = 504
    type = "server_error"
    code = "timeout"


class EngineFailure(ApiError):
    """The generator failed while running this request (a bug or an exhausted device), not the client."""

    status = 500
    type = "server_error"
    code = "engine_error"
