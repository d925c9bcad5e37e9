"""The OpenAI API of `gonka-node serve`, through the official `openai` client, against a server on
127.0.0.1 port 0 that pulled round 2 of a real chain's epoch from a TLS aggregator the chain names."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from eth_account import Account
from serve_world import TINY, ServeWorld, serve

from chain.backends import RpcBackend
from chain.client import ChainClient
from chain.types import Deployment
from gonka_node.cli import main
from gonka_node.cli.checkpoint_load import terminal_safe
from gonka_node.serve.protocol import Limits
from gonka_node.serve.server import ModelServerHandle
from training.generate import SamplingConfig, generate_tokens
from training.model import build_model

MODEL = "gonka-epoch-1-round-2"
LONG = {"prompt": "while True:", "temperature": 0, "max_tokens": 200}  # greedy: runs to max_tokens here


@pytest.fixture(scope="module")
def client(server: ModelServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def chain_sha(world: ServeWorld, round_: int) -> str:
    chain = ChainClient(RpcBackend(world.rpc_url), Account.create(), Deployment.load(world.deployment)).connect()
    return chain.round_result(world.epoch, round_).checkpoint_sha256.hex()


def test_models_name_epoch_round_and_the_chain_hash(world: ServeWorld, client: openai.OpenAI):
    raw = client.models.with_raw_response.list()
    models = raw.parse().data
    assert [m.id for m in models] == [MODEL]
    gonka = models[0].model_extra["gonka"]
    assert (gonka["epoch"], gonka["round"], gonka["checkpoint_sha256"]) == (1, 2, chain_sha(world, 2))
    assert raw.headers["x-gonka-checkpoint-sha256"] == chain_sha(world, 2)
    assert client.models.retrieve("gonka-epoch-1").id == MODEL  # the epoch's alias: the newest round


def test_completion_equals_checkpoint_generate(world: ServeWorld, client: openai.OpenAI, capsys):
    for temperature, seed in ((0.8, 7), (0.0, 0)):
        code = main(["checkpoint", "generate", "--deployment", str(world.deployment), "--checkpoint",
                     str(world.files[2]), "--epoch", "1", "--round", "2", "--prompt", "def ", "--max-new-tokens",
                     "90", "--temperature", str(temperature), "--seed", str(seed)])
        printed = capsys.readouterr().out
        assert code == 0
        answer = client.completions.create(model=MODEL, prompt="def ", max_tokens=90, temperature=temperature,
                                           seed=seed)
        assert printed == "def " + terminal_safe(answer.choices[0].text) + "\n"
        drawn = generate_tokens(build_model(TINY, seed=2), [0, *b"def "], SamplingConfig(
            max_new_tokens=90, temperature=temperature, seed=seed, stop_token=0))  # round 2's weights
        assert answer.usage.completion_tokens == len(drawn)
        assert answer.choices[0].finish_reason == ("stop" if drawn[-1] == 0 else "length")


def test_the_same_seed_gives_the_same_text_and_n_draws_seed_plus_j(client: openai.OpenAI):
    def text(seed: int, n: int = 1) -> list[str]:
        answer = client.completions.create(model=MODEL, prompt="x = ", max_tokens=30, seed=seed, n=n)
        return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]

    assert text(5) == text(5) != text(6)
    assert text(5, n=2) == [*text(5), *text(6)]


def test_streamed_chunks_concatenate_to_the_whole_text(client: openai.OpenAI):
    asked: dict[str, Any] = {"model": MODEL, "prompt": ["def ", "import "], "max_tokens": 150, "seed": 11, "n": 2,
                             "logprobs": 1, "stop": ["e", "\n"]}
    whole = client.completions.create(**asked)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        assert chunk.model == MODEL and chunk.model_extra["gonka"]["round"] == 2
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    by_index = {c.index: c for c in whole.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert texts == {i: c.text for i, c in by_index.items()}
    assert tokens == {i: c.logprobs.tokens for i, c in by_index.items()}
    assert finish == {i: c.finish_reason for i, c in by_index.items()}
    for choice in whole.choices:  # a stop sequence ends the text before it; none appears in it
        assert "e" not in choice.text and "\n" not in choice.text


def _bytes(tokens: list[str]) -> bytes:
    return bytes(int(t[-2:], 16) if t.startswith("bytes:\\x") else ord(t) for t in tokens)


def test_a_stop_sequence_cuts_the_text_before_it(client: openai.OpenAI):
    free = client.completions.create(model=MODEL, prompt="def ", max_tokens=120, seed=3, logprobs=0).choices[0]
    generated = _bytes(free.logprobs.tokens)
    assert generated.decode("utf-8", "replace") == free.text
    ascii_at = next(i for i, b in enumerate(generated) if 0x21 <= b < 0x7F and i > 5)
    stop = chr(generated[ascii_at]) + chr(generated[ascii_at + 1]) if generated[ascii_at + 1] < 0x80 else chr(
        generated[ascii_at])
    cut = client.completions.create(model=MODEL, prompt="def ", max_tokens=120, seed=3, stop=stop).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == generated[: generated.find(stop.encode())].decode("utf-8", "replace")


def test_logprobs_are_the_models(client: openai.OpenAI):
    choice = client.completions.create(model=MODEL, prompt="a", max_tokens=5, temperature=0, logprobs=3).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for token, chosen, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert top[token] == chosen == max(top.values())  # greedy picks the most likely token
        assert len(top) == 3 and chosen < 0


def test_sha256_header_and_field_equal_the_chain(world: ServeWorld, client: openai.OpenAI):
    raw = client.completions.with_raw_response.create(model="gonka-epoch-1", prompt="hi", max_tokens=3)
    answer = raw.parse()
    expected = chain_sha(world, 2)
    assert raw.headers["x-gonka-checkpoint-sha256"] == expected == answer.system_fingerprint
    assert (raw.headers["x-gonka-epoch"], raw.headers["x-gonka-round"]) == ("1", "2")
    assert answer.model_extra["gonka"]["checkpoint_sha256"] == expected and answer.model == MODEL


@pytest.mark.parametrize(
    ("fields", "param", "code", "words"),
    [
        ({"model": "gpt-4"}, "model", "model_not_found", "The model 'gpt-4' does not exist"),
        ({"max_tokens": -1}, "max_tokens", None, "max_tokens must be between 0 and 1024, got -1"),
        ({"prompt": "x" * 8193}, "prompt", "context_length_exceeded", "8193 tokens long"),
        ({"prompt": "ok \ud800"}, "prompt", None, "lone surrogate"),
        ({"prompt": "a\u0000b"}, "prompt", None, "document separator"),
        ({"prompt": [104, 300]}, "prompt", None, "prompt token 300 is not in this model's tokenizer (ids 0..255)"),
        ({"temperature": 2.5}, "temperature", None, "temperature must be between 0.0 and 2.0"),
        ({"top_p": 0}, "top_p", None, "top_p must be greater than 0"),
        ({"n": 9}, "n", None, "n must be between 1 and 8"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None, "at most 4"),
        ({"logprobs": 6}, "logprobs", None, "logprobs must be between 0 and 5"),
        ({"echo": True}, "echo", None, "is not supported"),
        ({"frobnicate": 1}, "frobnicate", None, "Unrecognized request argument supplied: frobnicate"),
    ],
)
def test_bad_requests_get_the_api_error_shape(server: ModelServerHandle, fields, param, code, words):
    body = {"model": MODEL, "prompt": "hello", **fields}
    status, answer, headers = post(server.url + "/completions", json.dumps(body).encode())
    assert status == (404 if code == "model_not_found" else 400)
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["code"] == code
    assert answer["error"]["type"] == "invalid_request_error" and words in answer["error"]["message"]
    assert headers["X-Gonka-Checkpoint-Sha256"] == answer["gonka"]["checkpoint_sha256"]


def test_the_openai_client_raises_its_own_errors(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gonka-epoch-1-round-9", prompt="x")
    assert missing.value.code == "model_not_found" and "gonka-epoch-1-round-2" in missing.value.message
    with pytest.raises(openai.BadRequestError) as negative:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
    assert negative.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="y" * 9000)
    assert long.value.code == "context_length_exceeded"


def post(url: str, data: bytes) -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_bodies_routes_and_sizes(server: ModelServerHandle):
    status, answer, _ = post(server.url + "/completions", b"{not json")
    assert (status, answer["error"]["message"]) == (400, "the request body is not valid JSON (UTF-8)")
    status, answer, _ = post(server.url + "/completions", b'{"model": "x", "prompt": "\xff"}')
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer, _ = post(server.url + "/completions", b"[1, 2]")
    assert (status, answer["error"]["message"]) == (400, "the request body must be a JSON object")
    status, answer, _ = post(server.url + "/completions", b" " * (1 << 20) + b"{}")
    assert (status, answer["error"]["code"]) == (413, "request_too_large")
    status, answer, _ = post(server.url + "/chat/completions", b"{}")
    assert (status, answer["error"]["code"]) == (404, "unknown_url")


def test_zero_max_tokens_and_token_prompts(client: openai.OpenAI):
    empty = client.completions.create(model=MODEL, prompt="abc", max_tokens=0).choices[0]
    assert (empty.text, empty.finish_reason) == ("", "length")
    as_text = client.completions.create(model=MODEL, prompt="hé", max_tokens=20, seed=1).choices[0].text
    as_tokens = client.completions.create(model=MODEL, prompt=list("hé".encode()), max_tokens=20, seed=1)
    assert as_tokens.choices[0].text == as_text and as_tokens.usage.prompt_tokens == 4  # separator + 3 bytes


async def _flood(url: str, count: int) -> list[tuple[int, dict[str, Any]]]:
    async with aiohttp.ClientSession() as session:
        async def one() -> tuple[int, dict[str, Any]]:
            async with session.post(url + "/completions", json={"model": MODEL, **LONG}) as response:
                return response.status, await response.json()

        return await asyncio.gather(*(one() for _ in range(count)))


def test_a_full_queue_answers_429(world: ServeWorld, client: openai.OpenAI, tmp_path: Path):
    assert client.completions.create(model=MODEL, **LONG).choices[0].finish_reason == "length"
    small = serve(world, tmp_path, round_="2", max_batch=1, max_waiting=1, limits=Limits(max_choices=1))
    try:
        results = asyncio.run(_flood(small.url, 8))
    finally:
        small.stop()
    refused = [body for status, body in results if status == 429]
    assert refused and all(body["error"]["code"] == "rate_limit_exceeded" for body in refused)
    served = [body for status, body in results if status == 200]
    # One request runs and one waits (or both wait, when all arrive before the engine admits one).
    assert len(served) + len(refused) == 8 and 1 <= len(served) <= 2
    assert all(body["choices"][0]["finish_reason"] == "length" for body in served)


def test_a_completion_past_the_timeout_is_cancelled(world: ServeWorld, tmp_path: Path):
    slow = serve(world, tmp_path, round_="2", request_timeout_s=0.05)
    try:
        status, answer, headers = post(slow.url + "/completions", json.dumps({"model": MODEL, **LONG}).encode())
        assert (status, answer["error"]["code"]) == (504, "timeout")
        assert answer["gonka"]["round"] == 2 and headers["X-Gonka-Checkpoint-Sha256"] == world.shas[2]
        engine = slow.served()[0].engine
        deadline = time.monotonic() + 5.0
        while engine.load() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.load() == (0, 0)  # its sequence left the batch at the engine's next step
        assert engine.steps < LONG["max_tokens"]  # one token per step: it never finished
        steps = engine.steps
        time.sleep(0.1)
        assert engine.steps == steps  # and nothing runs any more
    finally:
        slow.stop()


async def _leave_midway(url: str) -> None:
    """Start a long stream, read its first chunk, hang up."""
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, **LONG, "stream": True}
        async with session.post(url + "/completions", json=body) as response:
            assert response.status == 200
            first = await response.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")


def test_a_client_that_hangs_up_frees_its_slot(world: ServeWorld, tmp_path: Path):
    handle = serve(world, tmp_path, round_="2", max_batch=1, max_waiting=1, limits=Limits(max_choices=1))
    try:
        engine = handle.served()[0].engine
        asyncio.run(_leave_midway(handle.url))
        deadline = time.monotonic() + 10.0
        while engine.load() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.load() == (0, 0)
        assert engine.steps < LONG["max_tokens"]  # one token per step: it left before it could finish
        client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="a", max_tokens=3).choices[0].finish_reason
    finally:
        handle.stop()
