"""The attacks of strangers (gonka_node/testing/adversary_open.py) against the real aggregator, chain and hosts.

Two epochs of two rounds, tiny model, three honest hosts each (host 1's uploads are the victim's):

- "takers" (round_state "carry", no replay check, so by the stake rule no rewards: what stops them is
  what the aggregator excludes without recomputing anything): `mix`, `aggregate_reuse`, `front_run`,
  `stall` (cap 10 s);
- "grinders" (round_state "fresh", replay probability 0.5, paid): `grind`, `scale3`, `scale_half`.
  Which hosts the replay picks is the round's commit–reveal seed, random in every run: each assertion
  holds whichever rounds are picked.

The first tests assert what each attack *did*, from the aggregator's store and the chain (the bytes it
sent, its timings, its tries); then whether the network stops it.
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path

import pytest
import torch
from eth_utils import to_checksum_address
from safetensors.torch import load_file
from test_adversary import tiny_recipe

from gonka_node.aggregator.store import Store, SubmissionRow
from gonka_node.testing.adversary import Outcome, predict_pick
from gonka_node.testing.adversary_open import nudged
from gonka_node.testing.adversary_tap import Tap
from gonka_node.testing.byzantine import GNK, EpochPlan, EpochReport, run_epoch
from proto.gonka.v1 import aggregator_pb2 as pb
from training.codecs import Codec, get_codec, round_seed
from training.model import build_model

torch.set_num_threads(1)
# The staller's own limit: the aggregator must end its stream well before. Its stream is held while the
# other hosts train and send, which a loaded machine stretched past 10 s; a close that waited for the
# staller would show a delay of about the cap, far above GRACE_S.
STALL_CAP_S = 60.0
GRACE_S = 20.0


class Epoch:
    """A finished epoch's report with its aggregator's store opened for reading."""

    def __init__(self, report: EpochReport, root: Path, recipe_seed: int, spec: dict[str, tuple[int, ...]]) -> None:
        self.report, self.root, self.seed, self.spec = report, root, recipe_seed, spec
        self.store = Store(root / "aggregator").open()
        self.who = {b: h for h, b in report.adversaries.items()}

    def codec(self, round_: int) -> Codec:
        return get_codec("int8").for_round(round_seed(self.seed, round_))

    def subs(self, round_: int) -> dict[str, SubmissionRow]:
        return {to_checksum_address(s.host): s for s in self.store.submissions(self.report.epoch, round_)}

    def payload(self, round_: int, host: str) -> bytes:
        return Path(self.subs(round_)[host].path).read_bytes()

    def outcomes(self, behaviour: str) -> list[Outcome]:
        return self.report.outcomes[self.who[behaviour]]


def _run(tmp: Path, adversaries: dict[int, str], round_state: str, p: float) -> Epoch:
    recipe = tiny_recipe(tmp, 2, round_state=round_state)
    paid = p > 0  # the stake rule: an epoch that replays nobody cannot pay
    plan = EpochPlan(recipe, hosts=3 + len(adversaries), adversaries=adversaries, stall_cap_s=STALL_CAP_S,
                     replay_probability=p, reward_per_round=100 * GNK if paid else 0,
                     stake=None if paid else 10 * GNK)
    report = run_epoch(plan, tmp / "e")
    spec = {n: tuple(p.shape) for n, p in build_model(recipe.model, recipe.init_seed).named_parameters()}
    return Epoch(report, tmp / "e", recipe.epoch_seed, spec)


@pytest.fixture(scope="module")
def takers(tmp_path_factory: pytest.TempPathFactory) -> Epoch:
    tmp = tmp_path_factory.mktemp("takers")
    return _run(tmp, {4: "mix", 5: "aggregate_reuse", 6: "front_run", 7: "stall"}, "carry", 0.0)


@pytest.fixture(scope="module")
def grinders(tmp_path_factory: pytest.TempPathFactory) -> Epoch:
    tmp = tmp_path_factory.mktemp("grinders")
    return _run(tmp, {4: "grind", 5: "scale3", 6: "scale_half"}, "fresh", 0.5)


# ---- what each attack did -----------------------------------------------------------------------


@pytest.mark.slow
def test_mix_sends_the_average_of_two_honest_updates(takers: Epoch) -> None:
    mixer = takers.who["mix"]
    for o in takers.outcomes("mix"):
        sources = [to_checksum_address(h) for h in o.facts["sources"]]
        assert len(set(sources)) == 2 and all(h not in takers.report.adversaries for h in sources)
        codec = takers.codec(o.round)
        a, b = (codec.decode(takers.payload(o.round, h), takers.spec) for h in sources)
        expected = codec.encode({n: 0.5 * (a[n] + b[n]) for n in a})
        assert o.accepted and takers.payload(o.round, mixer) == expected, o.round


@pytest.mark.slow
def test_aggregate_reuse_sends_the_served_update(takers: Epoch) -> None:
    host = takers.who["aggregate_reuse"]
    assert [o.accepted for o in takers.outcomes("aggregate_reuse")] == [True, True]
    first = takers.codec(1).decode(takers.payload(1, host), takers.spec)
    assert all(float(t.abs().max()) == 0.0 for t in first.values())  # round 1: nothing served yet
    served = load_file(str(takers.store.update_path(takers.report.epoch, 1)))
    assert takers.payload(2, host) == takers.codec(2).encode({n: served[n].float() for n in takers.spec})


@pytest.mark.slow
def test_front_run_finishes_before_the_victims_upload(takers: Epoch) -> None:
    runner, victim = takers.who["front_run"], takers.report.addresses[1]
    for r in (1, 2):
        tries = [o for o in takers.outcomes("front_run") if o.round == r]
        # An exact copy first; only if that is refused as a COPY, a copy perturbed by 1e-3 of its norm.
        assert [o.attack for o in tries] == ["front_run"] + (["front_run(perturbed)"] if tries[0].reason == "COPY" else [])
        last, subs = tries[-1], takers.subs(r)
        assert last.facts["victim_open_when_taken"] and last.facts["victim_accepted"]
        assert last.facts["finished_first"]  # its stream ended before the victim's
        if last.accepted:
            assert subs[runner].received_ms <= subs[victim].received_ms
        if tries[0].accepted:
            assert subs[runner].payload_sha256 == subs[victim].payload_sha256


@pytest.mark.slow
def test_stall_holds_half_a_stream_open_until_it_is_ended(takers: Epoch) -> None:
    outcomes = takers.outcomes("stall")
    assert [o.round for o in outcomes] == [1, 2]
    for o in outcomes:
        f = o.facts
        assert not o.accepted and o.reason == (f["reason"] or f["status"]) and f["half_bytes"] > 0
        assert takers.who["stall"] not in takers.subs(o.round)  # half a payload is never stored
        if f["ended_by"] == "cap":  # today: the aggregator waits for it; the staller cancels at its cap
            assert f["status"] == "CANCELLED" and f["held_s"] >= STALL_CAP_S - 0.05
        else:
            assert f["ended_by"] == "server" and f["status"] != "OK" and f["held_s"] < STALL_CAP_S
    assert sorted(takers.report.close_delay_s) == [1, 2]


@pytest.mark.slow
def test_grind_finds_nothing_to_grind(grinders: Epoch) -> None:
    """The pick is the round's commit–reveal seed: nothing a host sees before submitting predicts it,
    so the grinder sends its cheap update untouched."""
    for o in grinders.outcomes("grind"):
        f = o.facts
        assert o.accepted and f["others"] == 5  # it waited for every other host's upload
        assert not f["predictable"] and f["tries"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("name", "factor"), [("scale3", 3.0), ("scale_half", 0.5)])
def test_scaled_updates_are_sent_at_three_and_half_the_honest_length(grinders: Epoch, name: str, factor: float) -> None:
    rep, host = grinders.report, grinders.who[name]
    for r in (1, 2):
        subs = grinders.subs(r)
        ratio = subs[host].norm / statistics.median(subs[h].norm for h in rep.honest())
        assert factor / 1.5 < ratio < factor * 1.5, (r, ratio)  # honest norms differ by host, not by 1.5×
    for r in (1, 2):  # where the replay picked it: exactly the factor, and it is excluded and unpaid
        for line in (x for x in rep.reasons[host][r] if x.startswith("replay mismatch: cosine")):
            assert abs(float(line.split("norm ratio ")[1].split()[0]) - factor) < 0.01 * factor
            assert rep.round_rewards[host].get(r, 0) == 0


@pytest.mark.slow
def test_the_report_counts_stake_gnk_and_close_delays(takers: Epoch) -> None:
    rep = takers.report
    assert rep.rounds == [1, 2] and len(rep.honest_gnk_per_host()) == 3
    assert rep.net_gnk() == pytest.approx(sum(rep.rewards[h] - rep.stake_lost[h] for h in rep.adversaries) / GNK)
    slashed = {d.host: d.amount for d in rep.slashed}
    assert {h: lost for h, lost in rep.stake_lost.items() if lost} == slashed
    assert sorted(rep.close_delay_s) == [1, 2] and all(d >= 0 for d in rep.close_delay_s.values())
    assert rep.max_close_delay_s() == max(rep.close_delay_s.values())


# ---- whether the network stops it ---------------------------------------------------------------


def reasons(epoch: Epoch, name: str, round_: int) -> str:
    return " | ".join(epoch.report.reasons[epoch.who[name]].get(round_, []))


@pytest.mark.slow
def test_a_mix_of_honest_updates_is_excluded_as_a_combination_of_others_work(takers: Epoch) -> None:
    for r in (1, 2):
        assert not takers.report.aggregated[takers.who["mix"]][r]
        assert "mix: sketch residual" in reasons(takers, "mix", r) and "combination of others' work" in reasons(
            takers, "mix", r)


@pytest.mark.slow
def test_reusing_the_public_aggregate_is_excluded(takers: Epoch) -> None:
    host = takers.who["aggregate_reuse"]
    assert not takers.report.aggregated[host][1] and "mix: a zero update" in reasons(takers, "aggregate_reuse", 1)
    assert not takers.report.aggregated[host][2]
    assert "outside the span of public tensors" in reasons(takers, "aggregate_reuse", 2)
    assert "round 1's aggregate" in reasons(takers, "aggregate_reuse", 2)


@pytest.mark.slow
def test_front_run_excludes_the_front_runner_not_the_victim(takers: Epoch) -> None:
    """Its exact copy is refused (the victim's header named the digest first, while its upload still
    streamed); its perturbed copy finishes first but arrived later by header, so it is the one excluded
    as a near-copy. The victim is aggregated every round, and only the front-runner is slashed."""
    runner, victim = takers.who["front_run"], takers.report.addresses[1]
    for r in (1, 2):
        tries = [o for o in takers.outcomes("front_run") if o.round == r]
        assert tries[0].reason == "COPY"
        assert not takers.report.aggregated[runner][r] and takers.report.aggregated[victim][r]
        assert f"with 0x{victim[2:].lower()}, whose header arrived earlier" in reasons(takers, "front_run", r)
    assert takers.report.honest_excluded() == [] and takers.report.honest_slashed() == 0
    assert takers.report.stake_lost[runner] == 10 * GNK


@pytest.mark.slow
def test_stall_does_not_hold_up_the_close(takers: Epoch) -> None:
    for o in takers.outcomes("stall"):
        assert o.facts["ended_by"] == "server" and o.reason == "LATE" and o.facts["held_s"] < STALL_CAP_S
    assert takers.report.max_close_delay_s() <= GRACE_S


@pytest.mark.slow
def test_grind_earns_nothing_or_loses_more_stake(grinders: Epoch) -> None:
    host = grinders.who["grind"]
    assert grinders.report.rewards[host] - grinders.report.stake_lost[host] <= 0
    for r in (1, 2):  # excluded every round: by the replay if picked, else as a reuse of public tensors
        assert not grinders.report.aggregated[host][r]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scale3", "scale_half"])
def test_scaling_earns_no_more_than_the_median_honest_host(grinders: Epoch, name: str) -> None:
    rep = grinders.report
    assert all(rep.round_rewards[grinders.who[name]].get(r, 0) <= rep.median_honest_reward(r) for r in rep.rounds)


# ---- the pieces, without an epoch ---------------------------------------------------------------


def test_nothing_public_predicts_the_pick_and_a_nudge_changes_the_digest() -> None:
    hosts = {bytes([i]) * 20: hashlib.sha256(bytes([i])).digest() for i in range(1, 9)}
    assert predict_pick(0.5, 1, 3, b"\x07" * 32, hosts) is None
    delta = {"a": torch.linspace(-1, 1, 300), "b": torch.zeros(5)}
    codec = get_codec("int8")
    digests = {hashlib.sha256(codec.encode(nudged(delta, i))).digest() for i in range(20)}
    assert len(digests) == 20 and hashlib.sha256(codec.encode(delta)).digest() not in digests
    moved = nudged(delta, 301)  # the second tensor's second value
    assert torch.equal(moved["a"], delta["a"]) and float(moved["b"][1]) > 0 and float(moved["b"].abs().sum()) == float(moved["b"][1])


def test_the_tap_shows_an_upload_before_its_stream_ends() -> None:
    tap = Tap()
    header = pb.SubmitRequest(header=pb.SubmitHeader(round=2, payload_sha256=b"\x01" * 32))
    seen = tap.publish(b"\x0a" * 20, [header, pb.SubmitRequest(chunk=b"abc")])
    assert tap.wait_published(b"\x0a" * 20, 2, timeout_s=1).payload == b"abc"
    with pytest.raises(TimeoutError):
        tap.wait_done(b"\x0a" * 20, 2, timeout_s=0.1)  # still open
    assert tap.accepted_digests(2) == {}
    tap.finish(seen, True, "")
    assert tap.wait_done(b"\x0a" * 20, 2, timeout_s=1) is seen and tap.accepted_digests(2) == {b"\x0a" * 20: b"\x01" * 32}
    assert tap.wait_accepted([b"\x0a" * 20], 2, 1, timeout_s=1) == [seen]
