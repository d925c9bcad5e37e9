"""The round engine's acceptance (`authenticate`, `submit`) without a server: every refusal reason, each
at its boundary, and what an accepted upload leaves on disk, in the evidence log and in its receipt.
(engine_kit.py: a real store, checkpoints and embedded chain; the engine's clock held by the test.)"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from agg_harness import AGGREGATOR
from engine_kit import SPEC, Kit, chunks, payload, update
from eth_utils import to_checksum_address
from nacl.signing import SigningKey

from chain.backends import RpcBackend
from chain.client import ChainClient
from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.engine_types import clock_text
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.validate import count_sketch
from gonka_node.core.envelope import Submission
from gonka_node.slashing import KIND_COPY, KIND_GARBAGE
from training.codecs import get_codec

P1 = payload(update(1))


def refusal(kit: Kit, e: RoundEngine, sub: Submission, key: SigningKey | None = None) -> Rejected:
    key = key or next(h.key for h in [*kit.hosts, kit.world.outsider] if h.address == sub.host)
    with pytest.raises(Rejected) as info:
        kit.run(e.authenticate(sub, sub.sign(key)))
    return info.value


def accepted(kit: Kit, e: RoundEngine, sub: Submission, key: SigningKey) -> bool:
    member = kit.run(e.authenticate(sub, sub.sign(key)))
    assert member.address == sub.host
    return True


def test_an_honest_header_authenticates_to_its_chain_record(kit: Kit) -> None:
    e = kit.engine()
    h = kit.hosts[1]
    member = kit.run(e.authenticate(kit.header(e, h, P1), kit.header(e, h, P1).sign(h.key)))
    assert (member.address, member.slot, member.node_key) == (h.address, h.slot, bytes(h.key.verify_key))


def test_another_chain_or_registry_is_refused(kit: Kit) -> None:
    e = kit.engine()
    h = kit.hosts[0]
    reg = e.ctx.registry
    want = f"this aggregator serves chain {e.ctx.chain_id}, registry 0x{reg.hex()}"
    for sub in (kit.header(e, h, P1, chain_id=e.ctx.chain_id + 1), kit.header(e, h, P1, registry=bytes(20))):
        got = refusal(kit, e, sub)
        assert (got.reason, got.message) == (Reason.WRONG_CHAIN, want)


def test_no_open_round_is_wrong_round(kit: Kit) -> None:
    e = kit.engine()
    sub = kit.header(e, kit.hosts[0], P1)
    e.current = None
    got = refusal(kit, e, sub)
    assert (got.reason, got.message) == (Reason.WRONG_ROUND, f"no round is open in epoch {kit.world.epoch}")


def test_an_earlier_round_is_late_a_later_round_or_other_epoch_is_wrong_round(kit: Kit) -> None:
    e = kit.engine()
    h, ep = kit.hosts[0], kit.world.epoch
    e.current = dataclasses.replace(e.current, round=2)  # type: ignore[arg-type]
    got = refusal(kit, e, kit.header(e, h, P1, round=1))
    assert (got.reason, got.message) == (Reason.LATE, f"round {ep}/1 is closed; the open round is {ep}/2")
    got = refusal(kit, e, kit.header(e, h, P1, round=3))
    assert (got.reason, got.message) == (Reason.WRONG_ROUND, f"the open round is {ep}/2, not {ep}/3")
    for epoch in (ep - 1, ep + 1):  # an earlier round number of another epoch is not "late" here
        got = refusal(kit, e, kit.header(e, h, P1, epoch=epoch, round=1))
        assert (got.reason, got.message) == (Reason.WRONG_ROUND, f"the open round is {ep}/2, not {epoch}/1")


def test_at_the_deadline_is_on_time_one_ms_later_or_while_closing_is_late(kit: Kit) -> None:
    e = kit.engine()
    assert e.current is not None
    deadline = e.current.deadline_ms
    assert deadline == kit.clock.ms + 10_000
    h = kit.hosts[0]
    kit.clock.ms = deadline
    assert accepted(kit, e, kit.header(e, h, P1), h.key)
    kit.clock.ms = deadline + 1
    got = refusal(kit, e, kit.header(e, h, P1))
    want = f"round {kit.world.epoch}/1 closed for submissions at {clock_text(deadline)}"
    assert (got.reason, got.message) == (Reason.LATE, want)
    kit.clock.ms = deadline - 1
    e.closing = True
    assert refusal(kit, e, kit.header(e, h, P1)).reason is Reason.LATE


def test_a_stale_base_and_another_codec_are_refused(kit: Kit) -> None:
    e = kit.engine()
    h, base = kit.hosts[0], kit.world.init_sha
    got = refusal(kit, e, kit.header(e, h, P1, base_checkpoint_sha256=b"\x01" * 32))
    assert (got.reason, got.message) == (Reason.STALE_BASE, f"base checkpoint must be {base.hex()}, got {'01' * 32}")
    got = refusal(kit, e, kit.header(e, h, P1, codec="int8"))
    assert (got.reason, got.message) == (Reason.WRONG_CODEC, f"epoch {kit.world.epoch} uses codec 'fp32', not 'int8'")


def test_the_declared_length_may_be_the_limit_not_one_byte_more(kit: Kit) -> None:
    e = kit.engine()
    h = kit.hosts[0]
    assert accepted(kit, e, kit.header(e, h, P1, payload_length=4096), h.key)
    got = refusal(kit, e, kit.header(e, h, P1, payload_length=4097))
    assert (got.reason, got.message) == (Reason.OVERSIZE, "declared 4097 bytes, limit 4096")


def test_the_tokens_trained_may_be_as_large_as_the_store_keeps_not_one_more(kit: Kit) -> None:
    e = kit.engine()
    h = kit.hosts[0]
    got = refusal(kit, e, kit.header(e, h, P1, tokens_trained=2**63))  # a uint64 on the wire
    assert (got.reason, got.message) == (Reason.MALFORMED, f"tokens_trained {2**63} is above {2**63 - 1}")
    assert e.store.submissions(kit.world.epoch, 1) == []
    assert accepted(kit, e, kit.header(e, h, P1, tokens_trained=2**63 - 1), h.key)


def test_the_timestamp_may_be_off_by_the_skew_either_way_not_one_ms_more(kit: Kit) -> None:
    e = kit.engine()
    h, now = kit.hosts[0], kit.clock.ms
    for ts in (now - 2000, now + 2000):
        assert accepted(kit, e, kit.header(e, h, P1, timestamp_ms=ts), h.key)
    for ts in (now - 2001, now + 2001):
        got = refusal(kit, e, kit.header(e, h, P1, timestamp_ms=ts))
        assert (got.reason, got.message) == (
            Reason.CLOCK_SKEW, f"timestamp {ts} ms is too far from the aggregator's clock"
        )


def test_an_unreachable_chain_is_unavailable_not_a_verdict(kit: Kit) -> None:
    e = kit.engine()
    world = kit.world.chain
    # Nothing listens on port 9 (discard): every read of the chain fails.
    e.chain = ChainView(ChainClient(RpcBackend("http://127.0.0.1:9", 2.0), world.accounts[AGGREGATOR], world.deployment))
    got = refusal(kit, e, kit.header(e, kit.hosts[0], P1))
    assert got.reason is Reason.UNAVAILABLE and got.message.startswith("cannot read the chain: ")
    assert isinstance(got.__cause__, Exception)


def test_a_host_not_signed_in_is_unknown_a_wrong_key_does_not_verify(kit: Kit) -> None:
    e = kit.engine()
    out = kit.world.outsider
    got = refusal(kit, e, kit.header(e, out, P1))
    want = f"host {to_checksum_address(out.address)} is not signed in to epoch {kit.world.epoch}"
    assert (got.reason, got.message) == (Reason.UNKNOWN_HOST, want)
    h = kit.hosts[0]
    got = refusal(kit, e, kit.header(e, h, P1), key=kit.hosts[1].key)  # signed with another host's key
    assert (got.reason, got.message) == (
        Reason.BAD_SIGNATURE, "signature does not verify under the node key registered on chain"
    )


def test_a_second_upload_of_a_host_and_a_copied_digest_are_refused(kit: Kit) -> None:
    e = kit.engine()
    a, b, c = kit.hosts
    ep = kit.world.epoch
    assert kit.submit(e, a, P1).body.accepted
    got = refusal(kit, e, kit.header(e, a, payload(update(2))))
    assert (got.reason, got.message) == (Reason.DUPLICATE, f"host already submitted in round {ep}/1")
    copy = kit.header(e, b, P1)
    got = refusal(kit, e, copy)
    want = f"payload identical to the submission of {to_checksum_address(a.address)}, whose header came first"
    assert (got.reason, got.message) == (Reason.COPY, want)
    [ev] = kit.evidence.records()  # the copier signed it: slashable
    assert (ev.kind, ev.host, ev.round) == (KIND_COPY, to_checksum_address(b.address), 1)
    assert ev.other == {"host": to_checksum_address(a.address), "round": 1, "payload_sha256": copy.payload_sha256.hex()}
    assert kit.run(e.authenticate(kit.header(e, c, payload(update(3))), kit.header(e, c, payload(update(3))).sign(c.key)))


def test_while_an_upload_streams_its_host_and_its_digest_are_taken(kit: Kit) -> None:
    e = kit.engine()
    a, b, _ = kit.hosts
    ep = kit.world.epoch
    release = asyncio.Event()
    first_half = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield P1[:64]
        first_half.set()
        await release.wait()
        async for part in chunks(P1[64:]):
            yield part

    async def scenario() -> tuple[Rejected, Rejected, bool]:
        sub = kit.header(e, a, P1)
        upload = asyncio.ensure_future(e.submit(sub, sub.sign(a.key), slow(), e.stream_guard("a")))
        started = asyncio.ensure_future(first_half.wait())
        await asyncio.wait([started, upload], return_when=asyncio.FIRST_COMPLETED)
        assert not upload.done(), upload.exception()  # still streaming: half its payload is in
        with pytest.raises(Rejected) as again:
            await e.authenticate(kit.header(e, a, payload(update(2))), kit.header(e, a, payload(update(2))).sign(a.key))
        with pytest.raises(Rejected) as copied:
            await e.authenticate(kit.header(e, b, P1), kit.header(e, b, P1).sign(b.key))
        release.set()
        return again.value, copied.value, (await upload).body.accepted

    again, copied, ok = kit.run(scenario())
    assert (again.reason, again.message) == (Reason.DUPLICATE, f"host already has an upload streaming in round {ep}/1")
    assert copied.reason is Reason.COPY and to_checksum_address(a.address) in copied.message
    assert ok and e._in_flight == {}


def test_an_accepted_upload_is_stored_as_received_and_receipted(kit: Kit) -> None:
    e = kit.engine()
    h = kit.hosts[2]
    u = update(5)
    data = payload(u)
    sub = kit.header(e, h, data)
    sig = sub.sign(h.key)
    t0 = kit.clock.ms

    async def late_chunks() -> AsyncIterator[bytes]:
        async for part in chunks(data):
            yield part
        kit.clock.ms = t0 + 7  # the payload completes 7 ms after its header

    receipt = kit.run(e.submit(sub, sig, late_chunks(), e.stream_guard("x")))
    kit.run(e.checks.drain(kit.world.epoch, 1))  # the receipt came first; the norm and sketch follow
    [row] = e.store.submissions(kit.world.epoch, 1)
    norm = float(torch.cat([t.flatten() for t in u.values()]).norm())
    assert (row.host, row.payload_sha256, row.payload_length, row.tokens_trained, row.timestamp_ms, row.signature) == (
        h.address, hashlib.sha256(data).digest(), len(data), 64, t0, sig
    )
    assert row.residual_root == sub.residual_root == hashlib.sha256(h.address).digest()  # the signed root, kept
    assert (row.started_ms, row.received_ms) == (t0, t0 + 7)
    assert row.norm == pytest.approx(norm, rel=1e-6)
    assert row.sketch == count_sketch(u).numpy().tobytes()
    assert row.path == str(e.store.payload_path(kit.world.epoch, 1, h.address))
    assert Path(row.path).read_bytes() == data
    b = receipt.body
    assert (b.chain_id, b.registry, b.epoch, b.round, b.host) == (
        e.ctx.chain_id, e.ctx.registry, kit.world.epoch, 1, h.address
    )
    assert (b.payload_sha256, b.payload_length, b.accepted, b.reason, b.received_ms) == (
        sub.payload_sha256, len(data), True, 0, t0 + 7
    )
    assert receipt.aggregator_key == bytes(SigningKey(b"\x09" * 32).verify_key)
    assert b.verify(receipt.signature, receipt.aggregator_key)
    assert e._in_flight == {} and list(e.store.incoming.iterdir()) == []


def test_a_refusal_receipt_names_the_reason_and_an_empty_header(kit: Kit) -> None:
    e = kit.engine()
    kit.clock.ms += 3
    r = e.receipt(None, accepted=False, reason=Reason.MALFORMED.value)
    assert (r.body.epoch, r.body.round, r.body.host, r.body.payload_sha256, r.body.payload_length) == (
        0, 0, bytes(20), bytes(32), 0
    )
    assert (r.body.accepted, r.body.reason, r.body.received_ms) == (False, 1, kit.clock.ms)
    assert r.body.verify(r.signature, e.aggregator_key)
    sub = kit.header(e, kit.hosts[0], P1)
    r = e.receipt(sub, accepted=False, reason=Reason.LATE.value, received_ms=5)
    assert (r.body.epoch, r.body.round, r.body.host, r.body.payload_length, r.body.received_ms) == (
        kit.world.epoch, 1, kit.hosts[0].address, len(P1), 5
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00garbage that no codec reads", Reason.UNDECODABLE),
        (payload({"b": torch.full((3,), 9.0), "w": torch.zeros(2, 4)}), Reason.NORM_TOO_LARGE),  # 15.6 > 10
        (payload({"b": torch.zeros(3)}), Reason.WRONG_SHAPE),
    ],
)
def test_a_payload_that_fails_its_checks_is_no_submission_and_kept_as_evidence(kit: Kit, data: bytes, reason: Reason) -> None:
    e = kit.engine()
    h = kit.hosts[0]
    ep = kit.world.epoch
    receipt = kit.submit(e, h, data)  # received and stored: the checks run after the receipt
    assert receipt.body.accepted
    failed = e.store.submission(ep, 1, h.address)
    assert failed is not None and (failed.check_state, failed.check_reason) == ("failed", reason.value)
    assert e.store.submissions(ep, 1) == [] and e.store.submitted_hosts(ep, 1) == set() and e._in_flight == {}
    assert list(e.store.incoming.iterdir()) == []
    [ev] = kit.evidence.records()
    assert (ev.kind, ev.host, ev.detail) == (KIND_GARBAGE, to_checksum_address(h.address), f"{reason.name}: {failed.check_message}")
    assert (kit.evidence.root / ev.payload_file).read_bytes() == data
    # As after a refusal at upload, the host may send a payload that passes; it replaces the failed one.
    kit.submit(e, h, P1)
    [row] = e.store.submissions(ep, 1)
    assert (row.host, row.payload_sha256, Path(row.path).read_bytes()) == (h.address, hashlib.sha256(P1).digest(), P1)


@pytest.mark.parametrize("change", ["closing", "next round", "no round"])
def test_a_round_that_closes_while_the_payload_streams_refuses_it_as_late(kit: Kit, change: str) -> None:
    e = kit.engine()
    h = kit.hosts[0]
    r = e.current
    assert r is not None

    async def closing_chunks() -> AsyncIterator[bytes]:
        async for part in chunks(P1):
            yield part
        if change == "closing":
            e.closing = True
        else:
            e.current = dataclasses.replace(r, round=2) if change == "next round" else None

    sub = kit.header(e, h, P1)
    with pytest.raises(Rejected) as info:
        kit.run(e.submit(sub, sub.sign(h.key), closing_chunks(), e.stream_guard("x")))
    ep = kit.world.epoch
    assert (info.value.reason, info.value.message) == (Reason.LATE, f"round {ep}/1 closed while the payload streamed")
    assert e.store.submissions(ep, 1) == [] and e._in_flight == {} and list(e.store.incoming.iterdir()) == []


def test_the_stream_guard_ends_with_the_round(kit: Kit) -> None:
    e = kit.engine()
    g = e.stream_guard("upload of x")
    assert (g.what, g.closed, g.limits) == ("upload of x", e.closed_for_submissions, e.stream_limits)
    assert (e.stream_limits.idle_s, e.stream_limits.setup_s, e.stream_limits.min_bytes_per_s) == (30.0, 30.0, 128 * 1024)


def test_the_stream_limits_are_the_operators_configured_ones(kit: Kit) -> None:
    """Every stream is timed by the operator's `[round]` settings (idle, setup, minimum upload rate),
    not by StreamLimits' defaults (the kit's settings leave them at the defaults)."""
    kit.settings = dataclasses.replace(kit.settings, stream_idle_s=5.0, stream_setup_s=2.0, min_upload_kib_per_s=64.0)
    limits = kit.engine().stream_guard("x").limits
    assert (limits.idle_s, limits.setup_s, limits.min_bytes_per_s) == (5.0, 2.0, 64 * 1024)


def test_the_spec_is_the_models(kit: Kit) -> None:
    assert dict(kit.engine(start=False).ctx.spec) == SPEC


def test_a_shared_state_codec_is_seeded_per_round_from_the_epoch_seed(kit: Kit) -> None:
    ctx = dataclasses.replace(kit.context(), codec=get_codec("mask"), codec_name="mask", epoch_seed=5)
    assert [ctx.codec_for(r).seed for r in (1, 2)] == [5 * 1_000_003 + 1, 5 * 1_000_003 + 2]  # type: ignore[attr-defined]


def test_the_receipt_gives_the_stored_receive_time(kit: Kit) -> None:
    e = kit.engine()
    h = kit.hosts[0]
    base = kit.clock.ms

    def ticking() -> int:  # every read of the clock is a millisecond later than the one before
        kit.clock.ms += 1
        return kit.clock.ms

    e.clock = ticking
    receipt = kit.submit(e, h, P1)
    [row] = e.store.submissions(kit.world.epoch, 1)
    assert receipt.body.received_ms == row.received_ms > row.started_ms > base
