"""Overlapped rounds (recipe `overlap = "delayed"`) through the real aggregator and two real hosts.

Round r trains from the global model after round r − 2, so a host trains round r + 1 while round r
uploads and closes. The epoch still ends with every host holding the chain's checkpoint bit for bit,
the aggregator's replay check (p = 1) reproduces every host's round from public inputs, and the
payloads are exactly what a worker computes from the public bases the rule names.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import test_host_node as base
from torch import Tensor

from gonka_node.core.recipe import Recipe, RecipeError, check_network_overlap
from gonka_node.host.events import HostEvents
from gonka_node.host.store import Progress
from training.checkpoint import canonical_sha256, load_checkpoint
from training.codecs import get_codec
from training.model import ModelConfig, build_model
from training.overlap import base_round, next_overlapped_round
from training.worker import Assignment, DiLoCoWorker

GNK = base.GNK


class Applied(HostEvents):
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def round_applied(self, round_: int, how: str, sha256: bytes, reward: int, latency_s: float) -> None:
        self.seen.append((round_, how))


@dataclass
class Epoch:
    world: base.World
    progresses: list[Progress]
    bases: dict[int, bytes]  # round -> the base hash its envelopes bound
    payloads: dict[tuple[int, bytes], bytes]  # (round, host) -> the stored payload
    reasons: dict[tuple[int, bytes], list[str]]
    models: dict[int, dict[str, Tensor]]  # round -> the aggregator's checkpoint after it (0: initial)
    update_bytes: int  # the three rounds' aggregated update files
    applied: list[list[tuple[int, str]]]  # per host: (round, how) of every round_applied event


def overlapped_world(tmp_path: Path, overlap: str = "delayed", broadcast: str = "dense") -> base.World:
    return base.build_world(tmp_path, inner_steps=8, n_rounds=3, overlap=overlap, broadcast=broadcast)


@pytest.fixture(scope="module")
def epoch(tmp_path_factory: pytest.TempPathFactory) -> Epoch:
    tmp_path = tmp_path_factory.mktemp("overlap")
    world = overlapped_world(tmp_path)
    agg = base.AggregatorThread(world, tmp_path / "agg")
    with agg as target:
        events = [Applied(), Applied()]
        nodes = [base.make_node(world, i, target, tmp_path / f"host{i}", events=events[i - 1]) for i in (1, 2)]
        with ThreadPoolExecutor(2) as pool:
            progresses = [f.result(timeout=300) for f in [pool.submit(n.run) for n in nodes]]
        bases = {row.round: row.base_sha256 for row in agg.store.rounds(world.epoch)}
        payloads = {(r, s.host): Path(s.path).read_bytes() for r in (1, 2, 3)
                    for s in agg.store.submissions(world.epoch, r)}
        reasons = {(r, c.host): c.reasons for r in (1, 2, 3) for c in agg.store.contributions(world.epoch, r)}
        models = {0: load_checkpoint(world.init_path).tensors}
        models.update({r: load_checkpoint(agg.store.checkpoint_path(world.epoch, r)).tensors for r in (1, 2, 3)})
        update_bytes = sum(agg.store.update_path(world.epoch, r).stat().st_size for r in (1, 2, 3))
    return Epoch(world, progresses, bases, payloads, reasons, models, update_bytes, [e.seen for e in events])


def test_an_overlapped_epoch_passes_the_replay_and_every_host_holds_the_chains_model(epoch: Epoch) -> None:
    world, chain = epoch.world, epoch.world.client(0)
    assert chain.latest_round(world.epoch) == 3
    for r in (1, 2, 3):
        assert chain.round_result(world.epoch, r).checkpoint_sha256.hex() == canonical_sha256(epoch.models[r])
        # The envelope's base is the chain's model after round r − 2 (the initial model for rounds 1, 2).
        assert epoch.bases[r].hex() == canonical_sha256(epoch.models[base_round(r, "delayed")])
    assert epoch.bases[1] == epoch.bases[2] != epoch.bases[3]
    final = chain.round_result(world.epoch, 3).checkpoint_sha256.hex()
    for progress in epoch.progresses:
        assert progress.round_done == 3 and progress.model_sha256 == final  # applied the updates, bit for bit
        assert progress.outer_steps == 3  # never fell back to pulling a checkpoint
        assert set(progress.submitted) == {"1", "2", "3"}
        assert all(progress.rewards[str(r)] > 0 for r in (1, 2, 3))
        assert set(progress.utilisation) == {"1", "2", "3"}
        assert all(0 < busy <= wall for busy, wall in progress.utilisation.values())
        assert progress.bytes_received == epoch.update_bytes  # each update downloaded once (prefetched or not)
    # Round 1's model was computed by the upload thread while round 2 trained, and checked on adoption.
    assert [seen[0] for seen in epoch.applied] == [(1, "ahead"), (1, "ahead")]
    assert len(epoch.reasons) == 6
    for key, why in epoch.reasons.items():  # every host's every round replayed (p = 1) and reproduced
        assert any(line.startswith("replay:") for line in why), (key, why)


def test_replaying_overlapped_rounds_from_public_inputs_gives_the_submitted_payloads(epoch: Epoch) -> None:
    # A worker fed only public inputs (the checkpoints the rule names, the slot, the round) sends the very
    # bytes each host sent, the error feedback carried over the rounds included.
    world, recipe = epoch.world, epoch.world.recipe
    for i in (1, 2):
        address = base.host_keys(i, world).evm_address
        slot = world.client(0).host_info(world.epoch, address).slot
        worker = DiLoCoWorker(build_model(recipe.model, recipe.init_seed), recipe.inner_config(),
                              get_codec(recipe.codec), recipe.windows(), Assignment(recipe.epoch_seed, slot, 4))
        for r in (1, 2, 3):
            sent = worker.train_round(r, epoch.models[base_round(r, "delayed")]).payload
            assert sent == epoch.payloads[(r, bytes.fromhex(address[2:]))], (i, r)


def test_the_next_overlapped_round_never_trains_from_behind_the_held_model() -> None:
    assert [next_overlapped_round(t, latest, held) for t, latest, held in
            [(0, 0, 0), (1, 0, 0), (2, 0, 0), (2, 1, 1), (0, 3, 3), (5, 3, 3)]] == [1, 2, 3, 3, 5, 6]
    assert [base_round(r, "delayed") for r in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [base_round(r, "off") for r in (1, 2, 3)] == [0, 1, 2]


def test_the_overlap_mode_is_part_of_the_recipe_hash_only_when_on(tmp_path: Path) -> None:
    off = Recipe(model=ModelConfig.preset("tiny"))
    assert b"overlap" not in off.canonical_json()  # earlier epochs' model spec hashes are unchanged
    on = replace(off, overlap="delayed")
    assert b'"overlap":"delayed"' in on.canonical_json() and on.sha256() != off.sha256()
    on.save(tmp_path / "r.json")
    assert Recipe.load(tmp_path / "r.json").overlap == "delayed"
    with pytest.raises(RecipeError, match="overlap: must be one of off, delayed, eager, got 'streaming'"):
        replace(off, overlap="streaming")
    check_network_overlap(on)
    check_network_overlap(replace(on, shards=2))  # "delayed" runs sharded; "eager" does not (test_host_eager.py)
