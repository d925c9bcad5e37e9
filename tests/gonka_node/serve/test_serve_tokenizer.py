"""Serving and `checkpoint generate` with the epoch recipe's BPE tokenizer: an epoch whose recipe names a
prepared dataset and a byte-level BPE trained here (real files), published on chain, served from a TLS
aggregator the chain names. Both decode the model's ids exactly as `tokenizer.decode` does."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serve_world import TINY, ServeWorld, build_world, serve
from test_serve_api import post

from gonka_node.cli import main
from gonka_node.cli.checkpoint_load import terminal_safe
from gonka_node.core.recipe import Recipe
from gonka_node.core.storage import LocalStore
from gonka_node.serve.server import ModelServerHandle
from gonka_node.serve.text import token_text
from training.generate import SamplingConfig, generate_tokens
from training.model import build_model
from training.prepare import prepare
from training.tokenizer import END_OF_TEXT, HFTokenizer, train_bpe

DOCS = [f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(300)]
BPE_MODEL = dataclasses.replace(TINY, vocab_size=320)
MODEL = "gonka-epoch-1-round-1"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, HFTokenizer]:
    """(dataset folder, tokenizer.json, tokenizer): a BPE of 300 tokens and a dataset prepared with it."""
    root = tmp_path_factory.mktemp("bpe")
    data = train_bpe(iter(DOCS), vocab_size=300)
    (root / "tokenizer.json").write_bytes(data)
    source = root / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    store = LocalStore(root / "dataset")
    prepare([source], store, data, local_root=store.root, heldout_fraction=0.1, unit_bytes=4000, workers=1)
    return store.root, root / "tokenizer.json", HFTokenizer(data)


@pytest.fixture(scope="module")
def bpe_world(bpe: tuple[Path, Path, HFTokenizer], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeWorld]:
    dataset, _, tok = bpe
    recipe = Recipe(model=BPE_MODEL, corpus=str(dataset), tokenizer=tok.sha256, seq_len=32).with_data_manifest()
    world = build_world(tmp_path_factory.mktemp("bpe-world"), rounds=1, recipe=recipe)
    yield world
    world.close()


@pytest.fixture(scope="module")
def bpe_server(bpe_world: ServeWorld, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerHandle]:
    handle = serve(bpe_world, tmp_path_factory.mktemp("bpe-cache"), round_="1")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(bpe_server: ModelServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=bpe_server.url, api_key="unused", max_retries=0)


def drawn(tok: HFTokenizer, prompt: str, temperature: float, seed: int, max_tokens: int = 40) -> list[int]:
    """Round 1's ids for `prompt`, as the server and `checkpoint generate` must draw them (without the
    end-of-text token that stops them)."""
    ids = generate_tokens(build_model(BPE_MODEL, seed=1), [tok.eot_id, *tok.encode(prompt)], SamplingConfig(
        max_new_tokens=max_tokens, temperature=temperature, seed=seed, stop_token=tok.eot_id))
    return ids[:-1] if ids and ids[-1] == tok.eot_id else ids


def test_a_completion_decodes_as_the_tokenizer_does(bpe: tuple[Path, Path, HFTokenizer], client: openai.OpenAI):
    tok = bpe[2]
    for temperature, seed in ((0.9, 7), (0.0, 0), (1.0, 3)):
        ids = drawn(tok, "def f", temperature, seed)
        answer = client.completions.create(model=MODEL, prompt="def f", max_tokens=40, temperature=temperature,
                                           seed=seed, logprobs=1)
        choice = answer.choices[0]
        assert choice.text == tok.decode(ids)
        assert choice.logprobs.tokens == [token_text(tok.token_bytes(t)) for t in ids]
        assert answer.usage.prompt_tokens == 1 + len(tok.encode("def f"))  # the separator, then BPE tokens
        assert answer.usage.completion_tokens == len(ids) + (choice.finish_reason == "stop")
    assert len(tok.encode("def f")) < len(b"def f")  # merges: these are not byte tokens


def test_streamed_text_and_token_prompts_match(bpe: tuple[Path, Path, HFTokenizer], client: openai.OpenAI):
    tok = bpe[2]
    whole = client.completions.create(model=MODEL, prompt="return x", max_tokens=40, seed=5)
    chunks = client.completions.create(model=MODEL, prompt="return x", max_tokens=40, seed=5, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == tok.decode(drawn(tok, "return x", 1.0, 5))
    as_ids = client.completions.create(model=MODEL, prompt=tok.encode("return x"), max_tokens=40, seed=5)
    assert as_ids.choices[0].text == whole.choices[0].text


def test_stop_sequences_cut_the_tokens_bytes(bpe: tuple[Path, Path, HFTokenizer], client: openai.OpenAI):
    tok = bpe[2]
    ids = drawn(tok, "def f", 1.0, 11, max_tokens=60)
    generated = b"".join(tok.token_bytes(t) for t in ids)
    at = next(i for i, b in enumerate(generated) if 0x21 <= b < 0x7F and i > 3)
    stop = chr(generated[at])
    cut = client.completions.create(model=MODEL, prompt="def f", max_tokens=60, seed=11, stop=stop).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == generated[: generated.find(stop.encode())].decode("utf-8", "replace")


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (f"a {END_OF_TEXT} b", "'<|endoftext|>' (token 0), the document separator"),
        ([5, 300], "prompt token 300 is not in this model's tokenizer (ids 0..299)"),
        ([7, 0], "the document separator"),
    ],
)
def test_prompts_the_tokenizer_cannot_take_are_400(bpe_server: ModelServerHandle, prompt: object, words: str):
    status, answer, _ = post(bpe_server.url + "/completions", json.dumps({"model": MODEL, "prompt": prompt}).encode())
    assert status == 400 and answer["error"]["param"] == "prompt" and words in answer["error"]["message"]


def test_checkpoint_generate_prints_the_servers_text(bpe: tuple[Path, Path, HFTokenizer], bpe_world: ServeWorld,
                                                      client: openai.OpenAI, capsys: pytest.CaptureFixture[str]):
    tok = bpe[2]
    args = ["checkpoint", "generate", "--deployment", str(bpe_world.deployment), "--checkpoint",
            str(bpe_world.files[1]), "--epoch", "1", "--round", "1", "--prompt", "def f", "--max-new-tokens", "40",
            "--temperature", "0.9", "--seed", "7"]
    assert main(args) == 0  # the tokenizer from the recipe on chain, read from its dataset
    printed = capsys.readouterr().out
    answer = client.completions.create(model=MODEL, prompt="def f", max_tokens=40, temperature=0.9, seed=7)
    assert printed == "def f" + terminal_safe(tok.decode(drawn(tok, "def f", 0.9, 7))) + "\n"
    assert printed == "def f" + terminal_safe(answer.choices[0].text) + "\n"
    assert main([*args, "--tokenizer", str(bpe[1])]) == 0  # the same file, named: the same text
    assert capsys.readouterr().out == printed


def test_a_tokenizer_file_with_another_hash_is_refused(bpe: tuple[Path, Path, HFTokenizer], bpe_world: ServeWorld,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    other = tmp_path / "other.json"
    other.write_bytes(train_bpe(iter(DOCS), vocab_size=290))
    code = main(["checkpoint", "generate", "--deployment", str(bpe_world.deployment), "--checkpoint",
                 str(bpe_world.files[1]), "--epoch", "1", "--round", "1", "--tokenizer", str(other)])
    assert code != 0 and "differs from the recipe's tokenizer" in capsys.readouterr().err
    with pytest.raises(Exception, match="differs from the recipe's tokenizer"):
        serve(bpe_world, tmp_path / "cache", round_="1", tokenizer=other)


def test_checkpoint_export_ships_the_recipes_tokenizer(bpe: tuple[Path, Path, HFTokenizer], bpe_world: ServeWorld,
                                                      tmp_path: Path):
    assert main(["checkpoint", "export", "--deployment", str(bpe_world.deployment), "--checkpoint",
                 str(bpe_world.files[1]), "--epoch", "1", "--round", "1", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == bpe[1].read_bytes()
