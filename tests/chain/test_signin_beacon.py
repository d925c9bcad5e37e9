"""The data assignment's randomness: the first block stamped at or after the sign-in deadline.

No host can compute its windows before sign-in closes (the block does not exist yet), and once it does
anyone recomputes every host's windows from public inputs: the recipe, the slot and that block's hash."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GNK, World, sha

from chain.errors import BeaconNotReady
from training.data import Windows, window_seed
from training.worker import Assignment

STAKE = 100 * GNK
WINDOWS = Windows(np.arange(64 * 400, dtype=np.uint16), seq_len=63)  # 400 windows


def _ids(assignment: Assignment, round_: int = 0) -> set[int]:
    ids = WINDOWS.assignment(epoch_seed=assignment.window_seed, round_index=round_, slot=assignment.slot,
                             max_slots=assignment.max_slots, windows_per_host=16)
    return {int(i) for i in ids}


def _epoch_with_two_hosts(world: World) -> int:
    epoch = world.client(0).create_epoch(world.spec(signin_window=3600))
    for i in (2, 3):
        world.client(i).join(epoch, STAKE, sha(f"node-key-{i}"))
    return epoch


def test_no_beacon_while_sign_in_is_open(world: World) -> None:
    epoch = _epoch_with_two_hosts(world)
    host = world.client(2)
    with pytest.raises(BeaconNotReady, match="does not exist yet"):
        host.signin_beacon(epoch)
    world.backend.increase_time(3000)  # still open: a later host may still join
    world.client(4).join(epoch, STAKE, sha("node-key-4"))
    with pytest.raises(BeaconNotReady):
        host.signin_beacon(epoch)


def test_the_beacon_is_the_first_block_at_or_after_the_deadline(world: World) -> None:
    epoch = _epoch_with_two_hosts(world)
    end = world.client(0).get_epoch(epoch).signin_end
    world.backend.increase_time(3601)  # mines a block past the deadline
    world.backend.increase_time(5)  # later blocks do not change the beacon
    beacon = world.client(2).signin_beacon(epoch)
    w3 = world.client(0).w3
    blocks = [w3.eth.get_block(n) for n in range(int(w3.eth.block_number) + 1)]  # a plain scan, no bisection
    first = next(b for b in blocks if int(b["timestamp"]) >= end)
    assert int(blocks[int(first["number"]) - 1]["timestamp"]) < end
    assert beacon == bytes(first["hash"]) and len(beacon) == 32
    assert world.client(9).signin_beacon(epoch) == beacon  # anyone reads the same


def test_windows_need_the_beacon_and_are_disjoint_and_recomputable(world: World) -> None:
    epoch = _epoch_with_two_hosts(world)
    spec = world.client(0).get_epoch(epoch).spec
    slots = {i: world.client(i).host_info(epoch, world.address(i)).slot for i in (2, 3)}
    world.backend.increase_time(3601)
    beacon = world.client(2).signin_beacon(epoch)
    mine = {i: _ids(Assignment(7, slots[i], spec.max_hosts, beacon)) for i in (2, 3)}
    assert len(mine[2]) == len(mine[3]) == 16 and not mine[2] & mine[3]
    outsider = world.client(9).signin_beacon(epoch)  # anyone: same public inputs, same windows
    assert all(_ids(Assignment(7, slots[i], spec.max_hosts, outsider)) == mine[i] for i in (2, 3))
    # Without the beacon (all a host knew while signing in) the windows are others.
    assert _ids(Assignment(7, slots[2], spec.max_hosts)) != mine[2]
    assert window_seed(7, beacon) != window_seed(7) == 7
