"""The replay pick as anyone recomputes it from the chain's round seed: sha256(tag ‖ seed ‖ round as 8
bytes big-endian ‖ host), its first 8 bytes big-endian below p·2^64 (docs/PROTOCOL.md, replay check)."""

from __future__ import annotations

import hashlib

from gonka_node.aggregator.replay import PICK_TAG, chosen_for_replay

SEED = bytes(range(32))
HOSTS = [bytes([i]) * 20 for i in range(1, 41)]


def draw(seed: bytes, round_: int, host: bytes) -> int:
    return int.from_bytes(hashlib.sha256(PICK_TAG + seed + round_.to_bytes(8, "big") + host).digest()[:8], "big")


def test_the_pick_is_the_published_formula() -> None:
    assert PICK_TAG == b"gonka-replay-pick-v2"
    for fraction in (0.125, 0.5, 0.875):
        want = {h for h in HOSTS if draw(SEED, 7, h) < int(fraction * 2**64)}
        assert chosen_for_replay(fraction, SEED, 7, HOSTS) == want
        assert 0 < len(want) < len(HOSTS)


def test_the_host_just_above_and_below_the_bar() -> None:
    draws = sorted((draw(SEED, 3, h), h) for h in HOSTS)
    (low, first), (high, second) = draws[0], draws[1]
    between = (low + high) / 2 / 2**64  # a fraction whose bar lies between the two smallest draws
    assert chosen_for_replay(between, SEED, 3, HOSTS) == {first}
    assert chosen_for_replay(high / 2**64 * (1 + 1e-12), SEED, 3, HOSTS) == {first, second}


def test_everyone_at_one_nobody_at_zero_or_below_and_bytes_out() -> None:
    assert chosen_for_replay(1.0, SEED, 1, HOSTS) == set(HOSTS)
    assert chosen_for_replay(1.5, SEED, 1, HOSTS) == set(HOSTS)
    assert chosen_for_replay(0.0, SEED, 1, HOSTS) == set() == chosen_for_replay(-0.5, SEED, 1, HOSTS)
    got = chosen_for_replay(1.0, SEED, 1, [bytearray(h) for h in HOSTS[:3]])
    assert got == set(HOSTS[:3]) and all(type(h) is bytes for h in got)
    assert chosen_for_replay(0.5, SEED, 1, [bytearray(h) for h in HOSTS]) == chosen_for_replay(0.5, SEED, 1, HOSTS)


def test_a_draw_exactly_at_the_bar_is_not_picked() -> None:
    # A host whose draw is exactly representable as a float: p = draw / 2^64 puts the bar right on it.
    host = next(h for h in (i.to_bytes(20, "big") for i in range(1, 200_000))
                if float(draw(SEED, 5, h)) == draw(SEED, 5, h) and draw(SEED, 5, h) > 0)
    at = draw(SEED, 5, host)
    assert int(at / 2**64 * 2**64) == at
    assert chosen_for_replay(at / 2**64, SEED, 5, [host]) == set()  # strictly below the bar
    assert chosen_for_replay((at + 2**12) / 2**64, SEED, 5, [host]) == {host}
