"""The top-k challenge's settings: the recipe's sample (hashed only when not at its defaults, so earlier
epochs keep their model spec hash), the aggregator's opening deadline, and what governance refuses
because the opening is not built for it (a sharded top-k epoch with replays), and what it takes since
it is (an overlapped one)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from chain.types import EpochInfo
from gonka_node.aggregator.challenges import max_body_bytes
from gonka_node.core.config import AggregationSettings, ConfigError
from gonka_node.core.opening import encode_body
from gonka_node.core.recipe import Recipe, RecipeError
from gonka_node.epoch_setup import EpochTerms, aggregator_context, check_openable, epoch_spec
from gonka_node.spec_builder import _check_replayable, build_spec
from training.model import ModelConfig
from training.residual_commit import ChunkLayout, open_chunks

TOPK = Recipe(model=ModelConfig.preset("tiny"), codec="topk", round_state="fresh")


def test_the_sample_is_part_of_the_recipe_hash_only_off_its_defaults() -> None:
    plain = Recipe(model=ModelConfig.preset("tiny"))
    assert b"residual_sample" not in plain.canonical_json()
    assert (plain.residual_sample, plain.residual_sample_min) == (0.01, 1_048_576)
    wider = replace(plain, residual_sample=0.05)
    assert b'"residual_sample":0.05' in wider.canonical_json() and wider.sha256() != plain.sha256()
    fewer = replace(plain, residual_sample_min=4096)
    assert b'"residual_sample_min":4096' in fewer.canonical_json() and fewer.sha256() not in (plain.sha256(),
                                                                                               wider.sha256())
    assert Recipe.from_dict(fewer.to_dict()) == fewer


@pytest.mark.parametrize(("change", "message"), [
    ({"residual_sample": 0.0}, "residual_sample: must be a fraction in (0, 1], got 0.0"),
    ({"residual_sample": 1.5}, "residual_sample: must be a fraction in (0, 1], got 1.5"),
    ({"residual_sample_min": 0}, "residual_sample_min: must be a positive integer, got 0"),
    ({"residual_sample_min": 2.5}, "residual_sample_min: must be a positive integer, got 2.5"),
])
def test_a_sample_out_of_range_is_refused_in_one_line(change: dict[str, float], message: str) -> None:
    with pytest.raises(RecipeError) as info:
        replace(TOPK, **change)
    assert str(info.value) == message


def test_the_opening_deadline_is_positive() -> None:
    assert AggregationSettings().opening_timeout_s == 120.0
    with pytest.raises(ConfigError, match=r"^\[aggregation\] opening_timeout_s must be in \(0, 1e6\) seconds, got 0"):
        AggregationSettings(opening_timeout_s=0)


def test_governance_refuses_a_replayed_sharded_top_k_epoch_the_opening_does_not_cover() -> None:
    recipe = replace(TOPK, shards=2)
    with pytest.raises(RecipeError) as info:
        build_spec(recipe, EpochTerms(aggregators=["0x" + "11" * 20], replay_probability=0.5), "preset:tiny")
    assert str(info.value).startswith("shards: a top-k epoch with replay probability 0.5 needs shards = 1 ")
    assert "\n" not in str(info.value)
    _check_replayable(recipe, 0.0)  # no replays: nothing is opened, nothing refused
    _check_replayable(replace(recipe, codec="int8"), 0.5)  # a dense codec keeps the dense replay


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_a_replayed_overlapped_top_k_epoch_is_served(overlap: str) -> None:
    """An overlapped host answers round r's challenge from the state it kept with round r while it trains
    r + 1 (tests/gonka_node/test_host_eager.py runs such epochs at p = 1): governance's check and the
    aggregator's take it."""
    recipe = replace(TOPK, overlap=overlap)
    _check_replayable(recipe, 0.5)
    check_openable(recipe, 0.5)
    with pytest.raises(RecipeError, match=r"^shards: a top-k epoch with replay probability 0.5 needs shards = 1"):
        check_openable(replace(recipe, shards=2), 0.5)


def test_an_aggregator_refuses_such_an_epoch_too(tmp_path: Path) -> None:
    """An epoch scheduled without governance's builder: the aggregator's dense replay would fail (and
    slash) every honest top-k host, so it refuses to serve it, before it loads anything."""
    recipe = replace(TOPK, shards=2, data_manifest_sha256="ab" * 32)
    spec = epoch_spec(recipe, b"\x01" * 32, EpochTerms(aggregators=["0x" + "11" * 20], replay_probability=0.25),
                      "preset:tiny")
    info = EpochInfo(0, 0, 0, 0, 0, 0, 0, epoch=1, spec=spec, ended=False)
    with pytest.raises(RecipeError, match=r"^shards: a top-k epoch with replay probability 0.25 needs shards = 1"):
        aggregator_context(recipe, info, chain_id=1, registry="0x" + "22" * 20, init_path=tmp_path / "init.st")
    assert not (tmp_path / "init.st").exists()


@pytest.mark.parametrize(("n_chunks", "depth"), [(1, 0), (5, 3), (9, 4), (12, 4)])
def test_an_openings_size_bound_counts_each_path_at_the_trees_depth_and_covers_a_real_opening(
    n_chunks: int, depth: int
) -> None:
    """Per chunk: two 11-byte bounds (the chunk's tag and length), then for each residual an 11-byte bound,
    its fp32 values and `depth` path steps of a tag, a side byte and a 32-byte hash. A tree of n leaves
    is ⌈log2 n⌉ deep: 1 leaf, 0; 5, 3; 9 and 12, 4."""
    layout = ChunkLayout.of({"w": (4 * n_chunks - 1,)}, chunk=4)  # the last chunk is shorter
    assert layout.n_chunks == n_chunks
    chunks = tuple(range(0, n_chunks, 2))
    assert max_body_bytes(layout, chunks) == sum(22 + 2 * (11 + 4 * layout.chunk_len(i) + 34 * depth) for i in chunks)
    g = torch.Generator().manual_seed(n_chunks)
    previous, current = ({"w": torch.randn(4 * n_chunks - 1, generator=g)} for _ in range(2))
    body = encode_body(open_chunks(previous, layout, chunks), open_chunks(current, layout, chunks))
    assert len(body) <= max_body_bytes(layout, chunks)
