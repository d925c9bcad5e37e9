"""`POST /v1/completions` bodies: parsed and checked into a `CompletionRequest`, or `InvalidRequest`.

Fields follow OpenAI's legacy completions API. `prompt` is a string, a list of strings, a list of
token ids or a list of such lists, in the served epoch's tokenizer (the recipe's; for the byte tokenizer
the ids are the bytes 0..255). A prompt must be text the tokenizer takes back unchanged and must not
hold the end-of-text token: it is the document separator the model was trained with (the server puts
one before every prompt, as `checkpoint generate` does); for bytes that is U+0000. A string holding
lone surrogates (valid JSON, invalid Unicode) has no bytes. Fields that this server cannot honour are
refused unless they hold their neutral value; unknown fields are refused, as OpenAI refuses them.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gonka_node.serve.errors import InvalidRequest, PromptTooLong

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer

MAX_STOPS = 4
MAX_STOP_BYTES = 64
MAX_LOGPROBS = 5
MAX_SEED = 2**63 - 1
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the server's `ServeSettings` sets them)."""

    max_prompt_bytes: int = 8192  # tokens (bytes, for the byte tokenizer)
    max_tokens: int = 1024
    max_choices: int = 8  # prompts × n


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: tuple[tuple[int, ...], ...]  # token ids of each prompt, without the separator
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: tuple[bytes, ...]
    seed: int
    logprobs: int | None
    stream: bool
    include_usage: bool


# Fields accepted only with these values (what they mean when absent).
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "frequency_penalty": lambda v: v in (None, 0),
    "presence_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "suffix": lambda v: v is None,
    "user": lambda v: v is None or isinstance(v, str),
}
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "stream",
          "stream_options", *NEUTRAL}


def requested_model(body: Any) -> str:
    """The model a body names (checked first: its tokenizer reads the prompt)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return _model(body)


def parse_completion(body: Any, limits: Limits, tokenizer: Tokenizer) -> CompletionRequest:
    """`body` checked, its prompts encoded by `tokenizer` (the served model's)."""
    requested_model(body)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if not neutral(body.get(name)):
            raise InvalidRequest(f"{name}={body[name]!r} is not supported by this server", name)
    stream = _boolean(body, "stream", False)
    n = _integer(body, "n", 1, 1, limits.max_choices)
    prompts = _prompts(body.get("prompt", ""), limits, tokenizer)
    if len(prompts) * n > limits.max_choices:
        raise InvalidRequest(
            f"{len(prompts)} prompts × n={n} asks for {len(prompts) * n} completions; at most "
            f"{limits.max_choices} per request", "n")
    seed = body.get("seed")
    return CompletionRequest(
        model=_model(body),
        prompts=prompts,
        max_tokens=_integer(body, "max_tokens", DEFAULT_MAX_TOKENS, 0, limits.max_tokens),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        n=n,
        stop=_stops(body.get("stop")),
        seed=secrets.randbelow(MAX_SEED + 1) if seed is None else _integer(body, "seed", 0, 0, MAX_SEED),
        logprobs=None if body.get("logprobs") is None else _integer(body, "logprobs", 0, 0, MAX_LOGPROBS),
        stream=stream,
        include_usage=_include_usage(body, stream),
    )


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("you must provide a model parameter (GET /v1/models lists them)", "model")
    return model


def _integer(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}, got {value}", name)
    return float(value)


def _top_p(body: dict[str, Any]) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise InvalidRequest("top_p must be greater than 0", "top_p")
    return top_p


def _boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", name)
    return value


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("stream_options takes only include_usage", "stream_options")
    return _boolean(options, "include_usage", False)


def _stops(value: Any) -> tuple[bytes, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
    encoded = tuple(_utf8(s, "stop") for s in stops)
    if any(not 0 < len(s) <= MAX_STOP_BYTES for s in encoded):
        raise InvalidRequest(f"each stop sequence must be 1 to {MAX_STOP_BYTES} bytes of UTF-8", "stop")
    return encoded


def _prompts(value: Any, limits: Limits, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids", "prompt")
    prompts = tuple(_prompt_tokens(item, tokenizer) for item in value)
    for index, prompt in enumerate(prompts):
        if len(prompt) > limits.max_prompt_bytes:
            where = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
            raise PromptTooLong(
                f"{where} is {len(prompt)} tokens long; this server takes at most {limits.max_prompt_bytes}",
                "prompt")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompt_tokens(item: Any, tokenizer: Tokenizer) -> tuple[int, ...]:
    if isinstance(item, str):
        _utf8(item, "prompt")
        tokens = tuple(tokenizer.encode(item))
        if tokenizer.decode(tokens) != item and tokenizer.eot_id not in tokens:
            raise InvalidRequest("the prompt holds text this model's tokenizer cannot represent (it does not "
                                 "decode back to itself); remove or replace those characters", "prompt")
    elif isinstance(item, list) and all(_is_token(t) for t in item):
        tokens = tuple(item)
        bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token {bad} is not in this model's tokenizer (ids 0.."
                                 f"{tokenizer.vocab_size - 1})", "prompt")
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids", "prompt")
    if tokenizer.eot_id in tokens:
        raise InvalidRequest(f"the prompt holds {_eot_name(tokenizer)}, the document separator this model was "
                             "trained with; remove it", "prompt")
    return tokens


def _eot_name(tokenizer: Tokenizer) -> str:
    text = tokenizer.token_bytes(tokenizer.eot_id)
    if text == b"\0":
        return "byte 0 (U+0000)"
    return f"{text.decode('utf-8', 'replace')!r} (token {tokenizer.eot_id})"


def _utf8(text: str, param: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{param} holds {text[exc.start]!r} at character {exc.start}, a lone surrogate with no UTF-8 "
            "bytes: send valid Unicode", param) from None
