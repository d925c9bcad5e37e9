"""A recipe naming a prepared dataset and its tokenizer by hash: streamed windows and every refusal."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gonka_node.core.recipe import Recipe, RecipeError
from gonka_node.core.storage import LocalStore
from training.model import ModelConfig
from training.prepare import prepare
from training.tokenizer import HFTokenizer, train_bpe

DOCS = [f"record {i}: " + "alpha beta gamma delta " * (2 + i % 5) for i in range(400)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    root = tmp_path_factory.mktemp("ds")
    source = root / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tok = train_bpe(iter(DOCS), vocab_size=300)
    store = LocalStore(root / "dataset")
    _, digest = prepare([source], store, tok, local_root=store.root, heldout_fraction=0.1, unit_bytes=3000, workers=1)
    return store.root, digest, HFTokenizer(tok).sha256


def _recipe(corpus: Path | str, **fields: object) -> Recipe:
    model = dataclasses.replace(ModelConfig.preset("devnet"), vocab_size=300)
    return Recipe(model=model, corpus=str(corpus), seq_len=16, **fields)  # type: ignore[arg-type]


def test_a_dataset_recipe_streams_its_windows(dataset: tuple[Path, str, str], tmp_path: Path) -> None:
    root, digest, tok = dataset
    recipe = _recipe(root, tokenizer=tok).with_data_manifest()
    assert recipe.data_manifest_sha256 == digest and recipe.is_dataset()
    windows = recipe.windows(tmp_path / "cache")
    batch = windows.stack(windows.assignment(epoch_seed=0, round_index=0, slot=0, max_slots=2, windows_per_host=4))
    assert tuple(batch.shape) == (4, 17) and int(batch.max()) < 300
    assert list((tmp_path / "cache" / "shards").glob("*.tok"))  # fetched into the cache, not held whole
    assert recipe.load_tokenizer().sha256 == tok
    assert Recipe.from_dict(json.loads(recipe.canonical_json())) == recipe


def test_the_manifest_hash_must_match(dataset: tuple[Path, str, str]) -> None:
    root, _, tok = dataset
    with pytest.raises(RecipeError, match="this store holds another dataset"):
        _recipe(root, tokenizer=tok, data_manifest_sha256="1" * 64).windows()


def test_the_tokenizer_must_be_the_datasets(dataset: tuple[Path, str, str], tmp_path: Path) -> None:
    root, digest, tok = dataset
    with pytest.raises(RecipeError, match="the dataset was tokenized with"):
        _recipe(root, tokenizer="2" * 64, data_manifest_sha256=digest).windows(tmp_path)
    with pytest.raises(RecipeError, match="the dataset was tokenized with"):
        _recipe(root, data_manifest_sha256=digest).windows(tmp_path)  # bytes named, BPE in the dataset
    with pytest.raises(RecipeError, match="needs a prepared dataset"):
        _recipe("builtin", tokenizer=tok)


def test_a_swapped_tokenizer_file_is_refused(dataset: tuple[Path, str, str], tmp_path: Path) -> None:
    root, _, tok = dataset
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in root.rglob("*"):
        if path.is_file():
            (copy / path.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(root)).write_bytes(path.read_bytes())
    (copy / "tokenizer.json").write_bytes(train_bpe(iter(DOCS[:50]), vocab_size=280))
    with pytest.raises(RecipeError, match=f"the recipe names {tok}"):
        _recipe(copy, tokenizer=tok).load_tokenizer()


def test_the_model_vocabulary_must_hold_the_tokenizers(dataset: tuple[Path, str, str], tmp_path: Path) -> None:
    root, digest, tok = dataset
    small = dataclasses.replace(_recipe(root, tokenizer=tok, data_manifest_sha256=digest),
                                model=ModelConfig.preset("devnet"))
    with pytest.raises(RecipeError, match=r"model\.vocab_size: 256 is smaller than the tokenizer's 300"):
        small.windows(tmp_path)


def test_new_fields_keep_old_recipe_hashes() -> None:
    recipe = Recipe(model=ModelConfig.preset("devnet"))
    body = json.loads(recipe.canonical_json())
    assert "tokenizer" not in body and "assignment_seed" not in body
    later = dataclasses.replace(recipe, assignment_seed="signin-block")
    assert json.loads(later.canonical_json())["assignment_seed"] == "signin-block"
    assert later.sha256() != recipe.sha256()
    with pytest.raises(RecipeError, match="assignment_seed"):
        dataclasses.replace(recipe, assignment_seed="tomorrow")
