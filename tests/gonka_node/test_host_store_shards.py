"""A host's snapshot in a sharded epoch is checked by the hash the chain records for it: the Merkle
root over fragments after a round, the canonical sha256 for the epoch's initial model (round 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gonka_node.core.fragments import model_root
from gonka_node.host.store import HostStore, Progress
from training.checkpoint import canonical_sha256

PARAMS = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.weight": torch.ones(5), "c.bias": torch.zeros(2)}


def test_a_sharded_snapshot_resumes_by_its_fragment_root(tmp_path: Path) -> None:
    root = model_root(PARAMS, 2)
    assert root.hex() != canonical_sha256(PARAMS)  # the two hashes differ: the check below can tell them apart
    HostStore(tmp_path).save(Progress(1, 0, 3, root.hex(), shards=2), PARAMS, None, None)
    snap = HostStore(tmp_path).load()
    assert snap is not None and snap.progress.shards == 2 and torch.equal(snap.global_params["a.weight"], PARAMS["a.weight"])


def test_a_snapshot_whose_hash_is_not_its_shards_root_is_refused(tmp_path: Path) -> None:
    HostStore(tmp_path).save(Progress(1, 0, 3, model_root(PARAMS, 2).hex(), shards=3), PARAMS, None, None)
    with pytest.raises(ValueError, match="does not hash to"):
        HostStore(tmp_path).load()


def test_the_initial_model_of_a_sharded_epoch_keeps_its_canonical_hash(tmp_path: Path) -> None:
    HostStore(tmp_path).save(Progress(1, 0, 0, canonical_sha256(PARAMS), shards=2), PARAMS, None, None)
    snap = HostStore(tmp_path).load()
    assert snap is not None and snap.progress.round_done == 0
