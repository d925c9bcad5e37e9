"""One fragment's proof under the Merkle-of-fragments root (core/fragments.py `FragmentProof`): built from
the S leaf hashes, it verifies against the root computed the existing way (`model_root`, the hash the
shards record on chain), and nothing else does: another fragment's tensors, another index or count, one
flipped bit in any sibling, a malformed proof."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gonka_node.core.fragments import (
    FragmentError,
    FragmentProof,
    model_root,
    plan_fragments,
    verify_fragment,
)
from training.checkpoint import canonical_sha256


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(k, generator=g) for n, k in (("a", 9), ("b", 7), ("c", 6), ("d", 4), ("e", 3), ("f", 2))}


def fragment_hashes(tensors: dict[str, torch.Tensor], shards: int) -> list[bytes]:
    plan = plan_fragments({n: tuple(t.shape) for n, t in tensors.items()}, shards)
    return [bytes.fromhex(canonical_sha256({n: tensors[n] for n in f.names})) for f in plan]


def flipped(h: bytes) -> bytes:
    return bytes([h[0] ^ 1]) + h[1:]


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
def test_every_fragments_proof_leads_to_the_models_root(shards: int) -> None:
    tensors = model()
    root = model_root(tensors, shards)
    hashes = fragment_hashes(tensors, shards)
    for k in range(shards):
        proof = FragmentProof.of(hashes, k)
        assert (proof.index, proof.count, proof.fragment_sha256) == (k, shards, hashes[k])
        assert len(proof.siblings) <= (shards - 1).bit_length()
        assert proof.proves(root)
        assert verify_fragment(hashes[k], k, shards, proof.siblings, root)  # the check a client runs


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
def test_a_tampered_fragment_another_index_or_a_wrong_sibling_proves_nothing(shards: int) -> None:
    tensors = model()
    root = model_root(tensors, shards)
    hashes = fragment_hashes(tensors, shards)
    changed = dict(tensors, a=tensors["a"] + 1e-3)  # "a" is in fragment 0 (the largest tensor goes first)
    assert fragment_hashes(changed, shards)[0] != hashes[0]
    tampered = dataclasses.replace(FragmentProof.of(hashes, 0), fragment_sha256=fragment_hashes(changed, shards)[0])
    assert not tampered.proves(root)
    for k in range(shards):
        proof = FragmentProof.of(hashes, k)
        assert not dataclasses.replace(proof, count=shards + 1).proves(root)
        if shards > 1:
            assert not dataclasses.replace(proof, index=(k + 1) % shards).proves(root)
        for j in range(len(proof.siblings)):
            wrong = (*proof.siblings[:j], flipped(proof.siblings[j]), *proof.siblings[j + 1 :])
            assert not dataclasses.replace(proof, siblings=wrong).proves(root)
        if len(proof.siblings) > 1:  # the right siblings in the wrong order
            assert not dataclasses.replace(proof, siblings=proof.siblings[::-1]).proves(root)


def test_a_malformed_proof_proves_nothing_and_no_proof_is_made_for_a_missing_fragment() -> None:
    hashes = fragment_hashes(model(), 3)
    root = model_root(model(), 3)
    proof = FragmentProof.of(hashes, 2)
    assert proof.proves(root)
    assert not dataclasses.replace(proof, fragment_sha256=proof.fragment_sha256[:31]).proves(root)
    assert not dataclasses.replace(proof, index=3).proves(root)
    with pytest.raises(FragmentError, match="fragment 3 of 3"):
        FragmentProof.of(hashes, 3)
