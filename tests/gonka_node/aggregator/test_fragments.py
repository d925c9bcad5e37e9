"""Fragment plans and the Merkle root over fragment hashes (docs/PROTOCOL.md "Sharded aggregators")."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from gonka_node.aggregator.validate import Sketcher, count_sketch
from gonka_node.core.fragments import (
    FragmentError,
    fragment_leaf,
    fragment_proof,
    fragment_root,
    global_offsets,
    merged_header,
    model_root,
    plan_fragments,
    verify_fragment,
    verify_fragment_tensors,
)
from training.checkpoint import canonical_sha256
from training.model import Llama, ModelConfig


def llama_spec(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}


def test_plan_covers_every_tensor_once_and_balances_by_size() -> None:
    spec = llama_spec(ModelConfig.preset("1b"))
    plan = plan_fragments(spec, 4)
    names = [n for f in plan for n in f.names]
    assert sorted(names) == sorted(spec) and len(names) == len(spec)
    assert all(list(f.names) == sorted(f.names) for f in plan)
    mean = sum(f.numel for f in plan) / 4
    biggest = max(torch.Size(s).numel() for s in spec.values())
    assert max(f.numel for f in plan) - mean <= biggest
    assert max(f.numel for f in plan) / mean < 1.05


def test_plan_is_a_pure_function_and_greedy_by_size() -> None:
    spec = {"a": (10,), "b": (7,), "c": (5,), "d": (4,), "e": (4,)}
    plan = plan_fragments(spec, 2)
    assert plan == plan_fragments(dict(reversed(list(spec.items()))), 2)
    # a(10)→0, b(7)→1, c(5)→1 (12), d(4)→0 (14), e(4)→1 (16)
    assert [f.names for f in plan] == [("a", "d"), ("b", "c", "e")]
    assert [f.numel for f in plan] == [14, 16]
    assert plan[1].spec(spec) == {"b": (7,), "c": (5,), "e": (4,)}


def test_plan_refuses_impossible_shard_counts() -> None:
    with pytest.raises(FragmentError):
        plan_fragments({"a": (1,)}, 2)
    with pytest.raises(FragmentError):
        plan_fragments({"a": (1,)}, 0)


def hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(n)]


def test_one_fragment_root_is_the_canonical_hash() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 4, generator=gen)}
    sha = bytes.fromhex(canonical_sha256(tensors))
    assert fragment_root([sha]) == sha
    assert verify_fragment(sha, 0, 1, [], sha)


def test_root_by_hand_for_three_fragments() -> None:
    h = hashes(3)
    leaves = [fragment_leaf(i, 3, h[i]) for i in range(3)]
    assert leaves[0] == hashlib.sha256(b"gonka-fragment-v1\n" + (0).to_bytes(4, "little") + (3).to_bytes(4, "little") + h[0]).digest()
    left = hashlib.sha256(b"\x01" + leaves[0] + leaves[1]).digest()
    assert fragment_root(h) == hashlib.sha256(b"\x01" + left + leaves[2]).digest()


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8])
def test_each_fragment_verifies_alone_and_nothing_else_does(n: int) -> None:
    h = hashes(n)
    root = fragment_root(h)
    for i in range(n):
        proof = fragment_proof(h, i)
        assert len(proof) <= (n - 1).bit_length()
        assert verify_fragment(h[i], i, n, proof, root)
        assert not verify_fragment(h[(i + 1) % n], i, n, proof, root)  # another fragment's hash
        assert not verify_fragment(h[i], (i + 1) % n, n, proof, root)  # at another index
        assert not verify_fragment(h[i], i, n, [*proof, bytes(32)], root)  # a proof too long
        if proof:
            assert not verify_fragment(h[i], i, n, proof[:-1], root)  # too short
    assert fragment_root([*h[:-1], bytes(32)]) != root  # every fragment is covered


def test_fragment_sketches_at_global_offsets_sum_to_the_whole_sketch() -> None:
    """What lets one verifier run the sketch checks on every host of a sharded round."""
    spec = llama_spec(ModelConfig.preset("tiny"))
    gen = torch.Generator().manual_seed(1)
    update = {n: torch.randn(s, generator=gen) for n, s in spec.items()}
    offsets = global_offsets(spec)
    total = torch.zeros(4096, dtype=torch.float64)
    for fragment in plan_fragments(spec, 3):
        sketcher = Sketcher()
        for name in fragment.names:
            sketcher.add_at(offsets[name], update[name])
        total += sketcher.result().double()
    whole = count_sketch(update).double()
    assert torch.allclose(total, whole, rtol=1e-5, atol=1e-5)
    assert float(whole.norm()) > 100.0  # not trivially: the sketch is far from zero


def test_a_whole_models_root_and_one_fragment_checked_alone() -> None:
    g = torch.Generator().manual_seed(3)
    model = {n: torch.randn(k, generator=g) for n, k in (("a", 7), ("b", 5), ("c", 3), ("d", 2))}
    assert model_root(model, 1) == bytes.fromhex(canonical_sha256(model))
    plan = plan_fragments({n: tuple(t.shape) for n, t in model.items()}, 3)
    hashes = [bytes.fromhex(canonical_sha256({n: model[n] for n in f.names})) for f in plan]
    root = model_root(model, 3)
    assert root == fragment_root(hashes)
    for f in plan:
        part = {n: model[n] for n in f.names}
        assert verify_fragment_tensors(part, f.index, 3, fragment_proof(hashes, f.index), root)
        changed = {n: t + 1 for n, t in part.items()}
        assert not verify_fragment_tensors(changed, f.index, 3, fragment_proof(hashes, f.index), root)


def test_merged_header_lays_the_fragments_files_end_to_end_as_one_safetensors_file() -> None:
    from safetensors.torch import load, save

    g = torch.Generator().manual_seed(3)
    whole = {"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
             "c": torch.randn(2, generator=g).to(torch.bfloat16)}
    parts = [save({"b": whole["b"]}, metadata={"round": "4", "fragment": "0/2", "gonka.sha256": "x"}),
             save({"a": whole["a"], "c": whole["c"]}, metadata={"round": "4", "fragment": "1/2"})]

    def header(data: bytes) -> tuple[dict[str, object], int]:
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8 : 8 + n]), 8 + n

    headers = [header(p) for p in parts]
    head = merged_header([(h, len(p) - size) for p, (h, size) in zip(parts, headers, strict=True)])
    merged = head + b"".join(p[size:] for p, (_, size) in zip(parts, headers, strict=True))
    back = load(merged)
    assert set(back) == set(whole) and all(torch.equal(back[n], whole[n]) for n in whole)
    assert len(head) % 8 == 0 and header(merged)[0]["__metadata__"] == {"round": "4"}
    with pytest.raises(FragmentError, match="tensor 'b' is in two fragments"):
        merged_header([headers[0], headers[0]])
