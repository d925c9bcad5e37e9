"""The reward tree, checked against a by-hand construction (the contract side is in test_registry)."""

from __future__ import annotations

import pytest
from eth_abi import encode
from eth_utils import keccak

from chain.merkle import LEAF_TAG, RewardTree, hash_pair, reward_leaf, verify_proof

REGISTRY = "0x" + "ab" * 20
HOSTS = [f"0x{i:040x}" for i in (3, 1, 2)]


def test_leaf_is_the_documented_encoding() -> None:
    assert keccak(b"gonka.reward-leaf.v1") == LEAF_TAG
    expected = keccak(
        LEAF_TAG + (7).to_bytes(32, "big") + bytes(12) + bytes.fromhex("ab" * 20) + (1).to_bytes(32, "big")
        + (2).to_bytes(32, "big") + bytes(12) + bytes.fromhex(f"{5:040x}") + (9).to_bytes(32, "big")
    )
    assert reward_leaf(7, REGISTRY, 1, 2, f"0x{5:040x}", 9) == expected
    assert len(encode(["bytes32"] * 7, [b"\0" * 32] * 7)) == 224  # a leaf preimage is never 64 bytes


def test_three_leaves_by_hand() -> None:
    tree = RewardTree(7, REGISTRY, 1, 2, [(h, 10) for h in HOSTS])
    l1, l2, l3 = (reward_leaf(7, REGISTRY, 1, 2, f"0x{i:040x}", 10) for i in (1, 2, 3))
    # Sorted by address: 1, 2, 3; the odd third leaf moves up unchanged.
    assert tree.root == hash_pair(hash_pair(l1, l2), l3)
    assert tree.proof(f"0x{1:040x}") == [l2, l3]
    assert tree.proof(f"0x{3:040x}") == [hash_pair(l1, l2)]
    assert tree.total == 30


@pytest.mark.parametrize("n", [1, 2, 5, 64, 257])
def test_every_proof_verifies_and_a_changed_amount_does_not(n: int) -> None:
    rewards = [(f"0x{i + 1:040x}", 1000 + i) for i in range(n)]
    tree = RewardTree(7, REGISTRY, 1, 2, rewards)
    for host, amount in rewards:
        leaf = reward_leaf(7, REGISTRY, 1, 2, host, amount)
        assert verify_proof(leaf, tree.proof(host), tree.root)
        assert not verify_proof(reward_leaf(7, REGISTRY, 1, 2, host, amount + 1), tree.proof(host), tree.root)
        assert not verify_proof(reward_leaf(7, REGISTRY, 1, 3, host, amount), tree.proof(host), tree.root)
    assert len(tree.proof(rewards[0][0])) <= max(1, (n - 1).bit_length())


def test_bad_reward_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        RewardTree(7, REGISTRY, 1, 2, [(HOSTS[0], 1), (HOSTS[0].upper().replace("0X", "0x"), 2)])
    with pytest.raises(ValueError, match="must be > 0"):
        RewardTree(7, REGISTRY, 1, 2, [(HOSTS[0], 0)])
    with pytest.raises(ValueError, match="at least one"):
        RewardTree(7, REGISTRY, 1, 2, [])
