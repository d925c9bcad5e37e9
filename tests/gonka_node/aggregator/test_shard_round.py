"""Sharded aggregators over the real engine (engine_kit.py): the same hosts' updates closed by one
aggregator (S = 1) and by two shards of an epoch with two aggregators and quorum 2 (S = 2). Each shard
accepts only its fragment; its fragment of the new model, the aggregate and the momentum equal the
unsharded ones bit for bit; the round finalizes on chain once, with the Merkle-of-fragments root."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from agg_harness import AGGREGATOR
from engine_kit import SECOND_AGGREGATOR, SPEC, Host, Kit, chunks, initial_tensors, payload, update
from nacl.signing import SigningKey
from safetensors.torch import load_file

from gonka_node.aggregator import shard_close
from gonka_node.aggregator.broadcast import residual_path
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard import (
    DirExchange,
    FragmentReport,
    LocalExchange,
    ShardConfigError,
    ShardExchange,
    ShardMismatch,
    Verdict,
    shard_role,
)
from gonka_node.aggregator.shard_close import file_sha256, load_fragment, read_fragment_hashes
from gonka_node.aggregator.store import Store
from gonka_node.core.client import Downloaded
from gonka_node.core.config import AggregationSettings
from gonka_node.core.fragments import fragment_proof, fragment_root, verify_fragment
from gonka_node.core.recipe import Recipe, RecipeError
from gonka_node.epoch_setup import shard_context
from gonka_node.host.shards import ShardedAggregator, SplitError, join_payload, split_payload
from proto.gonka.v1 import common_pb2 as common
from training.checkpoint import load_checkpoint
from training.codecs import get_codec
from training.model import ModelConfig

ORDER = (AGGREGATOR, SECOND_AGGREGATOR)  # epoch4's aggregators on chain: shard 0, shard 1


def address(kit: Kit, i: int) -> bytes:
    return bytes.fromhex(kit.world.chain.accounts[i].address[2:])


def shard_engine(kit: Kit, i: int, exchange: ShardExchange, **ctx_fields: Any) -> RoundEngine:
    """Shard i of epoch4 on its own store (a second call: the same shard restarted)."""
    whole = kit.context(kit.world.epoch4)
    role = shard_role(whole.spec, [address(kit, a) for a in ORDER], address(kit, ORDER[i]), kit.aggregation.rule)
    assert role is not None
    ctx = dataclasses.replace(whole, spec=role.spec, shard=role, **ctx_fields)
    e = RoundEngine(
        ctx, kit.settings, kit.aggregation, Store(kit.tmp / f"shard{i}").open(),
        ChainView(kit.world.chain.client(ORDER[i])), TrainingCheckpoints(), SigningKey(bytes([ORDER[i]]) * 32),
        clock=kit.clock, exchange=exchange,
    )
    kit.engines.append(e)
    e.start()
    return e


def fragment_payload(u: dict[str, torch.Tensor], e: RoundEngine) -> bytes:
    return payload({n: u[n] for n in e.ctx.spec})


def run_round(kit: Kit, whole: RoundEngine, shards: list[RoundEngine], ups: list[dict[str, torch.Tensor]]) -> None:
    for h, u in zip(kit.hosts, ups, strict=True):
        assert kit.submit(whole, h, payload(u)).body.accepted
        for s in shards:
            assert kit.submit(s, h, fragment_payload(u, s)).body.accepted
    kit.run(whole.tick())
    for _ in range(3):  # seeds, reports, verdict, hashes: each shard waits on the other once at most
        for s in shards:
            kit.run(s.tick())


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path).tensors


@pytest.fixture
def clipped(kit: Kit) -> Kit:
    kit.aggregation = AggregationSettings(rule="clip_median")
    return kit


def test_two_shards_equal_one_aggregator_bit_for_bit_and_finalize_once_with_the_root(
    clipped: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    kit, exchange = clipped, LocalExchange()
    whole = kit.engine()
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    assert [s.ctx.spec for s in shards] == [{"w": (2, 4)}, {"b": (3,)}]
    for rnd, seed in ((1, 10), (2, 20)):
        # the third host's update is 3x larger than the others: the median clip scales it down
        ups = [update(seed), update(seed + 1), {n: t * 3 for n, t in update(seed + 2).items()}]
        run_round(kit, whole, shards, ups)
        unsharded = whole.store.get_round(kit.world.epoch, rnd)
        assert unsharded is not None and unsharded.state == "finalized"
        model = tensors(whole.store.checkpoint_path(kit.world.epoch, rnd))
        agg = tensors(whole.store.update_path(kit.world.epoch, rnd))
        momentum = tensors(whole.store.outer_state_path(kit.world.epoch, rnd))
        hashes = read_fragment_hashes(shards[0].store.checkpoint_path(kit.world.epoch4, rnd))
        root = fragment_root(hashes)
        for i, s in enumerate(shards):
            got = s.store.get_round(kit.world.epoch4, rnd)
            assert got is not None and got.state == "finalized" and got.checkpoint_sha256 == root
            frag = tensors(s.store.checkpoint_path(kit.world.epoch4, rnd))
            assert set(frag) == set(s.ctx.spec)
            for name, t in frag.items():
                assert torch.equal(t, model[name]), name
                assert torch.equal(tensors(s.store.update_path(kit.world.epoch4, rnd))[name], agg[name])
                assert torch.equal(tensors(s.store.outer_state_path(kit.world.epoch4, rnd))[name], momentum[name])
            own = TrainingCheckpoints().sha256(frag)
            assert hashes[i] == own and verify_fragment(own, i, 2, fragment_proof(hashes, i), root)
            assert [(c.host, c.reward, c.aggregated) for c in s.store.contributions(kit.world.epoch4, rnd)] == [
                (c.host, c.reward, c.aggregated) for c in whole.store.contributions(kit.world.epoch, rnd)
            ]
        result = kit.world.chain.client(0).round_result(kit.world.epoch4, rnd)
        assert result.finalized and bytes(result.checkpoint_sha256) == root != unsharded.checkpoint_sha256
    verdict = exchange.verdict(kit.world.epoch4, 2)
    assert verdict is not None and verdict.tau is not None
    assert verdict.clip_norms[kit.hosts[2].address] > verdict.tau  # the clip was exercised
    # Waiting for the other shard is not a failure: no warning says so (an unrevealed seed still does).
    assert not [m for m in caplog.messages if "ShardPending" in m]


def submit_as(kit: Kit, e: RoundEngine, h: Host, data: bytes, codec: str) -> bool:
    sub = kit.header(e, h, data, codec=codec)
    return kit.run(e.submit(sub, sub.sign(h.key), chunks(data), e.stream_guard("test"))).body.accepted


def test_two_shards_broadcast_the_compressed_update_one_aggregator_would_byte_for_byte(kit: Kit) -> None:
    """`broadcast = "codec"` (int8): each shard encodes its fragment of the aggregate with its own
    residual; joined in fragment order, the shards' payloads are the one aggregator's byte for byte,
    round after round (the residual carried), and so is what a host following the shards decodes."""
    codec_fields: dict[str, Any] = dict(codec_name="int8", codec=get_codec("int8"), broadcast="codec")
    whole = kit.engine(start=False)
    whole.ctx = dataclasses.replace(whole.ctx, **codec_fields)
    whole.start()
    shards = [shard_engine(kit, i, LocalExchange(), **codec_fields) for i in range(2)]
    exchange = LocalExchange()
    for s in shards:
        s.exchange = exchange
    ep, ep4 = kit.world.epoch, kit.world.epoch4
    for r in (1, 2):
        codec = whole.ctx.codec_for(r)
        for i, h in enumerate(kit.hosts):
            data = codec.encode(update(10 * r + i))
            assert submit_as(kit, whole, h, data, "int8")
            for s, fragment in zip(shards, split_payload(codec, data, SPEC, 2), strict=True):
                assert submit_as(kit, s, h, fragment, "int8")
        kit.run(whole.tick())
        for _ in range(3):
            for s in shards:
                kit.run(s.tick())
        assert [s.store.get_round(ep4, r).state for s in shards] == ["finalized"] * 2  # type: ignore[union-attr]
        sent = whole.store.update_path(ep, r).read_bytes()
        parts = [s.store.update_path(ep4, r).read_bytes() for s in shards]
        assert join_payload(codec, parts, SPEC) == sent
        residual = load_file(str(residual_path(whole.store.update_path(ep, r))))
        assert any(float(t.abs().max()) > 0 for t in residual.values())  # int8 held something back
        model = tensors(whole.store.checkpoint_path(ep, r))
        for s in shards:
            own = load_file(str(residual_path(s.store.update_path(ep4, r))))
            assert set(own) == set(s.ctx.spec) and all(torch.equal(own[n], residual[n]) for n in own)
            assert all(torch.equal(t, model[n]) for n, t in tensors(s.store.checkpoint_path(ep4, r)).items())
        # A host's view of the shards: their fragments joined into the payload it decodes.
        clients = [_Serving(s.store.update_path(ep4, r).read_bytes()) for s in shards]
        joined = ShardedAggregator(clients, whole.ctx.codec_for, SPEC, "codec").round_update(ep4, r)  # type: ignore[arg-type]
        assert joined.data == sent and joined.meta.length == len(sent)
    with pytest.raises(SplitError, match="fragment 1: not the int8 encoding of its 1 tensors"):
        join_payload(codec, [parts[0], parts[1][:-1]], SPEC)


class _Serving:
    """An aggregator client serving one update file (the part of `AggregatorClient` a host's follower uses)."""

    target = "127.0.0.1:0"

    def __init__(self, data: bytes) -> None:
        self.data = data

    def round_update(self, epoch: int, round_: int) -> Downloaded:
        return Downloaded(common.FileMeta(epoch=epoch, round=round_, length=len(self.data)), self.data)


def test_a_shard_accepts_only_its_fragment(kit: Kit) -> None:
    e = shard_engine(kit, 1, LocalExchange())
    u = update(3)
    assert kit.submit(e, kit.hosts[0], fragment_payload(u, e)).body.accepted
    assert kit.submit(e, kit.hosts[1], payload(u)).body.accepted  # the whole update, not fragment 1: received,
    row = e.store.submission(e.ctx.epoch, 1, kit.hosts[1].address)  # then refused by its checks
    assert row is not None and (row.check_state, row.check_reason) == ("failed", Reason.WRONG_SHAPE.value)
    assert e.store.submitted_hosts(e.ctx.epoch, 1) == {kit.hosts[0].address}


def test_a_host_one_shard_refused_is_aggregated_by_none(kit: Kit) -> None:
    exchange = LocalExchange()
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    ups = [update(40 + i) for i in range(3)]
    for h, u in zip(kit.hosts, ups, strict=True):
        assert kit.submit(shards[0], h, fragment_payload(u, shards[0])).body.accepted
    for h, u in zip(kit.hosts[:2], ups[:2], strict=True):
        assert kit.submit(shards[1], h, fragment_payload(u, shards[1])).body.accepted
    kit.clock.ms = max(s.current.deadline_ms for s in shards if s.current) + 1  # shard 1 closes at its deadline
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())
    for s in shards:
        rows = {c.host: c for c in s.store.contributions(kit.world.epoch4, 1)}
        missing = rows[kit.hosts[2].address]
        assert not missing.aggregated and missing.reward == 0
        assert missing.reasons == ["fragment refused or missing at shard(s) [1]: not aggregated"]
        assert [h for h, c in rows.items() if c.aggregated] == [kit.hosts[0].address, kit.hosts[1].address]


def test_shard_role_reads_the_epochs_aggregator_list() -> None:
    spec = {"a": (4,), "b": (2, 2), "c": (3,)}
    me, other = hashlib.sha256(b"me").digest()[:20], hashlib.sha256(b"other").digest()[:20]
    assert shard_role(spec, [me], me, "mean") is None
    role = shard_role(spec, [other, me], me, "mean")
    assert role is not None and (role.index, role.count, role.offsets) == (1, 2, {"b": 4})
    with pytest.raises(ShardConfigError, match="is not one of the epoch's 2 aggregators"):
        shard_role(spec, [other, other], me, "mean")
    with pytest.raises(ShardConfigError, match="rule 'centered_clip' cannot run sharded"):
        shard_role(spec, [other, me], me, "centered_clip")


def test_a_shard_killed_mid_round_and_mid_close_resumes_from_its_store(kit: Kit) -> None:
    """Shards meeting through a directory (separate processes on one machine): shard 1 restarts after two
    hosts' fragments were accepted, and again after it sent its close report; nothing it accepted is
    lost, and the round's fragments equal one aggregator's over the same updates."""
    exchange = DirExchange(kit.tmp / "exchange")
    whole = kit.engine()
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    ups = [update(60 + i) for i in range(3)]
    for h, u in zip(kit.hosts[:2], ups[:2], strict=True):
        assert kit.submit(whole, h, payload(u)).body.accepted
        for s in shards:
            assert kit.submit(s, h, fragment_payload(u, s)).body.accepted
    shards[1].store.close()
    shards[1] = shard_engine(kit, 1, DirExchange(kit.tmp / "exchange"))  # killed and restarted
    assert shards[1].store.submitted_hosts(kit.world.epoch4, 1) == {h.address for h in kit.hosts[:2]}
    assert kit.submit(whole, kit.hosts[2], payload(ups[2])).body.accepted
    for s in shards:
        assert kit.submit(s, kit.hosts[2], fragment_payload(ups[2], s)).body.accepted
    kit.run(whole.tick())
    kit.run(shards[0].tick())  # revealed its seed; shard 1's is not revealed yet: no report
    kit.run(shards[1].tick())  # its report is in the exchange; no verdict yet (shard 0 has not retried)
    assert [r.index for r in exchange.reports(kit.world.epoch4, 1)] == [1]
    assert exchange.verdict(kit.world.epoch4, 1) is None
    shards[1].store.close()
    shards[1] = shard_engine(kit, 1, DirExchange(kit.tmp / "exchange"))  # killed while closing
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())
    model = tensors(whole.store.checkpoint_path(kit.world.epoch, 1))
    for s in shards:
        got = s.store.get_round(kit.world.epoch4, 1)
        assert got is not None and got.state == "finalized"
        assert [c.aggregated for c in s.store.contributions(kit.world.epoch4, 1)] == [True, True, True]
        for name, t in tensors(s.store.checkpoint_path(kit.world.epoch4, 1)).items():
            assert torch.equal(t, model[name]), name
    result = kit.world.chain.client(0).round_result(kit.world.epoch4, 1)
    assert result.finalized and bytes(result.checkpoint_sha256) == shards[1].store.get_round(kit.world.epoch4, 1).checkpoint_sha256


def test_a_shard_restarted_after_reporting_a_skip_closes_as_it_decided(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard 1's tick saw one host below quorum and closed with a skip while a second upload landed (the
    race between its tick's drain and its close); it reported the skip over both hosts, then was killed.
    Restarted with both uploads stored (a quorum) and the deadline passed, it closes with the decision
    kept with its round, not a recomputed one: no second report, no upload taken, and the round closes
    (skipped on chain, both votes) without an operator."""
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    exchange, epoch = DirExchange(kit.tmp / "exchange"), kit.world.epoch4
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    ups = [update(70 + i) for i in range(3)]
    for h, u in zip(kit.hosts[:2], ups[:2], strict=True):
        for s in shards:
            assert kit.submit(s, h, fragment_payload(u, s)).body.accepted
    kit.clock.ms += 11_000  # past the round's deadline
    kit.run(shards[0].close(skip=False))  # its seed revealed; shard 1's not yet: it waits
    kit.run(shards[1].close(skip=True))  # the tick's stale view: below quorum
    hosts = tuple(sorted(h.address for h in kit.hosts[:2]))
    [reported] = [r for r in exchange.reports(epoch, 1) if r.index == 1]
    assert reported.skip and tuple(f.host for f in reported.hosts) == hosts
    shards[1].store.close()
    shards[1] = shard_engine(kit, 1, DirExchange(kit.tmp / "exchange"))  # killed and restarted
    row = shards[1].store.get_round(epoch, 1)
    assert row is not None and row.state == "open"
    assert shards[1].closing  # closed for uploads: it reports nothing more than it decided
    with pytest.raises(Rejected) as late:
        kit.submit(shards[1], kit.hosts[2], fragment_payload(ups[2], shards[1]))
    assert late.value.reason == Reason.LATE
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())
    assert [r for r in exchange.reports(epoch, 1) if r.index == 1] == [reported]
    for s in shards:
        got = s.store.get_round(epoch, 1)
        assert got is not None and got.state == "skipped" and got.checkpoint_sha256 == kit.world.init_sha
    result = kit.world.chain.client(0).round_result(epoch, 1)
    assert result.finalized and bytes(result.checkpoint_sha256) == kit.world.init_sha
    assert not [m for m in caplog.messages if "one report per round" in m]
    assert shards[1].current is not None and shards[1].current.round == 2 and not shards[1].closing


def test_reports_and_verdicts_survive_their_json_form(kit: Kit, tmp_path: Path) -> None:
    exchange = LocalExchange()
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    for h, u in zip(kit.hosts, [update(70 + i) for i in range(3)], strict=True):
        for s in shards:
            assert kit.submit(s, h, fragment_payload(u, s)).body.accepted
    for _ in range(2):
        for s in shards:
            kit.run(s.tick())
    reports = exchange.reports(kit.world.epoch4, 1)
    assert len(reports) == 2 and all(len(r.hosts) == 3 for r in reports)
    assert [FragmentReport.from_json(r.to_json()) for r in reports] == reports
    verdict = exchange.verdict(kit.world.epoch4, 1)
    assert verdict is not None and Verdict.from_json(verdict.to_json()) == verdict
    on_disk = DirExchange(tmp_path / "x")
    on_disk.put_verdict(verdict)
    on_disk.put_verdict(dataclasses.replace(verdict, total_reward=1))  # the first verdict stands
    assert on_disk.verdict(kit.world.epoch4, 1) == verdict
    on_disk.put_hash(kit.world.epoch4, 1, 1, b"\x07" * 32)
    assert on_disk.hashes(kit.world.epoch4, 1) == {1: b"\x07" * 32} and on_disk.verdict(9, 9) is None


def test_a_sharded_recipe_makes_each_aggregator_of_the_epoch_its_shard(kit: Kit) -> None:
    recipe = Recipe(model=ModelConfig.preset("tiny"))
    assert b"shards" not in recipe.canonical_json()  # unsharded epochs' model spec hashes are unchanged
    sharded = dataclasses.replace(recipe, shards=2)
    assert b'"shards":2' in sharded.canonical_json()
    with pytest.raises(RecipeError, match="shards: must be a positive integer, got 0"):
        dataclasses.replace(recipe, shards=0)
    chain = kit.world.chain.client(0)
    whole = kit.context(kit.world.epoch4)
    assert shard_context(whole, recipe, chain.get_epoch(kit.world.epoch4), address(kit, AGGREGATOR), "mean") is whole
    for i, a in enumerate(ORDER):
        ctx = shard_context(whole, sharded, chain.get_epoch(kit.world.epoch4), address(kit, a), "mean")
        assert ctx.shard is not None and ctx.shard.index == i and ctx.spec == [{"w": (2, 4)}, {"b": (3,)}][i]
    # A replaying context keeps its replay: every shard computes the pick, shard 0 replays (test_shard_replay.py).
    replaying = dataclasses.replace(whole, replay_probability=0.25)
    ctx = shard_context(replaying, sharded, chain.get_epoch(kit.world.epoch4), address(kit, ORDER[0]), "mean")
    assert ctx.replay_probability == 0.25 and ctx.spec == {"w": (2, 4)}
    with pytest.raises(ShardConfigError, match=f"epoch {kit.world.epoch2}: the recipe has 2 shards, but the epoch "
                       "names 2 aggregators with quorum 1"):
        shard_context(whole, sharded, chain.get_epoch(kit.world.epoch2), address(kit, AGGREGATOR), "mean")


def test_a_shard_reads_its_fragment_of_a_verified_whole_model_only(kit: Kit) -> None:
    mixed = {"z": torch.arange(6, dtype=torch.int32).reshape(2, 3), "é": torch.ones(2, dtype=torch.bfloat16),
             "a": torch.randn(5, 1)}
    TrainingCheckpoints().save(kit.tmp / "mixed.safetensors", mixed, {"k": "v"})
    assert file_sha256(kit.tmp / "mixed.safetensors") == TrainingCheckpoints().sha256(mixed)
    assert file_sha256(kit.init_path) == kit.world.init_sha
    role = shard_role(SPEC, [b"\x01" * 20, b"\x02" * 20], b"\x02" * 20, "mean")
    assert role is not None
    got = load_fragment(TrainingCheckpoints(), kit.init_path, kit.world.init_sha, role, kit.init_path)
    assert set(got) == {"b"} and torch.equal(got["b"], initial_tensors()["b"])
    with pytest.raises(ShardMismatch, match=f"is not the checkpoint {'05' * 32}"):
        load_fragment(TrainingCheckpoints(), kit.init_path, b"\x05" * 32, role, kit.init_path)
    # A round's fragment file is checked through the recorded leaves against the root it must make.
    path = kit.tmp / "r1.safetensors"
    own = TrainingCheckpoints().save(path, {"b": torch.ones(3)}, {})
    (kit.tmp / "r1.fragments.json").write_text(json.dumps([("07" * 32), own.hex()]))
    root = fragment_root([b"\x07" * 32, own])
    assert torch.equal(load_fragment(TrainingCheckpoints(), path, root, role, kit.init_path)["b"], torch.ones(3))
    with pytest.raises(ShardMismatch, match="its recorded fragment hashes do not make the root"):
        load_fragment(TrainingCheckpoints(), path, own, role, kit.init_path)


def test_a_shard_hashes_the_whole_initial_model_once_however_often_its_close_runs(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close waiting on the other shards runs again each tick; the whole initial checkpoint (4.8 GB
    at 1.2B parameters) is hashed the first time only, and again once the file is replaced, or
    rewritten in place with its modification time set back."""
    hashed: list[str] = []
    real = shard_close._canonical_sha256_of
    monkeypatch.setattr(shard_close, "_canonical_sha256_of", lambda f: hashed.append(f.name) or real(f))
    role = shard_role(SPEC, [b"\x01" * 20, b"\x02" * 20], b"\x02" * 20, "mean")
    assert role is not None
    path = kit.tmp / "initial.safetensors"
    sha = TrainingCheckpoints().save(path, initial_tensors(), {})
    for _ in range(3):
        assert torch.equal(load_fragment(TrainingCheckpoints(), path, sha, role, path)["b"], initial_tensors()["b"])
    assert hashed == [str(path)]
    TrainingCheckpoints().save(path, {**initial_tensors(), "b": torch.zeros(3)}, {})  # replaced: a new file
    with pytest.raises(ShardMismatch, match=f"is not the checkpoint {sha.hex()}"):
        load_fragment(TrainingCheckpoints(), path, sha, role, path)
    assert len(hashed) == 2
    # Rewritten in place, same size, its modification time put back: the change time still differs.
    good = kit.tmp / "good.safetensors"
    TrainingCheckpoints().save(good, initial_tensors(), {})
    assert torch.equal(load_fragment(TrainingCheckpoints(), good, sha, role, good)["b"], initial_tensors()["b"])
    before = good.stat()
    bad = path.read_bytes()
    assert len(bad) == before.st_size
    with open(good, "r+b") as f:
        f.write(bad)
    os.utime(good, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ShardMismatch, match=f"is not the checkpoint {sha.hex()}"):
        load_fragment(TrainingCheckpoints(), good, sha, role, good)
    assert len(hashed) == 4
