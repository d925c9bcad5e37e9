"""The round seed's commit–reveal formula, as `Registry.commit_round_seed` / `reveal_round_seed` apply it.

    commitment = keccak256(secret)                                  (secret: 32 bytes)
    share      = keccak256(abi.encode(bytes32 secret, address aggregator))
    seed       = XOR of the shares of every reveal                  (order-independent; 0 before any)

Binding the aggregator's address into its share stops a second aggregator from copying a revealed
secret to cancel it out (its share would be a different hash).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from eth_abi import encode
from eth_utils import keccak, to_checksum_address


def new_secret() -> bytes:
    return os.urandom(32)


def seed_commitment(secret: bytes) -> bytes:
    return keccak(_secret(secret))


def seed_share(secret: bytes, aggregator: str) -> bytes:
    return keccak(encode(["bytes32", "address"], [_secret(secret), to_checksum_address(aggregator)]))


def combine_seed(reveals: Iterable[tuple[bytes, str]]) -> bytes:
    """The seed after the (secret, aggregator) reveals, in any order."""
    seed = 0
    for secret, aggregator in reveals:
        seed ^= int.from_bytes(seed_share(secret, aggregator), "big")
    return seed.to_bytes(32, "big")


def _secret(secret: bytes) -> bytes:
    if len(secret) != 32:
        raise ValueError(f"a seed secret must be 32 bytes, got {len(secret)}")
    return bytes(secret)
