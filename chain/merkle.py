"""Reward Merkle trees, byte for byte as Registry.vy verifies them.

leaf  = keccak256(abi.encode(LEAF_TAG, chain_id, registry, epoch, round, host, amount))
        LEAF_TAG = keccak256("gonka.reward-leaf.v1"); the seven words make a 224-byte preimage, so a
        leaf can never be confused with an inner node (64-byte preimage).
node  = keccak256(min(a, b) ++ max(a, b))   (sorted pair: proofs carry no left/right bits)
tree  = leaves in ascending order of host address (20 bytes, unsigned), one leaf per host; each level
        pairs neighbours left to right, an odd last node moves up unchanged; the root of one leaf is
        the leaf itself.
proof = the sibling of each level from the leaf up, skipping levels where the node had none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from eth_abi import encode
from eth_utils import keccak, to_canonical_address, to_checksum_address

LEAF_TAG = keccak(text="gonka.reward-leaf.v1")


def reward_leaf(chain_id: int, registry: str, epoch: int, round_: int, host: str, amount: int) -> bytes:
    return keccak(
        encode(
            ["bytes32", "uint256", "address", "uint256", "uint256", "address", "uint256"],
            [LEAF_TAG, chain_id, registry, epoch, round_, host, amount],
        )
    )


def hash_pair(a: bytes, b: bytes) -> bytes:
    return keccak(a + b) if a < b else keccak(b + a)


def verify_proof(leaf: bytes, proof: Sequence[bytes], root: bytes) -> bool:
    node = leaf
    for sibling in proof:
        node = hash_pair(node, sibling)
    return node == root


class RewardTree:
    """The rewards of one round: (host, amount) pairs → root and per-host proofs."""

    def __init__(
        self, chain_id: int, registry: str, epoch: int, round_: int, rewards: Iterable[tuple[str, int]]
    ) -> None:
        by_host: dict[bytes, int] = {}
        for host, amount in rewards:
            key = to_canonical_address(host)
            if key in by_host:
                raise ValueError(f"host {to_checksum_address(key)} appears twice in the rewards")
            if amount <= 0:
                raise ValueError(f"reward of {to_checksum_address(key)} must be > 0, got {amount}")
            by_host[key] = amount
        if not by_host:
            raise ValueError("a reward tree needs at least one (host, amount)")
        self.hosts = [to_checksum_address(k) for k in sorted(by_host)]
        self.amounts = {h: by_host[to_canonical_address(h)] for h in self.hosts}
        leaves = [reward_leaf(chain_id, registry, epoch, round_, h, self.amounts[h]) for h in self.hosts]
        self._levels = _build_levels(leaves)

    @property
    def root(self) -> bytes:
        return self._levels[-1][0]

    @property
    def total(self) -> int:
        return sum(self.amounts.values())

    def amount(self, host: str) -> int:
        return self.amounts[to_checksum_address(host)]

    def proof(self, host: str) -> list[bytes]:
        index = self.hosts.index(to_checksum_address(host))
        proof = []
        for level in self._levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):
                proof.append(level[sibling])
            index //= 2
        return proof


def _build_levels(leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [hash_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            up.append(level[-1])
        levels.append(up)
    return levels
