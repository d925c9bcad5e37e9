"""A close with a (micro) model: the replay check in the pipeline (who is picked, the verdict's reasons,
a mismatch excluded), the held-out score of each update as the gate sees it, and the held-out losses a
close reports; `replay_comparison` against its own replay. Real training steps, real files, no chain."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from micro_model import INNER, SEED, SEQ, SLOTS, micro_windows, model
from safetensors.torch import save_file

from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.close import (
    NOT_SAMPLED,
    Closing,
    ClosingInputs,
    RoundOutcome,
    _scores,
    compute_outcome,
    public_tensors,
    score_step,
)
from gonka_node.aggregator.eager import EagerBases
from gonka_node.aggregator.engine_types import EpochContext
from gonka_node.aggregator.replay import ReplayData, chosen_for_replay, replay_comparison, verdict
from gonka_node.aggregator.scoring import Scorer, ScoringData
from gonka_node.aggregator.store import Store, SubmissionRow
from gonka_node.aggregator.validate import count_sketch
from gonka_node.core.config import AggregationSettings
from training.codecs import get_codec
from training.data import Windows, window_seed
from training.diloco import OuterOptimizer, pseudo_gradient
from training.inner import InnerConfig, evaluate
from training.worker import Assignment, replay_round

POOL = 1000


@pytest.fixture(scope="module")
def windows() -> Windows:
    return micro_windows()


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model().named_parameters()}


def replayed(windows: Windows, base: dict[str, torch.Tensor], slot: int) -> dict[str, torch.Tensor]:
    return replay_round(model(), INNER, windows, Assignment(SEED, slot, SLOTS), 1, base)


def addr(i: int) -> bytes:
    return bytes([i]) * 20


def norm(u: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in u.values()))


class ModelRound:
    def __init__(self, tmp: Path, windows: Windows, base: dict[str, torch.Tensor]) -> None:
        self.store = Store(tmp / "agg").open()
        self.init_path = tmp / "init.safetensors"
        self.init_sha = TrainingCheckpoints().save(self.init_path, base, {"round": "0"})
        self.row = self.store.open_round(1, 1, self.init_sha, 10**13)
        self.windows, self.base = windows, base
        self.scoring = ScoringData(windows, SEED, SLOTS, 4, 4)

    def add(self, host: bytes, u: dict[str, torch.Tensor], started: int) -> None:
        data = get_codec("fp32").encode(u)
        part = self.store.incoming / "x.part"
        part.write_bytes(data)
        self.store.add_submission(SubmissionRow(
            1, 1, host, hashlib.sha256(data).digest(), len(data), 64, started, b"", started, norm(u),
            count_sketch(u).numpy().tobytes(), str(self.store.payload_path(1, 1, host)), started,
        ), part)

    def outcome(self, slots: dict[bytes, int], p: float, replay: bool = True) -> RoundOutcome:
        return compute_outcome(ClosingInputs(
            ctx=self.context(p, replay), round_row=self.row, seed=b"\x03" * 32,
            submissions=self.store.submissions(1, 1), slots=slots, base_path=self.init_path, prev_outer_state=None,
            store=self.store, checkpoints=TrainingCheckpoints(), aggregation=AggregationSettings(rule="mean"),
        ))

    def context(self, p: float, replay: bool = True) -> EpochContext:
        return EpochContext(
            chain_id=31337, registry=b"\x11" * 20, epoch=1, codec_name="fp32", codec=get_codec("fp32"),
            spec={n: tuple(t.shape) for n, t in self.base.items()}, n_rounds=4,
            round_length_s=60.0, outer_lr=0.5, outer_momentum=0.5, reward_per_round=POOL,
            initial_checkpoint=self.init_path, initial_sha256=self.init_sha, epoch_seed=SEED, model_factory=model,
            scoring=self.scoring, replay=ReplayData(model, INNER, self.windows, SEED, SLOTS) if replay else None,
            replay_probability=p,
        )

    def expected_score(self, u: dict[str, torch.Tensor], tau: float, n_live: int, slot: int, veto: bool) -> float:
        scorer = Scorer(model(), self.base, self.scoring.heldout(1, self.init_sha), "heldout_gain")
        factor = torch.tensor(min(1.0, tau / norm(u)) * score_step(0.5, n_live), dtype=torch.float32)
        return scorer.score({n: t * factor for n, t in u.items()}, self.scoring.assigned(1, slot), veto=veto).score


def test_replayed_hosts_pass_or_are_excluded_and_the_rest_is_scored(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    ups = {addr(i): replayed(windows, base, i) for i in (1, 2, 3)}
    cheat = {n: 2 * t for n, t in replayed(windows, base, 4).items()}  # the replay's direction, twice as long
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=i)
    rd.add(addr(4), cheat, started=9)
    with caplog.at_level(logging.WARNING, "gonka_node.aggregator.close"):
        out = rd.outcome({addr(i): i for i in (1, 2, 3, 4)}, p=1.0)
    rows = {c.host: c for c in out.contributions}
    for i in (1, 2, 3):
        assert rows[addr(i)].reasons[0] == (
            f"replay: cosine +1.0000, norm ratio 1.0000 with the replay of slot {i}'s round 1"
        )
        assert (rows[addr(i)].aggregated, rows[addr(i)].reward) == (True, POOL // 3)
    mismatch = rows[addr(4)].reasons[0]
    assert mismatch.startswith("replay mismatch: cosine +1.0000, norm ratio 2.0000 with the replay of slot 4's round 1")
    assert (rows[addr(4)].aggregated, rows[addr(4)].reward, rows[addr(4)].score) == (False, 0, 0.0)
    assert caplog.messages == [f"round 1: host 0x{addr(4).hex()} excluded: {mismatch}"]
    tau = float(np.median([norm(u) for u in ups.values()]))
    for i, (h, u) in enumerate(ups.items(), start=1):
        assert rows[h].score == rd.expected_score(u, tau, 3, i, veto=False)
        assert rows[h].score != 0.0
    # The held-out losses: the base model's and the new checkpoint's, on the round's held-out windows.
    batch = rd.scoring.heldout(1, rd.init_sha)
    new = TrainingCheckpoints().load(rd.store.checkpoint_path(1, 1), out.checkpoint_sha256)

    def loss(params: dict[str, torch.Tensor]) -> float:
        m = model()
        m.load_state_dict(params)
        return evaluate(m, [batch], autocast="off")

    assert out.heldout == (loss(base), loss(new))
    assert out.heldout[1] != out.heldout[0]


def test_under_eager_overlap_each_host_is_replayed_from_its_own_eager_base(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    """With overlap "eager" a host trains round r from its own base: round r's base stepped with its own
    payload of round r − 1 (aggregator/eager.py). The replay starts from that base, so honest hosts
    whose bases differ both pass (from the round's base alone their updates would not match)."""
    rd = ModelRound(tmp_path, windows, base)
    fp32, previous = get_codec("fp32"), {}
    for i in (1, 2):
        previous[addr(i)] = tmp_path / f"previous-{i}.bin"
        previous[addr(i)].write_bytes(fp32.encode({n: 0.05 * i * torch.ones_like(t) for n, t in base.items()}))
    eager = EagerBases(fp32, {n: tuple(t.shape) for n, t in base.items()}, 0.5, 0.5, None, previous)
    for i in (1, 2):
        start, rebases = eager.base_for(base, addr(i))
        assert rebases == []
        own = replay_round(model(), INNER, windows, Assignment(SEED, i, SLOTS), 1, start)
        rd.add(addr(i), own, started=i)
    out = compute_outcome(ClosingInputs(
        ctx=rd.context(1.0), round_row=rd.row, seed=b"\x03" * 32, submissions=rd.store.submissions(1, 1),
        slots={addr(1): 1, addr(2): 2}, base_path=rd.init_path, prev_outer_state=None, store=rd.store,
        checkpoints=TrainingCheckpoints(), aggregation=AggregationSettings(rule="mean"), eager=eager,
    ))
    rows = {c.host: c for c in out.contributions}
    assert [(rows[addr(i)].reasons[0], rows[addr(i)].aggregated) for i in (1, 2)] == [
        (f"replay: cosine +1.0000, norm ratio 1.0000 with the replay of slot {i}'s round 1", True) for i in (1, 2)
    ]


@pytest.mark.parametrize("moves", [{"forecast_step": 1}, {"merge_step": 1}])
def test_an_eager_round_that_moves_late_onto_its_forecast_or_merges_is_replayed_with_the_same_moves(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor], moves: dict[str, int]
) -> None:
    """With the recipe's `forecast_step` a host trains its first steps from the outer step with an all-zero
    update, then moves onto its forecast; with `merge_step` it moves onto the model after r − 1 and
    measures from it. The replay makes the same moves: the honest host passes, one that trained from its
    forecast throughout (the plain eager rule) fails."""
    rd = ModelRound(tmp_path, windows, base)
    fp32, spec = get_codec("fp32"), {n: tuple(t.shape) for n, t in base.items()}
    previous = {addr(i): tmp_path / f"previous-{i}.bin" for i in (1, 2)}
    for i, path in enumerate(previous.values(), start=1):
        path.write_bytes(fp32.encode({n: 0.05 * i * torch.ones_like(t) for n, t in base.items()}))
    outer = tmp_path / "outer.safetensors"  # momentum after round r − 2: the zero-update step moves the model
    momentum = OuterOptimizer(0.5, 0.5)
    momentum.step({n: t.clone() for n, t in base.items()}, {n: 0.02 * torch.ones_like(t) for n, t in base.items()})
    save_file(dict(momentum.buffers), str(outer), metadata={"steps": str(momentum.steps)})
    after = {n: t + 0.03 for n, t in base.items()}  # the model after r − 1, which a merge moves onto
    eager = EagerBases(fp32, spec, 0.5, 0.5, outer, previous, after_previous=lambda: after, **moves)
    plain = EagerBases(fp32, spec, 0.5, 0.5, outer, previous)
    for i in (1, 2):
        start, rebases = (eager if i == 1 else plain).base_for(base, addr(i))
        rd.add(addr(i), replay_round(model(), INNER, windows, Assignment(SEED, i, SLOTS), 1, start, rebases=rebases),
               started=i)
    start, rebases = eager.base_for(base, addr(1))
    assert [r.step for r in rebases] == [1]
    forecast = plain.base_for(base, addr(1))[0]
    own = {n: 0.05 * torch.ones_like(t) for n, t in base.items()}  # host 1's payload of round r − 1
    outer = OuterOptimizer(0.5, 0.5)
    outer.restore(momentum.steps, momentum.buffers)
    expected = {n: t.clone() for n, t in base.items()}
    outer.step(expected, own)
    assert all(torch.equal(forecast[n], expected[n]) for n in base)
    if "forecast_step" in moves:  # from the momentum part of the step, moved onto the forecast
        zero_step = {n: t.clone() for n, t in base.items()}
        outer.restore(momentum.steps, momentum.buffers)
        outer.step(zero_step, {n: torch.zeros_like(t) for n, t in base.items()})
        assert all(torch.equal(start[n], zero_step[n]) and not torch.equal(start[n], forecast[n]) for n in base)
        assert all(torch.equal(rebases[0].target()[n], forecast[n]) for n in base)
    else:  # from the forecast itself, moved onto the model after r − 1
        assert all(torch.equal(start[n], forecast[n]) for n in base)
        assert rebases[0].target() is after
    out = compute_outcome(ClosingInputs(
        ctx=rd.context(1.0), round_row=rd.row, seed=b"\x03" * 32, submissions=rd.store.submissions(1, 1),
        slots={addr(1): 1, addr(2): 2}, base_path=rd.init_path, prev_outer_state=None, store=rd.store,
        checkpoints=TrainingCheckpoints(), aggregation=AggregationSettings(rule="mean"), eager=eager,
    ))
    rows = {c.host: c for c in out.contributions}
    assert (rows[addr(1)].reasons[0], rows[addr(1)].aggregated) == (
        "replay: cosine +1.0000, norm ratio 1.0000 with the replay of slot 1's round 1", True)
    assert rows[addr(2)].reasons[0].startswith("replay mismatch: ") and not rows[addr(2)].aggregated


def test_only_the_picked_hosts_are_replayed_and_none_without_replay_data(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    hosts = [addr(i) for i in (1, 2, 3)]
    for i, h in enumerate(hosts):
        rd.add(h, replayed(windows, base, i + 1), started=i)
    slots = {h: i + 1 for i, h in enumerate(hosts)}
    picked = chosen_for_replay(0.5, b"\x03" * 32, 1, hosts)
    assert 0 < len(picked) < 3  # this seed picks some, not all
    out = rd.outcome(slots, p=0.5)
    assert {c.host for c in out.contributions if c.reasons[0].startswith("replay:")} == picked
    for p, replay in ((0.0, True), (1.0, False)):
        out = rd.outcome(slots, p=p, replay=replay)
        assert not any(r.startswith("replay") for c in out.contributions for r in c.reasons)
    # Without replays the scores veto and gate as statistics: every host here scores on its own.
    tau = float(np.median([norm(replayed(windows, base, i)) for i in (1, 2, 3)]))
    rows = {c.host: c for c in out.contributions}
    for h in hosts:
        want = rd.expected_score(replayed(windows, base, slots[h]), tau, 3, slots[h], veto=True)
        assert rows[h].score == want


def test_replay_comparison_measures_direction_and_length(windows: Windows, base: dict[str, torch.Tensor]) -> None:
    data = ReplayData(model, INNER, windows, SEED, SLOTS)
    own = replayed(windows, base, 2)
    assert replay_comparison(data, 1, 2, base, own) == (pytest.approx(1.0, abs=1e-12), 1.0)
    cos, ratio = replay_comparison(data, 1, 2, base, {n: -3 * t for n, t in own.items()})
    assert cos == pytest.approx(-1.0, abs=1e-12) and ratio == pytest.approx(3.0, rel=1e-6)
    other = replayed(windows, base, 5)
    cos, ratio = replay_comparison(data, 1, 2, base, other)
    flat = [torch.cat([u[n].double().flatten() for n in sorted(own)]) for u in (other, own)]
    assert cos == pytest.approx(float(flat[0] @ flat[1] / (flat[0].norm() * flat[1].norm())), rel=1e-9)
    assert ratio == pytest.approx(float(flat[0].norm() / flat[1].norm()), rel=1e-9)
    assert cos < 0.99  # another slot's round is not this one's
    cos2, _ = replay_comparison(data, 2, 2, base, own)  # the same update is not round 2's replay
    assert cos2 < 0.9999


def test_replay_comparison_replays_the_assignment_the_beacon_decided(
    windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    """Where the recipe mixes the post-sign-in beacon into the window assignment, the replay trains on
    the windows the host was assigned under that beacon, not those of the epoch seed alone."""
    beacon = b"\x42" * 32
    data = ReplayData(model, INNER, windows, SEED, SLOTS, beacon=lambda: beacon)
    own = replay_round(model(), INNER, windows, Assignment(SEED, 2, SLOTS, beacon), 1, base)
    assert replay_comparison(data, 1, 2, base, own) == (pytest.approx(1.0, abs=1e-12), 1.0)
    cos, _ = replay_comparison(ReplayData(model, INNER, windows, SEED, SLOTS), 1, 2, base, own)
    assert cos < 0.99  # the beacon's windows are not the epoch seed's


def trained_on(batch: tuple[torch.Tensor, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a host that trained on `batch` (not its assignment) sends: Δ = θ_base − θ_local."""
    m = model()
    m.load_state_dict(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(8):
        opt.zero_grad()
        m.loss(*batch).backward()
        opt.step()
    return pseudo_gradient(base, dict(m.named_parameters()))


def test_a_host_that_trained_on_the_heldout_windows_is_vetoed_unless_replayed(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    for i in (1, 2, 3):
        rd.add(addr(i), replayed(windows, base, i), started=i)
    rd.add(addr(4), trained_on(rd.scoring.heldout(1, rd.init_sha), base), started=9)
    slots = {addr(i): i for i in (1, 2, 3, 4)}
    out = rd.outcome(slots, p=0.0)
    rows = {c.host: c for c in out.contributions}
    assert rows[addr(4)].reasons[-1] == "vetoed: fits held-out data better than its assignment; not aggregated"
    assert not rows[addr(4)].aggregated and rows[addr(4)].score <= 0.0 and out.aggregated == 3
    assert all(rows[addr(i)].aggregated for i in (1, 2, 3))


def test_scores_under_the_assignment_gap_rule_take_the_whole_clipped_update(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    ups = {addr(i): replayed(windows, base, i) for i in (1, 2)}
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=i)
    ctx_rule = AggregationSettings(rule="mean", score_rule="assignment_gap")
    out = compute_outcome(ClosingInputs(
        ctx=rd.context(p=0.0), round_row=rd.row, seed=b"\x03" * 32, submissions=rd.store.submissions(1, 1),
        slots={addr(1): 1, addr(2): 2}, base_path=rd.init_path, prev_outer_state=None, store=rd.store,
        checkpoints=TrainingCheckpoints(), aggregation=ctx_rule,
    ))
    tau = float(np.median([norm(u) for u in ups.values()]))
    heldout = rd.scoring.heldout(1, rd.init_sha)
    for c in out.contributions:
        u, slot = ups[c.host], int(c.host[0])
        factor = torch.tensor(min(1.0, tau / norm(u)), dtype=torch.float32)
        want = Scorer(model(), base, heldout, "assignment_gap").score(
            {n: t * factor for n, t in u.items()}, rd.scoring.assigned(1, slot), veto=True
        )
        assert c.score == want.score


def test_nothing_is_scored_when_every_host_has_left(tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]) -> None:
    rd = ModelRound(tmp_path, windows, base)
    rd.add(addr(1), replayed(windows, base, 1), started=1)
    out = rd.outcome({}, p=1.0)
    assert [(c.score, c.reward, c.aggregated) for c in out.contributions] == [(0.0, 0, False)]
    assert out.aggregated == 0 and out.heldout is None


def test_a_short_replay_is_compared_by_ratio_not_clamped(windows: Windows, base: dict[str, torch.Tensor]) -> None:
    gentle = InnerConfig(steps=2, lr=1e-5, warmup_steps=0, total_steps=6, micro_batch=4, seq_len=SEQ,
                         round_state="fresh")
    data = ReplayData(model, gentle, windows, SEED, SLOTS)
    own = replay_round(model(), gentle, windows, Assignment(SEED, 3, SLOTS), 1, base)
    assert 0 < norm(own) < 1  # a replay shorter than 1: the ratio is still |update| / |replay|
    cos, ratio = replay_comparison(data, 1, 3, base, {n: 0.5 * t for n, t in own.items()})
    assert cos == pytest.approx(1.0, abs=1e-9) and ratio == pytest.approx(0.5, rel=1e-9)


def test_a_replay_that_comes_out_zero_has_an_infinite_ratio(windows: Windows, base: dict[str, torch.Tensor]) -> None:
    zeros = {n: torch.zeros_like(t) for n, t in base.items()}  # every gradient is exactly zero: no step
    data = ReplayData(model, INNER, windows, SEED, SLOTS)
    assert norm(replay_round(model(), INNER, windows, Assignment(SEED, 1, SLOTS), 1, zeros)) == 0.0
    cos, ratio = replay_comparison(data, 1, 1, zeros, replayed(windows, base, 1))
    assert ratio == float("inf") and cos == 0.0
    assert not verdict(1, 1, cos, ratio, 0.9, 0.1)[0]


def test_a_host_whose_replay_passed_is_not_excluded_by_a_statistic(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    for i in (1, 2, 3):
        rd.add(addr(i), replayed(windows, base, i), started=i)
    slots = {addr(i): i for i in (1, 2, 3)}
    strict = AggregationSettings(rule="mean", mix_residual=0.99)  # a bar every honest update fails

    def outcome(p: float) -> RoundOutcome:
        return compute_outcome(ClosingInputs(
            ctx=rd.context(p), round_row=rd.row, seed=b"\x03" * 32, submissions=rd.store.submissions(1, 1),
            slots=slots, base_path=rd.init_path, prev_outer_state=None, store=rd.store,
            checkpoints=TrainingCheckpoints(), aggregation=strict,
        ))

    unchecked = outcome(0.0)
    assert any(c.reasons[0].startswith("mix: ") and not c.aggregated for c in unchecked.contributions)
    checked = outcome(1.0)  # each replay reproduced its host's update: the mix statistic does not apply
    assert all(c.aggregated and c.reasons[0].startswith("replay: ") for c in checked.contributions)
    assert not any(r.startswith("mix: ") for c in checked.contributions for r in c.reasons)


def test_updates_shorter_than_one_are_scored_at_their_length(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    ups = {addr(i): {n: 0.01 * t for n, t in replayed(windows, base, i).items()} for i in (1, 2)}
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=i)
    assert all(0 < norm(u) < 1 for u in ups.values())
    out = rd.outcome({addr(1): 1, addr(2): 2}, p=0.0)
    tau = float(np.median([norm(u) for u in ups.values()]))
    for c in out.contributions:
        want = rd.expected_score(ups[c.host], tau, 2, int(c.host[0]), veto=True)
        assert c.score == want != 0.0


class SwappedWindows:
    """The scoring's view of `windows` with one slot's roles swapped: its held-out sample is the slot's
    training assignment, and its "assignment" is uniformly random bytes (no text at all). An honest host
    of that slot then looks, to the score, like one that trained on held-out data."""

    def __init__(self, windows: Windows, slot: int) -> None:
        self.windows, self.slot = windows, slot

    def _ids(self, slot: int) -> np.ndarray:
        return self.windows.assignment(epoch_seed=window_seed(SEED, b""), round_index=1, slot=slot, max_slots=SLOTS,
                                       windows_per_host=INNER.windows_per_round)

    def assignment(
        self, *, epoch_seed: int, round_index: int, slot: int, max_slots: int, windows_per_host: int
    ) -> np.ndarray:
        return -1 - self._ids(slot)  # marked: stacked as random bytes

    def sample_heldout(self, seed: int, n: int) -> np.ndarray:
        return self._ids(self.slot)[:n]

    def stack(self, ids: np.ndarray) -> torch.Tensor:
        if ids.min() >= 0:
            return self.windows.stack(ids)
        return torch.randint(0, 256, (len(ids), SEQ + 1), generator=torch.Generator().manual_seed(SEED))


def test_a_replayed_host_is_never_vetoed_even_where_the_statistic_would_veto_it(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    rd.scoring = ScoringData(SwappedWindows(windows, 4), SEED, SLOTS, 8, INNER.windows_per_round)
    own = replayed(windows, base, 4)
    rd.add(addr(4), own, started=1)
    statistic = Scorer(model(), base, rd.scoring.heldout(1, rd.init_sha), "heldout_gain").score(
        {n: t * score_step(0.5, 1) for n, t in own.items()}, rd.scoring.assigned(1, 4), veto=True
    )
    assert statistic.vetoed and statistic.score == 0.0  # what the score alone says of this honest host
    out = rd.outcome({addr(4): 4}, p=1.0)
    [c] = out.contributions
    assert c.reasons[0].startswith("replay: cosine +1.0000, norm ratio 1.0000")
    assert not any("better than its assignment" in r for r in c.reasons)
    assert (c.aggregated, c.reward, c.score) == (True, POOL, statistic.gain_heldout) and c.score > 0


def test_with_overlapping_rounds_the_step_and_the_losses_start_from_the_latest_global_model(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    own = replayed(windows, base, 1)
    rd.add(addr(1), own, started=1)
    g = torch.Generator().manual_seed(5)
    latest = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in base.items()}  # one round newer
    latest_path = tmp_path / "latest.safetensors"
    latest_sha = TrainingCheckpoints().save(latest_path, latest, {"round": "1"})
    out = compute_outcome(ClosingInputs(
        ctx=rd.context(p=1.0), round_row=rd.row, seed=b"\x03" * 32, submissions=rd.store.submissions(1, 1),
        slots={addr(1): 1}, base_path=rd.init_path, step_base=(latest_path, latest_sha), prev_outer_state=None,
        store=rd.store, checkpoints=TrainingCheckpoints(), aggregation=AggregationSettings(rule="mean"),
    ))
    assert out.aggregated == 1
    want = {n: t.clone() for n, t in latest.items()}
    OuterOptimizer(0.5, 0.5).step(want, own)  # the step applies to the latest model, not the training base
    new = TrainingCheckpoints().load(rd.store.checkpoint_path(1, 1), out.checkpoint_sha256)
    for n, t in want.items():
        torch.testing.assert_close(new[n], t, rtol=0, atol=1e-6)
    batch = rd.scoring.heldout(1, rd.init_sha)

    def loss(params: dict[str, torch.Tensor]) -> float:
        m = model()
        m.load_state_dict(params)
        return evaluate(m, [batch], autocast="off")

    assert out.heldout == (loss(latest), loss(new)) and loss(latest) != loss(base)


def test_a_sharded_verifier_scores_only_the_sampled_hosts_and_the_rest_score_one(
    tmp_path: Path, windows: Windows, base: dict[str, torch.Tensor]
) -> None:
    rd = ModelRound(tmp_path, windows, base)
    ups = {addr(i): {n: 0.01 * t for n, t in replayed(windows, base, i).items()} for i in (1, 2, 3)}
    for i, (h, u) in enumerate(ups.items()):
        rd.add(h, u, started=i)
    subs = rd.store.submissions(1, 1)

    def decode(sub: SubmissionRow) -> dict[str, torch.Tensor]:
        return {n: t.float() for n, t in get_codec("fp32").decode(Path(sub.path).read_bytes(), rd.context(0.0).spec).items()}

    c = Closing(rd.context(0.0, replay=False), rd.row, b"\x03" * 32, subs, [], {addr(i): i for i in (1, 2, 3)}, base,
                public_tensors(rd.store, 1, 1, base), decode, AggregationSettings(rule="mean"))
    scores = _scores(c, only={addr(2)})
    tau = float(np.median([norm(u) for u in ups.values()]))  # over every live host, sampled or not
    assert scores[addr(2)] == rd.expected_score(ups[addr(2)], tau, 3, 2, veto=True) != 1.0
    assert (scores[addr(1)], scores[addr(3)]) == (1.0, 1.0)
    assert c.reasons[addr(1)] == [NOT_SAMPLED] and c.reasons[addr(3)] == [NOT_SAMPLED]
    assert NOT_SAMPLED not in c.reasons[addr(2)] and c.reasons[addr(2)]
