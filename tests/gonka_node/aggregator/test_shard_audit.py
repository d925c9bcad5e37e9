"""Each shard checks the verifier's verdict against the signed reports it names (aggregator/
shard_audit.py), and a contradiction between signed shard messages is kept as evidence that anyone
can re-check (aggregator/shard_evidence.py): in-process shard engines for the refusal at close, two
real Shard servers (gRPC, TLS, signed messages) for the evidence."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from engine_kit import Kit, update
from test_shard_net import EPOCH, KEYS, ShardNode, _signed
from test_shard_round import fragment_payload, shard_engine

from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard import (
    FragmentReport,
    HostFragment,
    LocalExchange,
    ShardExchange,
    ShardPending,
    ShardRole,
    Verdict,
    VerdictRefused,
    _whole_norm,
    misfit,
    report_digest,
    shard_role,
)
from gonka_node.aggregator.shard_audit import contradiction, expected_tau, rewards_contradiction
from gonka_node.aggregator.shard_close import audit_verdict
from gonka_node.aggregator.shard_evidence import check_shard_evidence
from gonka_node.aggregator.shard_inbox import ShardReason
from gonka_node.core.config import AggregationSettings
from gonka_node.core.shard_envelope import ShardKind

HOSTS = (b"\x07" * 20, b"\x08" * 20, b"\x09" * 20)
KEYS_BY_INDEX = {i: bytes(k.verify_key) for i, k in enumerate(KEYS)}


class TamperingVerifier(LocalExchange):
    """Shards in one process whose verifier puts its honest verdict changed by `tamper`."""

    def __init__(self, tamper: Callable[[Verdict], Verdict]) -> None:
        super().__init__()
        self.tamper = tamper

    def put_verdict(self, verdict: Verdict) -> None:
        super().put_verdict(self.tamper(verdict))


def _double_clip_norm(host: int) -> Callable[[Verdict], Verdict]:
    """One host's clip norm doubled: its fragments would be scaled by half its honest clip factor."""
    def tamper(v: Verdict) -> Verdict:
        address = sorted(v.clip_norms)[host]
        return dataclasses.replace(v, clip_norms={h: n * (2 if h == address else 1) for h, n in v.clip_norms.items()})
    return tamper


def closed_by_two_shards(kit: Kit, exchange: ShardExchange, seed: int) -> list[RoundEngine]:
    """Two shard engines on `exchange`; the kit's three hosts each upload both fragments of an update,
    and three ticks of both close the round as far as the exchange lets them."""
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    for h, u in zip(kit.hosts, [update(seed + i) for i in range(3)], strict=True):
        for s in shards:
            assert kit.submit(s, h, fragment_payload(u, s)).body.accepted
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())
    return shards


@pytest.mark.parametrize(("tamper", "refusal"), [
    (_double_clip_norm(1), "'s clip norm is"),
    (lambda v: dataclasses.replace(v, rewards_root=b"\x05" * 32), "its rewards root or total is not the pool's"),
])
def test_a_verdict_the_reports_and_pool_do_not_give_is_applied_by_no_shard(
    kit: Kit, caplog: pytest.LogCaptureFixture, tamper: Callable[[Verdict], Verdict], refusal: str
) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    kit.aggregation = AggregationSettings(rule="clip_median")
    exchange = TamperingVerifier(tamper)
    shards = closed_by_two_shards(kit, exchange, 80)
    verdict = exchange.verdict(kit.world.epoch4, 1)
    assert verdict is not None and len(verdict.aggregated) == 3
    for s in shards:
        row = s.store.get_round(kit.world.epoch4, 1)
        assert row is not None and row.state == "open"  # no finalize intent: nothing stepped, nothing voted
        assert not s.store.checkpoint_path(kit.world.epoch4, 1).exists()
    assert exchange.hashes(kit.world.epoch4, 1) == {}
    assert not kit.world.chain.client(0).round_result(kit.world.epoch4, 1).finalized
    assert any("shard 1 refuses the verifier's verdict" in m and refusal in m for m in caplog.messages)


# ---- the check itself, on reports and verdicts -----------------------------------------------------


def _reports(skip: bool = False) -> list[FragmentReport]:
    """Shard 0 holds tensors a, c of the model, shard 1 tensor b (the plan's split, `_role`); three hosts,
    the third 3x larger."""
    def frag(i: int, sq: tuple[float, ...]) -> HostFragment:
        return HostFragment(HOSTS[i], 1, 2, sq, tuple(x * 1.000001 for x in sq), bytes(8))
    r0 = FragmentReport(EPOCH, 1, 0, 2, ("a", "c"), skip,
                        (frag(0, (0.5, 0.25)), frag(1, (0.75, 0.5)), frag(2, (4.5, 2.25))), (), ())
    r1 = FragmentReport(EPOCH, 1, 1, 2, ("b",), False, (frag(0, (0.125,)), frag(1, (0.0625,)), frag(2, (1.125,))), (), ())
    return [r0, r1]


def _honest(reports: list[FragmentReport], rule: str = "clip_median") -> Verdict:
    clip = {h: _whole_norm(reports, h, clip=True) for h in HOSTS}
    return Verdict(EPOCH, 1, rule, HOSTS, clip, expected_tau(rule, reports, HOSTS), (), bytes(32), 0,
                   tuple(report_digest(r) for r in reports))


def test_only_the_verdict_the_reports_give_passes_the_check() -> None:
    reports = _reports()
    honest = _honest(reports)
    assert contradiction(honest, reports) is None and contradiction(_honest(reports, "mean"), reports) is None
    # τ is the median of the whole norms summed as the ingest check sums them (scan, not clip, squares)
    assert honest.tau == math.sqrt(0.75 + 0.5 + 0.0625)
    doubled = dict(honest.clip_norms)
    doubled[HOSTS[2]] *= 2
    cases = {
        "clip norm is": dataclasses.replace(honest, clip_norms=doubled),
        "τ is": dataclasses.replace(honest, tau=honest.tau * 1.5),
        "under 'mean' it is None": dataclasses.replace(honest, rule="mean"),
        "name other hosts": dataclasses.replace(honest, clip_norms={h: honest.clip_norms[h] for h in HOSTS[:2]}),
        "not in increasing address order": dataclasses.replace(honest, aggregated=HOSTS[::-1]),
    }
    for expected, bad in cases.items():
        why = contradiction(bad, reports)
        assert why is not None and expected in why, (expected, why)
    half = [reports[0], dataclasses.replace(reports[1], hosts=reports[1].hosts[:2])]  # shard 1 refused host 3
    assert contradiction(honest, half) == f"it aggregates 0x{HOSTS[2].hex()}, whose fragment shard(s) [1] did not accept"
    assert "reported a skip" in (contradiction(honest, _reports(skip=True)) or "")
    # the clip norm is the clip's sum (clip_sq), not the ingest check's: the verdict may not take one for the other
    scan = {h: _whole_norm(reports, h, clip=False) for h in HOSTS}
    assert "clip norm is" in (contradiction(dataclasses.replace(honest, clip_norms=scan), reports) or "")


def test_a_report_that_does_not_fit_the_fragment_plan_gives_no_verdict_and_is_refused() -> None:
    """Whole norms are summed over the reports by tensor name: a shard naming another's tensors (with
    zeros) would set a host's norm below its honest size, and a negative square would too."""
    reports = _reports()
    assert misfit(reports, _role(0)) is None
    zeros = tuple(HostFragment(h.host, 1, 2, (0.0, 0.0), (0.0, 0.0), bytes(8)) for h in reports[0].hosts)
    posing = [reports[0], dataclasses.replace(reports[1], names=("a", "c"), hosts=zeros)]  # shard 1 names 0's
    assert _whole_norm(posing, HOSTS[2], clip=False) == 0.0  # what the unchecked sum would have believed
    negative = dataclasses.replace(reports[1], hosts=(*reports[1].hosts[:2], dataclasses.replace(
        reports[1].hosts[2], scan_sq=(-1.125,))))
    short = dataclasses.replace(reports[1], hosts=(dataclasses.replace(reports[1].hosts[0], clip_sq=()),
                                                   *reports[1].hosts[1:]))
    for bad, expected in (([posing[0], posing[1]], "names tensors"), ([reports[0], negative], "negative"),
                          ([reports[0], short], "0 squared norms")):
        why = misfit(bad, _role(1))
        assert why is not None and expected in why, (expected, why)


# ---- over the network: the refusal's evidence, and equivocation -------------------------------------


def _role(index: int) -> ShardRole:
    role = shard_role({"a": (2,), "b": (2,), "c": (2,)}, [b"\x00" * 20, b"\x01" * 20], bytes([index]) * 20, "clip_median")
    assert role is not None
    return role


def _deliver_reports(s0: ShardNode, s1: ShardNode, reports: list[FragmentReport]) -> None:
    s0.exchange.put_report(reports[0])  # shard 0's own report: kept, sent to nobody until its verdict
    s1.exchange.put_report(reports[1])  # to the verifier
    assert [r.index for r in s1.exchange.reports(EPOCH, 1)] == [1]


def test_a_shard_refuses_a_doubled_clip_norm_and_keeps_evidence_anyone_can_recheck(
    pair: tuple[ShardNode, ShardNode],
) -> None:
    s0, s1 = pair
    reports = _reports()
    _deliver_reports(s0, s1, reports)
    honest = _honest(reports)
    norms = dict(honest.clip_norms)
    norms[HOSTS[0]] *= 2
    s0.exchange.put_verdict(dataclasses.replace(honest, clip_norms=norms))
    held = s1.exchange.verdict(EPOCH, 1)  # the verifier forwarded its own report before its verdict
    assert held is not None and s1.exchange.reports(EPOCH, 1) == reports
    with pytest.raises(VerdictRefused, match=f"shard 1 refuses the verifier's verdict: 0x{HOSTS[0].hex()}'s clip norm") as refused:
        audit_verdict(s1.exchange, held, _role(1), "clip_median")
    path = Path(str(refused.value).split("evidence kept in ")[1])
    assert path.parent == s1.root.parent / "shard-evidence" and path.name == f"{path.stem}.json"
    proves = check_shard_evidence(path)
    assert proves is not None and proves.startswith("shard 0's verdict for round 4/1 does not follow from the signed")
    assert "clip norm is" in proves and check_shard_evidence(path, KEYS_BY_INDEX) == proves
    assert check_shard_evidence(path, {0: KEYS_BY_INDEX[1], 1: KEYS_BY_INDEX[1]}) is None  # another key for shard 0
    record = json.loads(path.read_text())
    assert [m["header"][:32] for m in record["messages"]] and record["accused"] == 0
    _assert_tampering_is_caught(path, record)


def _assert_tampering_is_caught(path: Path, record: dict[str, object]) -> None:
    """Every part of the record is bound: a changed body, signature, key or report proves nothing."""
    def tampered(change: str) -> str | None:
        copy = json.loads(json.dumps(record))
        messages = copy["messages"]
        if change == "verdict body":  # the honest clip norm back in the body; the signed digest is the old one
            body = json.loads(_b64d(messages[0]["body"]))
            body["clip_norms"] = {h: v / 2 if h == HOSTS[0].hex() else v for h, v in body["clip_norms"].items()}
            messages[0]["body"] = _b64e(json.dumps(body, sort_keys=True).encode())
        elif change == "signature":
            messages[0]["signature"] = ("00" if messages[0]["signature"][:2] != "00" else "01") + messages[0]["signature"][2:]
        elif change == "key":
            copy["node_keys"]["0"] = KEYS_BY_INDEX[1].hex()
        elif change == "report dropped":
            copy["messages"] = messages[:2]
        elif change == "reports swapped":
            copy["messages"] = [messages[0], messages[2], messages[1]]
        out = path.with_name(f"tampered-{change.replace(' ', '-')}.json")
        out.write_text(json.dumps(copy))
        return check_shard_evidence(out)

    for change in ("verdict body", "signature", "key", "report dropped", "reports swapped"):
        assert tampered(change) is None, change
    path.with_name("garbage.json").write_text("{not json")
    assert check_shard_evidence(path.with_name("garbage.json")) is None


def _b64d(text: str) -> bytes:
    return base64.b64decode(text)


def _b64e(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_an_honest_verdict_passes_and_a_named_report_not_in_yet_is_waited_for(pair: tuple[ShardNode, ShardNode]) -> None:
    s0, s1 = pair
    reports = _reports()
    honest = _honest(reports)
    s1.exchange.put_report(reports[1])
    with pytest.raises(ShardPending, match="shard 0's report, which the verdict names, is not in yet"):
        audit_verdict(s1.exchange, honest, _role(1), "clip_median")
    s0.exchange.put_report(reports[0])
    s0.exchange.put_verdict(honest)
    held = s1.exchange.verdict(EPOCH, 1)
    assert held == honest
    audit_verdict(s1.exchange, held, _role(1), "clip_median")  # no refusal, nothing kept
    audit_verdict(s0.exchange, held, _role(0), "clip_median")
    assert not (s1.root.parent / "shard-evidence").exists()


@pytest.mark.parametrize("kind", [ShardKind.VERDICT, ShardKind.REPORT])
def test_a_shard_that_signs_two_bodies_for_one_slot_leaves_evidence_against_itself(
    pair: tuple[ShardNode, ShardNode], kind: ShardKind
) -> None:
    s0, s1 = pair
    sender, receiver = (0, s1) if kind == ShardKind.VERDICT else (1, s0)
    reports = _reports()
    if kind == ShardKind.VERDICT:
        first, second = _honest(reports).to_json().encode(), _honest(reports, "mean").to_json().encode()
    else:
        first, second = reports[1].to_json().encode(), dataclasses.replace(reports[1], skip=True).to_json().encode()
    assert receiver.put_raw(_signed(kind, first, KEYS[sender], sender, sequence=5)).stored
    receiver.put_raw(_signed(kind, first, KEYS[sender], sender, sequence=6))  # re-signed later, as a retry does
    evidence = receiver.root.parent / "shard-evidence"
    assert not evidence.exists()  # the same body again, re-signed later, is no contradiction
    if kind == ShardKind.VERDICT:  # the second verdict is refused; its signature is kept all the same
        with pytest.raises(grpc.RpcError) as refused:
            receiver.put_raw(_signed(kind, second, KEYS[sender], sender, sequence=7))
        assert dict(refused.value.trailing_metadata() or ())["gonka-shard-reason"] == ShardReason.CONFLICT.name
    else:  # a newer report replaces the held one, as before; the older stays in the evidence
        assert receiver.put_raw(_signed(kind, second, KEYS[sender], sender, sequence=7)).stored
    third = (_honest(reports, "mean") if kind == ShardKind.VERDICT else dataclasses.replace(reports[1], hosts=()))
    try:  # a third body for the slot: refused or taken as before, but one record per slot is kept
        receiver.put_raw(_signed(kind, third.to_json().encode() + b" ", KEYS[sender], sender, sequence=9))
    except grpc.RpcError:
        assert kind == ShardKind.VERDICT
    (path,) = evidence.glob("*.json")
    assert check_shard_evidence(path) == check_shard_evidence(path, KEYS_BY_INDEX) is not None
    assert (check_shard_evidence(path) or "").startswith(f"shard {sender} signed two different {kind.name}s for round 4/1")
    record = json.loads(path.read_text())
    assert record["accused"] == sender and record["kind"] == "shard_equivocation"
    for i in range(2):  # either signature broken, or the two headers made equal: no contradiction is proved
        broken = json.loads(path.read_text())
        broken["messages"][i]["signature"] = "00" * 64
        path.with_name(f"broken-{i}.json").write_text(json.dumps(broken))
        assert check_shard_evidence(path.with_name(f"broken-{i}.json")) is None
    same = json.loads(path.read_text())
    same["messages"][1] = same["messages"][0]
    path.with_name("same.json").write_text(json.dumps(same))
    assert check_shard_evidence(path.with_name("same.json")) is None
    assert check_shard_evidence(path, {sender: bytes(32)}) is None


def test_the_engines_verdict_names_the_reports_it_was_decided_from(kit: Kit) -> None:
    exchange = LocalExchange()
    shards = closed_by_two_shards(kit, exchange, 90)
    verdict = exchange.verdict(kit.world.epoch4, 1)
    reports = exchange.reports(kit.world.epoch4, 1)
    assert verdict is not None and verdict.reports == tuple(report_digest(r) for r in reports)
    assert len(set(verdict.reports)) == 2 and Verdict.from_json(verdict.to_json()).reports == verdict.reports
    for s in shards:
        row = s.store.get_round(kit.world.epoch4, 1)
        assert row is not None and row.state == "finalized"
    # The rewards follow from the host set and the epoch's pool: another root, total or row pay is refused.
    ctx = shards[1].ctx
    assert verdict.total_reward > 0 and rewards_contradiction(verdict, ctx) is None
    richer = (dataclasses.replace(verdict.rows[0], reward=verdict.rows[0].reward + 1), *verdict.rows[1:])
    for bad, why in ((dataclasses.replace(verdict, rewards_root=b"\x05" * 32), "rewards root or total"),
                     (dataclasses.replace(verdict, total_reward=verdict.total_reward + 1), "rewards root or total"),
                     (dataclasses.replace(verdict, rows=richer), "pay other amounts")):
        assert why in (rewards_contradiction(bad, ctx) or ""), why


def test_a_shard_that_reported_other_submissions_signs_no_second_report(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "gonka_node.aggregator.rounds")
    exchange = LocalExchange()
    earlier = FragmentReport(kit.world.epoch4, 1, 1, 2, ("b",), False, (), (), ())  # as if sent before a crash
    exchange.put_report(earlier)
    shards = [shard_engine(kit, i, exchange) for i in range(2)]
    for h, u in zip(kit.hosts, [update(95), update(96), update(97)], strict=True):
        for s in shards:
            assert kit.submit(s, h, fragment_payload(u, s)).body.accepted
    for _ in range(3):
        for s in shards:
            kit.run(s.tick())
    assert [r for r in exchange.reports(kit.world.epoch4, 1) if r.index == 1] == [earlier]
    row = shards[1].store.get_round(kit.world.epoch4, 1)
    assert row is not None and row.state == "open"
    assert any("shard 1 reported other submissions before (or a skip): it signs one report per round" in m
               for m in caplog.messages)
