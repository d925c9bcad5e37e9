"""The reward tree's refusals, word for word, and its per-host lookups in any address spelling."""

from __future__ import annotations

import pytest
from eth_utils import to_checksum_address

from chain.merkle import RewardTree

REGISTRY = "0x" + "ab" * 20
HOST = f"0x{0xBEEF:040x}"
CHECKSUMMED = to_checksum_address(HOST)


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        ([(HOST, 1), (HOST.upper().replace("0X", "0x"), 2)], f"host {CHECKSUMMED} appears twice in the rewards"),
        ([(HOST, 0)], f"reward of {CHECKSUMMED} must be > 0, got 0"),
        ([(HOST, -3)], f"reward of {CHECKSUMMED} must be > 0, got -3"),
        ([], r"a reward tree needs at least one \(host, amount\)"),
    ],
)
def test_bad_reward_lists_are_refused_word_for_word(rewards: list, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        RewardTree(7, REGISTRY, 1, 2, rewards)


def test_amounts_and_proofs_are_found_by_any_spelling_of_the_address() -> None:
    tree = RewardTree(7, REGISTRY, 1, 2, [(HOST, 5), (f"0x{1:040x}", 9)])
    assert tree.amount(HOST.lower()) == tree.amount(CHECKSUMMED) == 5
    assert tree.proof(HOST.lower()) == tree.proof(CHECKSUMMED) != []
    assert tree.hosts == [to_checksum_address(f"0x{1:040x}"), CHECKSUMMED] and tree.total == 14
