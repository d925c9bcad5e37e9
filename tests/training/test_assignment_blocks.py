"""Block assignment (prepared datasets): disjoint and complete like the windowwise one, but local."""

from __future__ import annotations

import numpy as np
import pytest

from training.data import assign_positions


@pytest.mark.parametrize("block", [1, 7, 64])
def test_a_pass_visits_every_window_once(block: int) -> None:
    n = 1000
    seen = np.concatenate([
        assign_positions(n, epoch_seed=3, round_index=r, slot=s, max_slots=4, windows_per_host=50, block=block)
        for r in range(5) for s in range(4)
    ])
    assert sorted(seen.tolist()) == list(range(n))  # 5 rounds × 4 slots × 50 = one pass, no repeats


def test_a_hosts_windows_fall_in_few_blocks_and_are_shuffled() -> None:
    ids = assign_positions(10_000, epoch_seed=9, round_index=2, slot=1, max_slots=4, windows_per_host=100, block=64)
    assert len({int(i) // 64 for i in ids}) <= 3  # 100 consecutive positions: at most 3 blocks of 64
    assert (np.diff(ids) != 1).sum() > 50  # but not trained in file order
    again = assign_positions(10_000, epoch_seed=9, round_index=2, slot=1, max_slots=4, windows_per_host=100, block=64)
    assert again.tolist() == ids.tolist()
    other = assign_positions(10_000, epoch_seed=10, round_index=2, slot=1, max_slots=4, windows_per_host=100, block=64)
    assert set(other.tolist()) != set(ids.tolist())


def test_block_one_is_the_windowwise_assignment() -> None:
    plain = assign_positions(500, epoch_seed=1, round_index=0, slot=0, max_slots=2, windows_per_host=9)
    assert assign_positions(500, epoch_seed=1, round_index=0, slot=0, max_slots=2, windows_per_host=9,
                            block=1).tolist() == plain.tolist()
