"""`close.compute_outcome` and its checks pipeline on constructed rounds: a real store and payload files,
no chain, no server. Each check's verdict (copy, resubmission, departed, mixture, dissent), the outer
step and the files it writes, the pool split, the "nobody eligible" outcome, the public tensors' span,
and the score gate at its boundaries."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from eth_utils import to_checksum_address
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from chain.merkle import RewardTree
from gonka_node.aggregator.broadcast import Broadcast, residual_path
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.close import (
    MIN_SCORE_STEP,
    PUBLIC_ROUNDS,
    Closing,
    ClosingInputs,
    compute_outcome,
    equal_shares,
    gate,
    public_tensors,
    reward_tree,
    save_broadcast,
    score_step,
)
from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.robust import aggregate
from gonka_node.aggregator.scoring import ScoringData
from gonka_node.aggregator.store import Store, SubmissionRow
from gonka_node.aggregator.validate import count_sketch
from gonka_node.core.config import AggregationSettings
from training.checkpoint import CheckpointError, load_checkpoint
from training.codecs import get_codec, round_seed
from training.data import Windows
from training.hf_export import MODEL_CONFIG_KEY

SPEC = {"b": (16,), "w": (16, 16)}
POOL = 1003  # four eligible hosts: 250 each, 3 ngonka of dust unpaid
REGISTRY = b"\x11" * 20
MIX_BAR = 0.05


def addr(i: int) -> bytes:
    return bytes([i]) * 20


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(s, generator=g) for n, s in SPEC.items()}


def noise(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SPEC.items()}


DIRECTION = noise(100)


def honest(seed: int) -> dict[str, torch.Tensor]:
    """One round's honest updates share a direction, each with its own data's part."""
    own = noise(seed)
    return {n: 0.01 * (DIRECTION[n] + 0.6 * own[n]) for n in SPEC}


def norm(u: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in u.values()))


class Round:
    """A store with rounds open in epoch 1, the initial checkpoint, and submissions written as an upload
    leaves them (payload file, norm, sketch)."""

    def __init__(self, tmp: Path, round_: int = 1) -> None:
        self.tmp = tmp
        self.store = Store(tmp / "agg").open()
        self.init_path = tmp / "init.safetensors"
        self.init_sha = TrainingCheckpoints().save(self.init_path, base_tensors(), {"round": "0"})
        self.round = round_
        self.row = self.store.open_round(1, round_, self.init_sha, 10**13)

    def ctx(self, **changes: object) -> EpochContext:
        fields: dict[str, object] = dict(
            chain_id=31337, registry=REGISTRY, epoch=1, codec_name="fp32", codec=get_codec("fp32"),
            spec=SPEC, n_rounds=40, round_length_s=60.0, outer_lr=0.5,
            outer_momentum=0.5, reward_per_round=POOL, initial_checkpoint=self.init_path,
            initial_sha256=self.init_sha, model_config='{"dim": 16}',
        )
        fields.update(changes)
        return EpochContext(**fields)  # type: ignore[arg-type]

    def add(
        self, host: bytes, u: dict[str, torch.Tensor], started: int, round_: int | None = None, codec: str = "fp32"
    ) -> SubmissionRow:
        r = self.round if round_ is None else round_
        data = get_codec(codec).encode(u)
        part = self.store.incoming / f"{host.hex()}.part"
        part.write_bytes(data)
        row = SubmissionRow(
            1, r, host, hashlib.sha256(data).digest(), len(data), 64, started, b"s" * 64, started + 5,
            norm(u), count_sketch(u).numpy().tobytes(), str(self.store.payload_path(1, r, host)), started,
        )
        self.store.add_submission(row, part)
        return row

    def outcome(self, slots: dict[bytes, int], aggregation: AggregationSettings | None = None,
                earlier: list[SubmissionRow] | None = None, prev_outer_state: Path | None = None,
                ctx: EpochContext | None = None):  # type: ignore[no-untyped-def]
        return compute_outcome(ClosingInputs(
            ctx=ctx or self.ctx(), round_row=self.row, seed=b"\x07" * 32,
            submissions=self.store.submissions(1, self.round), slots=slots, base_path=self.init_path,
            earlier=earlier or [], prev_outer_state=prev_outer_state, store=self.store, checkpoints=TrainingCheckpoints(),
            aggregation=aggregation or AggregationSettings(rule="mean"),
        ))


def test_four_honest_hosts_are_aggregated_stepped_and_paid_equally(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    ups = {addr(i): honest(i) for i in (1, 2, 3, 4)}
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=100 + i)
    out = rd.outcome({h: i for i, h in enumerate(ups)})
    assert (out.rule, out.aggregated, out.total_reward, out.heldout) == ("mean", 4, 1000, None)
    mean = {n: torch.stack([u[n] for u in ups.values()]).mean(0) for n in SPEC}
    base = base_tensors()
    ckpt = load_checkpoint(rd.store.checkpoint_path(1, 1), expected_sha256=out.checkpoint_sha256.hex())
    for n in SPEC:  # Nesterov, first step: θ − lr·(Δ + μ·Δ)
        torch.testing.assert_close(ckpt.tensors[n], base[n] - 0.5 * 1.5 * mean[n], rtol=0, atol=1e-6)
    assert ckpt.metadata == {
        "epoch": "1", "round": "1", "base_sha256": rd.init_sha.hex(), "rule": "mean", MODEL_CONFIG_KEY: '{"dim": 16}'
    }
    agg_file = load_checkpoint(rd.store.update_path(1, 1))
    assert agg_file.metadata == ckpt.metadata  # the aggregate says which round and base it belongs to
    agg = agg_file.tensors
    for n in SPEC:
        torch.testing.assert_close(agg[n], mean[n], rtol=0, atol=1e-7)
    sketch = rd.store.update_path(1, 1).with_suffix(".sketch").read_bytes()
    assert sketch == count_sketch(agg).numpy().tobytes()
    with safe_open(str(rd.store.outer_state_path(1, 1)), "pt") as f:
        assert f.metadata() == {"steps": "1"}
        for n in SPEC:
            torch.testing.assert_close(f.get_tensor(n), mean[n], rtol=0, atol=1e-7)
    assert [(c.host, c.score, c.reward, c.aggregated) for c in out.contributions] == [
        (h, 1.0, 250, True) for h in sorted(ups)
    ]
    for c in out.contributions:
        assert c.reasons[0] == "mix check: sketch residual " + c.reasons[0].split()[4] + f" (bar {MIX_BAR:g})"
        assert float(c.reasons[0].split()[4]) > MIX_BAR
        assert c.reasons[1:] == ["scoring disabled for this epoch: every valid update scores 1"]
    tree = RewardTree(31337, to_checksum_address(REGISTRY), 1, 1, [(to_checksum_address(h), 250) for h in sorted(ups)])
    assert out.rewards_root == tree.root
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_next_round_steps_on_from_the_stored_momentum(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    ups = [honest(i) for i in (1, 2)]
    for i, u in enumerate(ups):
        rd.add(addr(i + 1), u, started=i)
    slots = {addr(1): 0, addr(2): 1}
    first = rd.outcome(slots, AggregationSettings(rule="mean", consensus_fraction=0.0))
    rd.store.record_finalize_intent(1, 1, "finalizing", first.checkpoint_sha256, first.rewards_root,
                                    first.total_reward, "mean", first.contributions)
    rd.store.mark_finalized(1, 1, b"")
    rd.round = 2
    rd.row = rd.store.open_round(1, 2, first.checkpoint_sha256, 10**13)
    ups2 = [honest(i) for i in (5, 6)]
    for i, u in enumerate(ups2):
        rd.add(addr(i + 1), u, started=10 + i)
    second = compute_outcome(ClosingInputs(
        ctx=rd.ctx(), round_row=rd.row, seed=b"\x07" * 32, submissions=rd.store.submissions(1, 2), slots=slots,
        base_path=rd.store.checkpoint_path(1, 1), earlier=rd.store.submissions(1, 1),
        prev_outer_state=rd.store.outer_state_path(1, 1), store=rd.store, checkpoints=TrainingCheckpoints(),
        aggregation=AggregationSettings(rule="mean", consensus_fraction=0.0),
    ))
    m1 = {n: (ups[0][n] + ups[1][n]) / 2 for n in SPEC}
    m2 = {n: (ups2[0][n] + ups2[1][n]) / 2 for n in SPEC}
    theta1 = load_checkpoint(rd.store.checkpoint_path(1, 1)).tensors
    got = load_checkpoint(rd.store.checkpoint_path(1, 2), expected_sha256=second.checkpoint_sha256.hex()).tensors
    for n in SPEC:
        buf = 0.5 * m1[n] + m2[n]
        torch.testing.assert_close(got[n], theta1[n] - 0.5 * (m2[n] + 0.5 * buf), rtol=0, atol=1e-6)
    with safe_open(str(rd.store.outer_state_path(1, 2)), "pt") as f:
        assert f.metadata() == {"steps": "2"}
    # Round 2's public tensors: its base model and round 1's aggregate.
    labels = [label for label, _ in public_tensors(rd.store, 1, 2, theta1)]
    assert labels == ["the base model", "round 1's aggregate"]


def test_each_check_excludes_its_host_with_its_reason_and_the_rest_share_the_pool(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    a, b, c, d, e, f, g, h, i = (addr(k) for k in range(1, 10))
    old_g = honest(70)
    earlier = [dataclasses.replace(rd.add(g, old_g, started=0, round_=1), round=0)]
    rd.store.close()
    rd.__init__(tmp_path / "r2", round_=2)  # type: ignore[misc]
    rd.add(a, honest(1), started=10)
    rd.add(b, honest(2), started=11)
    rd.add(h, honest(8), started=12)
    rd.add(i, honest(9), started=13)
    rd.add(c, honest(1), started=14)  # a's update, header later: a copy
    rd.add(d, honest(4), started=15)  # left the epoch
    rd.add(e, {n: torch.zeros(s) for n, s in SPEC.items()}, started=16)  # nothing trained
    rd.add(f, {n: -1.0 * t for n, t in honest(6).items()}, started=17)  # points against everyone
    rd.add(g, old_g, started=18)  # its own update of an earlier round
    slots = {x: k for k, x in enumerate((a, b, c, e, f, g, h, i))}
    out = rd.outcome(slots, earlier=earlier)
    rows = {r.host: r for r in out.contributions}
    assert {x for x, r in rows.items() if r.aggregated} == {a, b, h, i}
    assert {x: r.reward for x, r in rows.items()} == {a: 250, b: 250, h: 250, i: 250, c: 0, d: 0, e: 0, f: 0, g: 0}
    assert out.aggregated == 4 and out.total_reward == 1000
    assert rows[c].reasons[0] == f"copy: sketch cosine 1.0000 with 0x{a.hex()}, whose header arrived earlier"
    assert rows[d].reasons[0] == "host is no longer signed in to the epoch (left or slashed)"
    assert rows[e].reasons[0] == "mix: a zero update: no training of its own"
    assert rows[f].reasons[-2].startswith("dissent: sketch cosine -")
    assert rows[g].reasons[0].startswith(f"copy: sketch cosine 1.0000 with 0x{g.hex()}, round 0 (its own earlier")
    for x in (c, d, e, f, g):
        assert len([r for r in rows[x].reasons if not r.startswith(("mix check", "scoring"))]) == 1, rows[x].reasons


def test_a_mix_of_two_earlier_updates_is_excluded_but_not_its_sources(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    ua, ub = honest(1), honest(2)
    rd.add(addr(1), ua, started=1)
    rd.add(addr(2), ub, started=2)
    rd.add(addr(3), {n: 0.5 * ua[n] + 0.5 * ub[n] for n in SPEC}, started=3)
    out = rd.outcome({addr(k): k for k in (1, 2, 3)}, AggregationSettings(rule="mean", copy_cosine=1.0))
    rows = {r.host: r for r in out.contributions}
    assert rows[addr(3)].reasons[0].startswith("mix: sketch residual 0.0000 outside the span of the earlier-arrived")
    assert not rows[addr(3)].aggregated and rows[addr(1)].aggregated and rows[addr(2)].aggregated
    assert out.total_reward == 2 * (POOL // 2)


def test_nobody_eligible_keeps_the_base_and_pays_nothing(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    rd.add(addr(1), {n: torch.zeros(s) for n, s in SPEC.items()}, started=1)
    rd.add(addr(2), honest(2), started=2)
    out = rd.outcome({addr(1): 0})  # addr(2) has left
    assert (out.checkpoint_sha256, out.rewards_root, out.total_reward, out.rule, out.aggregated) == (
        rd.init_sha, bytes(32), 0, "mean", 0
    )
    assert [(c.host, c.score, c.reward, c.aggregated) for c in out.contributions] == [
        (addr(1), 1.0, 0, False), (addr(2), 1.0, 0, False)
    ]
    assert not rd.store.checkpoint_path(1, 1).exists()


def test_public_tensors_span_the_base_and_the_latest_sixteen_aggregates(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    base = base_tensors()
    for r in range(1, PUBLIC_ROUNDS + 2):
        path = rd.store.update_path(1, r).with_suffix(".sketch")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(count_sketch(noise(r)).numpy().tobytes())
    got = public_tensors(rd.store, 1, PUBLIC_ROUNDS + 2, base)
    assert [label for label, _ in got] == ["the base model"] + [f"round {r}'s aggregate" for r in range(17, 1, -1)]
    torch.testing.assert_close(got[0][1], count_sketch(base))
    torch.testing.assert_close(got[1][1], count_sketch(noise(17)))
    assert [label for label, _ in public_tensors(rd.store, 1, 1, base)] == ["the base model"]
    assert len(public_tensors(rd.store, 1, 3, base)) == 3  # rounds 2 and 1


def closing(tmp_path: Path, hosts: list[bytes], min_score: float = 0.0) -> Closing:
    rows = [SubmissionRow(1, 1, x, bytes(32), 1, 1, 1, b"", 1, 1.0, b"", "") for x in hosts]
    rd = Round(tmp_path)
    return Closing(rd.ctx(), rd.row, bytes(32), rows, [], {x: 0 for x in hosts}, {}, [], lambda s: {},
                   AggregationSettings(min_score=min_score))


def test_the_gate_excludes_vetoes_and_scores_at_or_below_the_bar_only_without_dissent(tmp_path: Path) -> None:
    z, a, b, c, d, e = (addr(k) for k in range(0, 6))
    cl = closing(tmp_path, [z, a, b, c, d, e], min_score=0.25)
    cl.vetoed = {z, b, e}
    cl.replayed = {z, e}  # replayed hosts are passed over, wherever they come in the round
    cl.excluded = {d}
    scores = {z: -1.0, a: 0.25, b: 1.0, c: 0.2500001, d: -1.0, e: -1.0}
    assert gate(cl, scores, consensus_checked=False) == {
        a: "score +0.25000 at or below 0.25: not aggregated",
        b: "vetoed: fits held-out data better than its assignment; not aggregated",
    }
    assert gate(cl, scores, consensus_checked=True) == {
        b: "vetoed: fits held-out data better than its assignment; not aggregated"
    }


def test_closing_records_each_hosts_first_exclusion_only(tmp_path: Path) -> None:
    a, b = addr(1), addr(2)
    cl = closing(tmp_path, [a, b])
    assert cl.reasons == {a: [], b: []}
    cl.exclude({a: "first"})
    cl.exclude({a: "second", b: "other"})
    assert cl.reasons == {a: ["first"], b: ["other"]} and cl.excluded == {a, b} and cl.live() == []


@pytest.mark.parametrize(
    ("lr", "n", "step"),
    [(0.7, 0, 0.7), (0.7, 1, 0.7), (0.7, 2, 0.35), (0.7, 14, 0.05), (0.7, 100, MIN_SCORE_STEP), (3.0, 1, 1.0),
     (1.0, 1, 1.0), (0.5, 5, 0.1)],
)
def test_score_step_is_the_updates_share_of_the_outer_step_within_its_bounds(lr: float, n: int, step: float) -> None:
    assert score_step(lr, n) == pytest.approx(step, rel=1e-12)


def test_the_pool_split_floors_and_ties_get_the_same_share() -> None:
    assert equal_shares(1003, [addr(1), addr(2), addr(3), addr(4)]) == dict.fromkeys(map(addr, (1, 2, 3, 4)), 250)
    assert equal_shares(3, [addr(1), addr(2), addr(3)]) == dict.fromkeys(map(addr, (1, 2, 3)), 1)
    assert equal_shares(2, [addr(1), addr(2), addr(3)]) == {}
    assert equal_shares(-5, [addr(1)]) == {} and equal_shares(1, []) == {}
    assert equal_shares(1, [addr(1)]) == {addr(1): 1}


def test_json_reasons_round_trip(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    rd.add(addr(1), honest(1), started=1)
    out = rd.outcome({addr(1): 0})
    rd.store.record_finalize_intent(1, 1, "finalizing", out.checkpoint_sha256, out.rewards_root, out.total_reward,
                                    out.rule, out.contributions)
    assert json.loads(json.dumps(rd.store.contributions(1, 1)[0].reasons)) == out.contributions[0].reasons


@pytest.mark.parametrize(("rule", "iters"), [("clip_median", 3), ("centered_clip", 1), ("centered_clip", 3)])
def test_the_epochs_rule_aggregates_with_the_stored_norms(tmp_path: Path, rule: str, iters: int) -> None:
    rd = Round(tmp_path)
    ups = {addr(i): honest(i) for i in (1, 2, 3)}
    ups[addr(4)] = {n: 40 * t for n, t in honest(4).items()}  # one long update: the rules clip it
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=i)
    settings = AggregationSettings(rule=rule, centered_clip_iters=iters)
    out = rd.outcome({h: i for i, h in enumerate(ups)}, settings)
    want = aggregate(rule, lambda: iter(sorted((h.hex(), u) for h, u in ups.items())),
                     {h.hex(): norm(u) for h, u in ups.items()}, SPEC, iters).update
    other = aggregate(rule, lambda: iter(sorted((h.hex(), u) for h, u in ups.items())),
                      {h.hex(): norm(u) for h, u in ups.items()}, SPEC, 4 - iters).update
    got = load_checkpoint(rd.store.update_path(1, 1)).tensors
    for n in SPEC:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-7)
    assert rule == "clip_median" or any(not torch.allclose(want[n], other[n], rtol=0, atol=1e-7) for n in SPEC)
    assert out.rule == rule and out.aggregated == 4


@pytest.mark.parametrize(("n_hosts", "fraction", "aggregated"), [(4, 0.25, 4), (3, 0.25, 0), (4, 0.0, 0)])
def test_the_score_bar_applies_only_where_dissent_could_not_run(
    tmp_path: Path, n_hosts: int, fraction: float, aggregated: int
) -> None:
    rd = Round(tmp_path)
    for i in range(1, n_hosts + 1):
        rd.add(addr(i), honest(i), started=i)
    # Scoring is off (every update scores 1): a bar of 1 excludes them all, unless the dissent check ran.
    out = rd.outcome({addr(i): i for i in range(1, n_hosts + 1)},
                     AggregationSettings(rule="mean", min_score=1.0, consensus_fraction=fraction))
    assert out.aggregated == aggregated
    if not aggregated:
        assert all(c.reasons[-1] == "score +1.00000 at or below 1.0: not aggregated" for c in out.contributions)


def test_without_a_model_config_the_checkpoint_has_none_and_half_configured_scoring_is_off(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    rd.add(addr(1), honest(1), started=1)
    windows = Windows(np.arange(4000, dtype=np.int64) % 256, 8, heldout_fraction=0.1)
    ctx = rd.ctx(model_config=None, scoring=ScoringData(windows, 1, 8, 2, 2))  # no model_factory
    out = rd.outcome({addr(1): 0}, ctx=ctx)
    ckpt = load_checkpoint(rd.store.checkpoint_path(1, 1))
    assert MODEL_CONFIG_KEY not in ckpt.metadata and ckpt.metadata["rule"] == "mean"
    assert out.heldout is None and out.contributions[0].score == 1.0
    assert out.contributions[0].reasons[-1] == "scoring disabled for this epoch: every valid update scores 1"


def test_a_pool_too_small_to_pay_aggregates_and_commits_an_empty_root(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    for i in (1, 2, 3):
        rd.add(addr(i), honest(i), started=i)
    out = rd.outcome({addr(i): i for i in (1, 2, 3)}, ctx=rd.ctx(reward_per_round=2))  # < 1 ngonka each
    assert (out.aggregated, out.total_reward, out.rewards_root) == (3, 0, bytes(32))
    assert [(c.reward, c.aggregated) for c in out.contributions] == [(0, True)] * 3
    assert out.checkpoint_sha256 != rd.init_sha


def test_a_base_checkpoint_changed_on_disk_is_refused(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    rd.add(addr(1), honest(1), started=1)
    TrainingCheckpoints().save(rd.init_path, noise(3), {"round": "0"})  # not the round's base any more
    with pytest.raises(CheckpointError):
        rd.outcome({addr(1): 0})
    assert not rd.store.checkpoint_path(1, 1).exists()


def test_last_rounds_aggregate_sent_as_an_update_is_a_reuse_of_public_tensors(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    rd.add(addr(1), honest(1), started=1)
    rd.add(addr(2), honest(2), started=2)
    settings = AggregationSettings(rule="mean", consensus_fraction=0.0)
    first = rd.outcome({addr(1): 0, addr(2): 1, addr(3): 2}, settings)
    rd.store.record_finalize_intent(1, 1, "finalizing", first.checkpoint_sha256, first.rewards_root,
                                    first.total_reward, "mean", first.contributions)
    rd.store.mark_finalized(1, 1, b"")
    rd.round, rd.init_path = 2, rd.store.checkpoint_path(1, 1)
    rd.row = rd.store.open_round(1, 2, first.checkpoint_sha256, 10**13)
    rd.add(addr(1), honest(11), started=11)
    rd.add(addr(2), honest(12), started=12)
    rd.add(addr(3), load_checkpoint(rd.store.update_path(1, 1)).tensors, started=13)  # round 1's aggregate
    out = rd.outcome({addr(1): 0, addr(2): 1, addr(3): 2}, settings)
    rows = {c.host: c for c in out.contributions}
    assert rows[addr(3)].reasons[0].startswith(
        "mix: sketch residual 0.0000 outside the span of public tensors (the base model, round 1's aggregate)"
    )
    assert not rows[addr(3)].aggregated and out.aggregated == 2


def test_the_epochs_own_rule_overrides_the_default(tmp_path: Path) -> None:
    rd = Round(tmp_path)
    for i in (1, 2):
        rd.add(addr(i), honest(i), started=i)
    out = rd.outcome({addr(1): 0, addr(2): 1}, AggregationSettings(rule="mean", per_epoch={1: "clip_median"}))
    assert out.rule == "clip_median" and load_checkpoint(rd.store.checkpoint_path(1, 1)).metadata["rule"] == "clip_median"


def test_the_reward_tree_holds_every_host_paid_down_to_one_ngonka_and_nobody_unpaid(tmp_path: Path) -> None:
    ctx = Round(tmp_path).ctx()
    rewards = {addr(1): 250, addr(2): 1, addr(3): 0}
    tree = reward_tree(ctx, 1, 2, rewards)
    want = RewardTree(31337, to_checksum_address(REGISTRY), 1, 2, [(to_checksum_address(addr(i)), a) for i, a in ((1, 250), (2, 1))])
    assert tree is not None and tree.root == want.root
    assert reward_tree(ctx, 1, 2, {addr(3): 0}) is None


def test_a_broadcast_is_saved_as_its_update_or_as_its_payload_with_the_residual_beside_it(tmp_path: Path) -> None:
    update = {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([1.0])}
    dense = tmp_path / "dense" / "update.safetensors"
    save_broadcast(dense, Broadcast(update), {"round": "3"})
    with safe_open(str(dense), "pt") as f:
        assert f.metadata() == {"round": "3"} and torch.equal(f.get_tensor("w"), update["w"])
    coded = tmp_path / "codec" / "update.bin"
    coded.parent.mkdir()
    residual = {"w": torch.tensor([0.125, 0.0]), "b": torch.tensor([-2.0])}
    save_broadcast(coded, Broadcast(update, b"\x07payload-bytes", residual), {"round": "4"})
    assert coded.read_bytes() == b"\x07payload-bytes"
    with safe_open(str(residual_path(coded)), "pt") as f:
        assert f.metadata() == {"round": "4"}
        assert {n: f.get_tensor(n).tolist() for n in sorted(f.keys())} == {"w": [0.125, 0.0], "b": [-2.0]}
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        ["update.safetensors", "update.bin", residual_path(coded).name])  # no temporary file left


def test_a_shared_mask_broadcast_is_sent_on_the_rounds_mask(tmp_path: Path) -> None:
    """With a shared-state codec (`mask`) the broadcast uses the round's codec, the one every host
    derives from the epoch seed and the round (`round_seed`): decoded with it, the update file is the
    update the outer step applied."""
    rd = Round(tmp_path)
    ctx = rd.ctx(codec_name="mask", codec=get_codec("mask"), broadcast="codec", epoch_seed=9)
    mask = ctx.codec_for(1)
    ups = {addr(i): honest(i) for i in (1, 2, 3)}
    for i, (h, u) in enumerate(ups.items()):
        data = mask.encode(u)
        part = rd.store.incoming / f"{h.hex()}.part"
        part.write_bytes(data)
        rd.store.add_submission(SubmissionRow(
            1, 1, h, hashlib.sha256(data).digest(), len(data), 64, 100 + i, b"s" * 64, 105 + i, norm(u),
            count_sketch(u).numpy().tobytes(), str(rd.store.payload_path(1, 1, h)), 100 + i,
        ), part)
    out = rd.outcome({h: i for i, h in enumerate(ups)}, ctx=ctx)
    assert out.aggregated == 3
    sent = mask.decode(rd.store.update_path(1, 1).read_bytes(), SPEC)
    assert mask.seed == round_seed(9, 1) % 2**32 and any(float(t.abs().max()) > 0 for t in sent.values())
    with safe_open(str(rd.store.outer_state_path(1, 1)), "pt") as f:
        for n in SPEC:
            torch.testing.assert_close(f.get_tensor(n), sent[n].float(), rtol=0, atol=0)


def test_a_codec_broadcast_carries_the_aggregate_plus_the_previous_residual_and_keeps_what_it_left_out(
    tmp_path: Path
) -> None:
    rd = Round(tmp_path)
    int8 = get_codec("int8")
    ups = {addr(i): honest(i) for i in (1, 2, 3, 4)}
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=100 + i, codec="int8")
    previous = tmp_path / "previous-residual.safetensors"
    carried = {n: torch.full(shape, 0.01 * (k + 1)) for k, (n, shape) in enumerate(sorted(SPEC.items()))}
    save_file(carried, str(previous))
    ctx = rd.ctx(codec_name="int8", codec=int8, broadcast="codec")
    out = compute_outcome(ClosingInputs(
        ctx=ctx, round_row=rd.row, seed=b"\x07" * 32, submissions=rd.store.submissions(1, 1),
        slots={h: i for i, h in enumerate(ups)}, base_path=rd.init_path, prev_outer_state=None,
        prev_residual=previous, store=rd.store, checkpoints=TrainingCheckpoints(),
        aggregation=AggregationSettings(rule="mean"),
    ))
    assert out.aggregated == 4
    update_file = rd.store.update_path(1, 1)
    sent = int8.decode(update_file.read_bytes(), SPEC)  # the file is the codec payload hosts download
    left = load_file(str(residual_path(update_file)))
    mean = {n: torch.stack([int8.decode(int8.encode(u), SPEC)[n] for u in ups.values()]).mean(0) for n in SPEC}
    for n in SPEC:  # error feedback: what was sent plus what is kept is the aggregate plus what was carried
        torch.testing.assert_close(sent[n].float() + left[n], mean[n] + carried[n], rtol=0, atol=1e-6)
        assert left[n].abs().max() > 0  # int8 left something out
    with safe_open(str(rd.store.outer_state_path(1, 1)), "pt") as f:  # the outer step took the decoded broadcast
        for n in SPEC:
            torch.testing.assert_close(f.get_tensor(n), sent[n].float(), rtol=0, atol=0)
