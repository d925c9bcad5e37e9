"""`POST /v1/completions`: a parsed request becomes one engine sequence per choice; their results come
back through `ChoiceSink`s (engine thread → event loop) and go out as one JSON body or as server-sent
events. Both paths run the same sinks, so a streamed completion's chunks concatenate to the text the
same request returns unstreamed.

Choice k = i·n + j is prompt i's j-th sample, drawn with seed `seed + j`: choice 0 of a request with a
seed is what `gonka-node checkpoint generate --seed` prints. Every body (and every chunk) names the
model that answered and carries its chain provenance in `gonka`; `system_fingerprint` is its sha256.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gonka_node.serve.engine import EngineStopped, Sequence
from gonka_node.serve.errors import ApiError, EngineFailure, GenerationTimeout
from gonka_node.serve.models import ModelRegistry, ServedModel
from gonka_node.serve.protocol import CompletionRequest
from gonka_node.serve.sampling import SamplingParams, TokenLogprobs
from gonka_node.serve.text import TextAssembler, token_text

if TYPE_CHECKING:
    from training.tokenizer import Tokenizer

Emitted = tuple[int, TokenLogprobs | None]


@dataclass
class ChoiceEvent:
    """What one choice produced since its last event (text, logprobs) and, last, how it ended."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None


class ChoiceSink:
    """Turns one sequence's tokens into text (their bytes through stop sequences and UTF-8) and hands
    events to the loop: every token when streaming, else once at the end. A token is reported (in
    `tokens`, `logprobs`) with its first byte, at that byte's character offset; a token with no bytes
    with the next byte released, or at the end."""

    def __init__(self, index: int, request: CompletionRequest, loop: asyncio.AbstractEventLoop,
                 queue: asyncio.Queue[ChoiceEvent], tokenizer: Tokenizer) -> None:
        self._assembler = TextAssembler(request.stop)
        self._tokenizer = tokenizer
        self._stream = request.stream
        self._loop, self._queue = loop, queue
        self._event = ChoiceEvent(index)
        self._unreleased: collections.deque[list[Emitted]] = collections.deque()  # per held byte: tokens it starts
        self._bare: list[Emitted] = []  # tokens without bytes, waiting for the next byte

    def on_token(self, token: int, logprobs: TokenLogprobs | None) -> bool:
        data = self._tokenizer.token_bytes(token)
        if not data:
            self._bare.append((token, logprobs))
        stopped = False
        for i, byte in enumerate(data):
            starts: list[Emitted] = []  # the tokens this byte reports when released
            if i == 0:
                starts, self._bare = [*self._bare, (token, logprobs)], []
            self._unreleased.append(starts)
            released = self._assembler.push(byte)
            self._take(released.text, released.offsets)
            if released.stopped:
                stopped = True
                break
        if self._stream and (self._event.tokens or self._event.text):
            self._send()
        return stopped

    def on_finish(self, reason: str) -> None:
        # Held bytes that no stop sequence completed are text; after a match nothing is held (its bytes,
        # still in `_unreleased`, are dropped with it).
        released = self._assembler.close()
        self._take(released.text, released.offsets)
        if not self._unreleased:  # tokens without bytes at the very end (not after a stop sequence)
            self._emit(self._bare, self._assembler.text_length)
        self._event.finish_reason = reason
        self._send()

    def on_error(self, error: BaseException) -> None:
        self._event.error = error
        self._send()

    def _take(self, text: str, offsets: tuple[int, ...]) -> None:
        self._event.text += text
        for offset in offsets:
            self._emit(self._unreleased.popleft(), offset)

    def _emit(self, tokens: list[Emitted], offset: int) -> None:
        event = self._event
        for token, logprobs in tokens:
            event.tokens.append(token)
            event.offsets.append(offset)
            if logprobs is not None:
                event.logprobs.append(logprobs)

    def _send(self) -> None:
        event, self._event = self._event, ChoiceEvent(self._event.index)
        with contextlib.suppress(RuntimeError):  # the loop is gone (server stopping): nobody to tell
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)


class Completion:
    """One request in flight: its sequences, and (once submitted) the model that answers it."""

    def __init__(self, request: CompletionRequest, loop: asyncio.AbstractEventLoop, tokenizer: Tokenizer) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        eot = tokenizer.eot_id
        self.sequences = [
            Sequence(
                [eot, *prompt], request.max_tokens,
                SamplingParams(temperature=request.temperature, top_p=request.top_p, seed=request.seed + j,
                               logprobs=request.logprobs),
                ChoiceSink(i * request.n + j, request, loop, self.queue, tokenizer), stop_token=eot,
            )
            for i, prompt in enumerate(request.prompts) for j in range(request.n)
        ]
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._served: ServedModel | None = None

    def submit(self, registry: ModelRegistry) -> Completion:
        """Queue every choice on the model the request names (ModelNotFound, QueueFull)."""
        self._served = registry.submit(self.request.model, self.sequences)
        return self

    @property
    def served(self) -> ServedModel:
        if self._served is None:
            raise RuntimeError("the completion was not submitted")
        return self._served

    async def events(self, timeout_s: float) -> AsyncIterator[ChoiceEvent]:
        """Every event until all choices have finished; GenerationTimeout past `timeout_s`."""
        open_choices = len(self.sequences)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while open_choices:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await self.queue.get()
            except TimeoutError:
                raise GenerationTimeout(
                    f"the completion did not finish within the server's {timeout_s:g} s limit; ask for fewer "
                    "max_tokens") from None
            if event.error is not None:
                raise _engine_error(event.error)
            open_choices -= event.finish_reason is not None
            yield event

    def cancel(self) -> None:
        for sequence in self.sequences:
            if not sequence.done:
                self.served.engine.cancel(sequence)

    def body(self, choices: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
        body = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.id,
                "system_fingerprint": self.served.provenance.sha256, "choices": choices,
                "gonka": self.served.provenance.field()}
        if usage:
            body["usage"] = self.usage()
        return body

    def usage(self) -> dict[str, int]:
        # The model reads the separator the server puts before each prompt: it counts as a prompt token.
        prompt = sum(len(p) + 1 for p in self.request.prompts)
        completion = sum(s.generated for s in self.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice_json(event: ChoiceEvent, with_logprobs: bool, tokenizer: Tokenizer) -> dict[str, Any]:
    return {"text": event.text, "index": event.index, "finish_reason": event.finish_reason,
            "logprobs": _logprobs_json(event, tokenizer) if with_logprobs else None}


def _logprobs_json(event: ChoiceEvent, tokenizer: Tokenizer) -> dict[str, Any]:
    def name(token: int) -> str:
        return token_text(tokenizer.token_bytes(token))

    top = [{name(t): lp for t, lp in (*entry.top, (token, entry.logprob))}
           for token, entry in zip(event.tokens, event.logprobs, strict=True)]
    return {"tokens": [name(t) for t in event.tokens], "token_logprobs": [e.logprob for e in event.logprobs],
            "top_logprobs": top, "text_offset": event.offsets}


def _engine_error(error: BaseException) -> ApiError:
    if isinstance(error, EngineStopped):
        return EngineFailure(f"the server stopped before the completion finished ({error})")
    return EngineFailure(f"generation failed on the server ({type(error).__name__}); retry, or report it")


async def respond(request: web.Request, completion: Completion, timeout_s: float) -> web.StreamResponse:
    try:
        if completion.request.stream:
            return await _stream(request, completion, timeout_s)
        return await _whole(completion, timeout_s)
    except ApiError as exc:
        exc.provenance = completion.served.provenance  # the error names the round that was answering
        raise
    finally:
        completion.cancel()  # a client gone, a timeout: free the batch slots now


async def _whole(completion: Completion, timeout_s: float) -> web.Response:
    merged = {i: ChoiceEvent(i) for i in range(len(completion.sequences))}
    async for event in completion.events(timeout_s):
        whole = merged[event.index]
        whole.text += event.text
        whole.tokens += event.tokens
        whole.logprobs += event.logprobs
        whole.offsets += event.offsets
        whole.finish_reason = event.finish_reason
    want_logprobs = completion.request.logprobs is not None
    choices = [choice_json(merged[i], want_logprobs, completion.tokenizer) for i in sorted(merged)]
    return web.json_response(completion.body(choices, usage=True), headers=completion.served.provenance.headers())


async def _stream(request: web.Request, completion: Completion, timeout_s: float) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **completion.served.provenance.headers()})
    await response.prepare(request)
    want_logprobs = completion.request.logprobs is not None
    try:
        async for event in completion.events(timeout_s):
            await _send(response, completion.body([choice_json(event, want_logprobs, completion.tokenizer)],
                                                  usage=False))
    except ApiError as exc:  # the status line is sent: the error goes in the stream, as OpenAI does
        await _send(response, {**exc.body(), "gonka": completion.served.provenance.field()})
        return response
    except ConnectionResetError:  # the client left; `respond` cancels its sequences
        return response
    if completion.request.include_usage:
        await _send(response, {**completion.body([], usage=False), "usage": completion.usage()})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")
