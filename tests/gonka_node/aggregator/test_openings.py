"""The top-k challenge end to end in the round engine (docs/PROTOCOL.md "Challenge and opening"): a
micro Llama's hosts train their real rounds (the replay's own inputs) through a real `ErrorFeedback`
with the top-k codec and d = 0.9, sign their residual roots, and open their residuals on the chunks the
round's seed picks; the close waits for the openings (or the deadline) and judges each host on the
update its opening claims. Real store, real files, the embedded EVM, a held clock."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from agg_harness import AGGREGATOR, Host
from engine_kit import Kit, chunks
from micro_model import INNER, SEED, SLOTS, micro_windows, model
from nacl.signing import SigningKey
from test_shard_replay import micro_context
from torch import Tensor

from gonka_node.aggregator.chain_view import ChainView
from gonka_node.aggregator.challenges import challenges_round
from gonka_node.aggregator.checkpoints import TrainingCheckpoints
from gonka_node.aggregator.engine_types import EpochContext, clock_text
from gonka_node.aggregator.ingest import StreamGuard
from gonka_node.aggregator.replay import MISMATCH, NO_OPENING, PASSED
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.store import ContributionRow, OpeningRow, Store
from gonka_node.core.opening import encode_body, signed_opening
from gonka_node.slashing import (
    KIND_REPLAY_MISMATCH,
    ChallengeTerms,
    EvidenceLog,
    RoundIdentity,
    collect_evidence,
    verify_evidence,
)
from proto.gonka.v1 import aggregator_pb2 as pb
from training.checkpoint import load_checkpoint
from training.codecs import ErrorFeedback, get_codec
from training.data import Windows
from training.residual_commit import (
    ChunkLayout,
    Opening,
    commitment_layout,
    open_chunks,
    residual_root,
    zero_root,
)
from training.worker import Assignment, replay_round

CODEC = "topk:chunk=64,k=8,bits=2"
DECAY = 0.9
SAMPLE_MIN = 3 * 4096  # 3 of the micro model's 12 chunks


@pytest.fixture(scope="module")
def windows() -> Windows:
    return micro_windows()


def topk_context(kit: Kit, windows: Windows, codec: str = CODEC) -> EpochContext:
    return dataclasses.replace(
        micro_context(kit, kit.world.epoch, windows), codec_name=codec, codec=get_codec(codec), ef_decay=DECAY,
        residual_sample_min=SAMPLE_MIN,
    )


def start(kit: Kit, ctx: EpochContext) -> RoundEngine:
    """The aggregator on the kit's store (a second call: the same aggregator restarted)."""
    kit.settings = dataclasses.replace(kit.settings, max_payload_bytes=1 << 20, max_chunk_bytes=1 << 16)
    e = RoundEngine(ctx, kit.settings, kit.aggregation, Store(kit.tmp / "agg").open(),
                    ChainView(kit.world.chain.client(AGGREGATOR)), TrainingCheckpoints(), SigningKey(b"\x09" * 32),
                    clock=kit.clock, evidence=kit.evidence)
    kit.engines.append(e)
    e.start()
    return e


class TopkHost:
    """An honest host's side: its error feedback, the roots it signed, and its openings."""

    def __init__(self, kit: Kit, h: Host, layout: ChunkLayout, codec: str = CODEC) -> None:
        self.kit, self.h, self.layout, self.codec = kit, h, layout, codec
        self.ef = ErrorFeedback(get_codec(codec), DECAY)
        self.roots: list[bytes] = []

    def submit(self, e: RoundEngine, delta: Mapping[str, torch.Tensor], park: float = 0.0) -> None:
        """Compress and send `delta`; `park`: add this to every element of the residual kept and signed
        (what the payload did not leave behind)."""
        payload = self.ef.compress(delta)
        if park:
            self.ef.residual = {n: t + park for n, t in self.ef.residual.items()}
        self.roots.append(residual_root(self.ef.residual, self.layout))
        sub = self.kit.header(e, self.h, payload, codec=self.codec, residual_root=self.roots[-1])
        receipt = self.kit.run(e.submit(sub, sub.sign(self.h.key), chunks(payload, 4096), e.stream_guard("t")))
        assert receipt.body.accepted
        self.kit.run(e.checks.drain(sub.epoch, sub.round))

    def challenged(self, e: RoundEngine, round_: int) -> tuple[int, ...]:
        row = e.store.submission(e.ctx.epoch, round_, self.h.address)
        assert row is not None
        got = e.openings.challenge(row)
        assert got is not None
        return got.chunks

    def body(self, chunks_: tuple[int, ...]) -> tuple[Opening, Opening]:
        return open_chunks(self.ef.previous, self.layout, chunks_), open_chunks(self.ef.residual, self.layout, chunks_)

    def open(self, e: RoundEngine, round_: int, previous: Opening, current: Opening) -> OpeningRow:
        body = encode_body(previous, current)
        before = self.roots[-2] if len(self.roots) > 1 else zero_root(self.layout)
        info = pb.RoundInfo(chain_id=e.ctx.chain_id, registry=e.ctx.registry, epoch=e.ctx.epoch)
        header = signed_opening(info, round_, self.h.address, before, self.roots[-1], body, self.h.key)
        return self.kit.run(send_opening(e, header, body))


async def send_opening(e: RoundEngine, header: pb.OpeningHeader, body: bytes) -> OpeningRow:
    guard = StreamGuard(e.stream_limits, asyncio.Event(), "test opening").arm()
    try:
        return await e.openings.open(header, chunks(body, 4096), guard)
    finally:
        guard.disarm()


def honest(windows: Windows, base: Mapping[str, torch.Tensor], slot: int, round_: int) -> dict[str, torch.Tensor]:
    return replay_round(model(), INNER, windows, Assignment(SEED, slot, SLOTS), round_, base)


def slots(e: RoundEngine) -> dict[bytes, int]:
    return {m.address: m.slot for m in e.chain.members(e.ctx.epoch)}


def state(e: RoundEngine, round_: int) -> str:
    row = e.store.get_round(e.ctx.epoch, round_)
    assert row is not None
    return row.state


def by_host(e: RoundEngine, round_: int) -> dict[bytes, ContributionRow]:
    return {c.host: c for c in e.store.contributions(e.ctx.epoch, round_)}


def altered(opening: Opening, chunk: int, element: int) -> Opening:
    """`opening` with one fp32 value of chunk `chunk` changed (its path left as it was)."""
    data = bytearray(opening.chunks[chunk])
    value = torch.frombuffer(data, dtype=torch.float32)
    value[element] += 1e-3
    return dataclasses.replace(opening, chunks=(*opening.chunks[:chunk], bytes(data), *opening.chunks[chunk + 1:]))


def _top_k_round(kit: Kit, windows: Windows, codec: str = CODEC) -> tuple[EpochContext, RoundEngine, list[TopkHost],
                                                                         dict[bytes, int], dict[str, Tensor]]:
    """A top-k epoch's engine at round 1: its context, the three hosts, their slots, the initial model."""
    ctx = topk_context(kit, windows, codec)
    e = start(kit, ctx)
    layout = commitment_layout(ctx.spec, ctx.codec)
    hosts = [TopkHost(kit, h, layout, codec) for h in kit.hosts]
    return ctx, e, hosts, slots(e), {n: p.detach().clone() for n, p in model().named_parameters()}


def test_an_honest_opening_passes_a_missing_one_is_excluded_an_altered_one_fails_and_e_prev_meets_its_bound(
    kit: Kit, windows: Windows, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "gonka_node.aggregator.rounds")
    ctx, e, (h1, h2, h3), where, base = _top_k_round(kit, windows)
    for host in (h1, h2, h3):  # h2 keeps (and signs) a residual its payload did not leave: found in round 2
        host.submit(e, honest(windows, base, where[host.h.address], 1), park=0.05 if host is h2 else 0.0)
    kit.run(e.tick())  # everyone submitted: the close reveals the seed and waits for the openings
    row = e.store.get_round(ctx.epoch, 1)
    assert row is not None and row.round_seed is not None and row.seed_complete_ms == kit.clock.ms
    assert state(e, 1) == "open" and e.closing
    sample = h1.challenged(e, 1)
    assert len(sample) == 3 and sample != h2.challenged(e, 1)  # per host, three of the twelve chunks
    h1.open(e, 1, *h1.body(sample))
    previous, current = h3.body(h3.challenged(e, 1))
    h3.open(e, 1, previous, altered(current, 1, 5))
    kit.clock.ms += 120_000
    kit.run(e.tick())
    assert state(e, 1) == "open"  # h2 has until the seed's completion + 120 s, that millisecond included
    due = clock_text(row.seed_complete_ms + 120_000)
    # The wait is said once (at INFO) however many ticks retry it; each retry says who is missing (DEBUG).
    assert [m for m in caplog.messages if "waiting for" in m] == [
        f"round {ctx.epoch}/1: waiting for 3 challenged hosts to open their residual (due by {due})"]
    assert caplog.messages[-1].endswith(f"1 of 3 challenged hosts have not opened their residual (due by {due})")
    kit.clock.ms += 1
    kit.run(e.tick())
    assert state(e, 1) == "finalized"
    got = by_host(e, 1)
    one, two, three = got[h1.h.address], got[h2.h.address], got[h3.h.address]
    assert (one.aggregated, one.reward, two.aggregated, two.reward, three.aggregated, three.reward) == (
        True, ctx.reward_per_round, False, 0, False, 0)
    opened_one = e.store.opening(ctx.epoch, 1, h1.h.address)
    assert opened_one is not None and one.reasons[0] == (
        f"{PASSED} cosine +1.0000, norm ratio 1.0000 with the replay of slot {where[h1.h.address]}'s round 1 "
        f"(on 3 opened residual chunks, opening sha256 {opened_one.body_sha256.hex()})")  # e_{r-1} is zero: no note
    assert two.reasons == [f"{NO_OPENING}: the residual was not opened by {clock_text(row.seed_complete_ms + 120_000)} "
                           "(3 chunks challenged): excluded and unpaid, not slashed"]
    stored = e.store.opening(ctx.epoch, 1, h3.h.address)
    assert stored is not None
    assert three.reasons == [f"{MISMATCH}: e_r's opened chunks do not verify against the root signed with this "
                             f"round's payload (opening sha256 {stored.body_sha256.hex()})"]
    # The altered opening is slashable evidence; the missing one is not.
    records = collect_evidence(e.store, ctx.epoch, RoundIdentity.of(ctx), EvidenceLog(kit.tmp / "scan"))
    assert [(r.kind, r.host.lower()) for r in records] == [(KIND_REPLAY_MISMATCH, "0x" + h3.h.address.hex())]
    # It carries the signed opening it was judged on; a voter checks it is the host's.
    evidence, kept = records[0], kit.tmp / "scan" / f"{stored.body_sha256.hex()}.opening"
    assert evidence.other is not None and evidence.other["opening"]["body_sha256"] == stored.body_sha256.hex()
    assert kept.read_bytes() == Path(stored.path).read_bytes()
    key, scan = bytes(h3.h.key.verify_key), kit.tmp / "scan"
    # Its claim, that the altered body does not answer the challenge, is re-checked by a voter against
    # the challenge the voter knows (the chain's seed, the recipe's layout and sample), never the
    # record's own words: without those terms, or with a record naming others, it does not verify.
    seed = e.store.get_round(ctx.epoch, 1).round_seed
    assert seed is not None and evidence.other["claim"] == "unverified"
    terms = ChallengeTerms(seed, commitment_layout(ctx.spec, ctx.codec), ctx.residual_sample, ctx.residual_sample_min)
    assert verify_evidence(evidence, key, scan, terms) and not verify_evidence(evidence, key, scan)
    assert not verify_evidence(evidence, bytes(h1.h.key.verify_key), scan, terms)
    framed = dataclasses.replace(evidence, other={**evidence.other, "challenge": {
        **evidence.other["challenge"], "round_seed": bytes(32).hex()}})  # another seed draws other chunks
    assert not verify_evidence(framed, key, scan, terms)
    # Claimed the other way ("judged": it answers and failed on its payload or replay), it is refused.
    judged = dataclasses.replace(evidence, other={**evidence.other, "claim": "judged"})
    assert not verify_evidence(judged, key, scan, terms)
    body = kept.read_bytes()
    kept.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))
    assert not verify_evidence(evidence, key, scan, terms)  # not the body the host signed
    kept.write_bytes(body)
    # The payload the mismatch was found on is kept with it: a voter re-runs the replay from the record.
    sent = e.store.submission(ctx.epoch, 1, h3.h.address)
    assert sent is not None and evidence.payload_file == f"{sent.payload_sha256.hex()}.payload"
    payload_kept = scan / evidence.payload_file
    assert payload_kept.read_bytes() == Path(sent.path).read_bytes() and verify_evidence(evidence, key, scan, terms)
    payload_kept.write_bytes(payload_kept.read_bytes() + b"\x00")
    assert not verify_evidence(evidence, key, scan, terms)  # not the payload the host signed

    # Round 2: e_{r-1} opens against round 1's signed roots (h2's too, which it never opened), bounded by
    # the round-1 payload the aggregator kept (h2's) or not (h1's, removed).
    base = load_checkpoint(e.store.checkpoint_path(ctx.epoch, 1)).tensors
    for host in (h1, h2):
        host.submit(e, honest(windows, base, where[host.h.address], 2))
    kit.clock.ms += 11_000  # past the round's deadline with a quorum of two
    kit.run(e.tick())
    for host in (h1, h2):
        assert host.ef.previous and host.open(e, 2, *host.body(host.challenged(e, 2))).previous_root == host.roots[0]
    gone = e.store.submission(ctx.epoch, 1, h1.h.address)
    assert gone is not None
    Path(gone.path).unlink()  # an operator removed h1's round-1 payload: e_{r-1} has no bound to meet
    kit.run(e.tick())  # every challenged host opened: no wait for the deadline
    assert state(e, 2) == "finalized"
    got = by_host(e, 2)
    one, two = got[h1.h.address], got[h2.h.address]
    assert one.aggregated and one.reasons[0].startswith(f"{PASSED} cosine +1.0000")
    assert one.reasons[0].endswith("; round 1's payload is no longer held: e_{r-1} checked against its root only)")
    # h2's claimed Δ̂ is its true Δ (error feedback carried the parked residual on), but e_{r-1} is not
    # what its round-1 payload left.
    assert not two.aggregated and two.reasons[0].startswith(
        f"{MISMATCH}: the host's round-1 payload is not the top-k compression of its decode plus e_{{r-1}}: ")
    # Its evidence: an opening that answers its challenge ("judged": the payload check failed, which a
    # voter re-runs with the payloads); claimed not to answer it, the record is refused.
    records = collect_evidence(e.store, ctx.epoch, RoundIdentity.of(ctx), EvidenceLog(kit.tmp / "scan2"))
    found = next(r for r in records if r.round == 2)
    assert found.other is not None and found.other["claim"] == "judged"
    assert verify_evidence(found, bytes(h2.h.key.verify_key), kit.tmp / "scan2")
    unverified = dataclasses.replace(found, other={**found.other, "claim": "unverified"})
    assert not verify_evidence(unverified, bytes(h2.h.key.verify_key), kit.tmp / "scan2")


def test_a_restart_resumes_the_wait_an_inflated_update_fails_on_length_and_a_parked_residual_on_its_bound(kit: Kit, windows: Windows) -> None:
    ctx, e, (h1, h2, h3), where, base = _top_k_round(kit, windows)
    for host, scale in ((h1, 2.0), (h2, 1.0)):  # h1 sends twice its Δ, residual consistent with it
        host.submit(e, {n: t * scale for n, t in honest(windows, base, where[host.h.address], 1).items()})
    h3.submit(e, honest(windows, base, where[h3.h.address], 1), park=0.5)  # signs a residual its payload did not leave
    kit.run(e.tick())
    for host in (h1, h2):
        host.open(e, 1, *host.body(host.challenged(e, 1)))
    seed_time = kit.clock.ms
    e.checks.close()
    e.store.close()
    kit.clock.ms += 60_000
    e = start(kit, ctx)  # restarted mid-wait: the stored seed and its time, the stored openings
    kit.run(e.tick())
    kit.run(e.tick())
    assert state(e, 1) == "open"
    row = e.store.submission(ctx.epoch, 1, h3.h.address)
    assert row is not None
    challenge = e.openings.challenge(row)
    assert challenge is not None and challenge.deadline_ms == seed_time + 120_000
    h3.open(e, 1, *h3.body(challenge.chunks))
    kit.run(e.tick())
    assert state(e, 1) == "finalized"
    got = by_host(e, 1)
    assert [got[h.h.address].aggregated for h in (h1, h2, h3)] == [False, True, False]
    assert got[h1.h.address].reasons[0].startswith(f"{MISMATCH}: cosine +1.0000, norm ratio 2.0000 with the replay")
    assert got[h3.h.address].reasons[0].startswith(
        f"{MISMATCH}: this round's payload is not the top-k compression of its decode plus e_r: ")
    assert [got[h.h.address].reward for h in (h1, h2, h3)] == [0, ctx.reward_per_round, 0]


def test_only_a_replayed_top_k_epoch_challenges_its_hosts(kit: Kit, windows: Windows) -> None:
    ctx = topk_context(kit, windows)
    assert challenges_round(ctx)
    for off in ({"replay": None}, {"replay_probability": 0.0}, {"codec_name": "fp32", "codec": get_codec("fp32")}):
        assert not challenges_round(dataclasses.replace(ctx, **off)), off  # nothing to replay, or a dense payload


def unlike(update: Mapping[str, Tensor], n: int) -> dict[str, Tensor]:
    """`update` itself (n = 0), or another host's of its size that neither copies nor sketches like it."""
    g = torch.Generator().manual_seed(n)
    return {name: t + n * t.std() * torch.randn(t.shape, generator=g) for name, t in update.items()}


def test_an_undecodable_body_or_payload_and_an_e_prev_off_its_root_fail_and_a_held_bound_met_adds_no_note(
    kit: Kit, windows: Windows
) -> None:
    ctx, e, (h1, h2, h3), where, base = _top_k_round(kit, windows)
    update = honest(windows, base, where[h3.h.address], 1)
    for n, host in enumerate((h3, h1, h2)):  # only h3's is replayed to a pass; the others fail before theirs
        host.submit(e, unlike(update, n))
    kit.run(e.tick())
    previous, current = h1.body(h1.challenged(e, 1))
    h1.open(e, 1, altered(previous, 0, 5), current)  # e_{r-1} is zero: its altered chunk misses the zero root
    damaged = h2.open(e, 1, *h2.body(h2.challenged(e, 1)))
    Path(damaged.path).write_bytes(Path(damaged.path).read_bytes()[:-1])  # the stored body lost a byte
    h3.open(e, 1, *h3.body(h3.challenged(e, 1)))
    kit.run(e.tick())
    assert state(e, 1) == "finalized"
    got = {h: c.reasons[0] for h, c in by_host(e, 1).items()}
    digest = {h.h.address: e.store.opening(ctx.epoch, 1, h.h.address).body_sha256.hex() for h in (h1, h2, h3)}
    assert got[h1.h.address] == (f"{MISMATCH}: e_{{r-1}}'s opened chunks do not verify against the root the host "
                                 f"signed (opening sha256 {digest[h1.h.address]})")
    assert got[h2.h.address] == (f"{MISMATCH}: the opening body is not a ResidualOpening: Error parsing message with type "
                                 f"'gonka.v1.ResidualOpening' (opening sha256 {digest[h2.h.address]})")
    assert got[h3.h.address].startswith(f"{PASSED} cosine +1.0000")
    # Round 2: h3's e_{r-1} meets the round-1 payload the aggregator holds (no note); h2's round-1 payload
    # no longer decodes, so its e_{r-1} cannot be checked: a failed opening, said so.
    base = load_checkpoint(e.store.checkpoint_path(ctx.epoch, 1)).tensors
    update = honest(windows, base, where[h3.h.address], 2)
    for n, host in enumerate((h3, h2)):
        host.submit(e, unlike(update, n))
    kit.clock.ms += 11_000
    kit.run(e.tick())
    for host in (h2, h3):
        host.open(e, 2, *host.body(host.challenged(e, 2)))
    held = e.store.submission(ctx.epoch, 1, h2.h.address)
    assert held is not None
    Path(held.path).write_bytes(b"\x00" * 8)
    kit.run(e.tick())
    assert state(e, 2) == "finalized"
    got = {h: c.reasons[0] for h, c in by_host(e, 2).items()}
    digest = {h.h.address: e.store.opening(ctx.epoch, 2, h.h.address).body_sha256.hex() for h in (h2, h3)}
    assert got[h3.h.address] == (
        f"{PASSED} cosine +1.0000, norm ratio 1.0000 with the replay of slot {where[h3.h.address]}'s round 2 "
        f"(on 3 opened residual chunks, opening sha256 {digest[h3.h.address]})")
    assert got[h2.h.address] == (f"{MISMATCH}: the host's round-1 payload cannot be checked against e_{{r-1}}: "
                                 f"payload_misfit: the header is not topk(64, 8, 2)'s for this spec (opening sha256 {digest[h2.h.address]})")


def test_a_codec_chunk_that_does_not_divide_4096_commits_in_whole_codec_chunks_and_an_honest_opening_passes(
    kit: Kit, windows: Windows
) -> None:
    # chunk 3000: the commitment's chunks are 6,000 elements (two codec chunks), not DEFAULT_CHUNK's 4,096;
    # the close must judge the opening in the layout the host committed in.
    ctx, e, (h1, h2, _), where, base = _top_k_round(kit, windows, "topk:chunk=3000,k=64,bits=2")
    layout = commitment_layout(ctx.spec, ctx.codec)
    assert layout.chunk == 6000 and h1.layout == layout
    for host in (h1, h2):
        host.submit(e, honest(windows, base, where[host.h.address], 1))
    kit.clock.ms += 11_000  # past the round's deadline with a quorum of two
    kit.run(e.tick())
    opened = {host.h.address: host.open(e, 1, *host.body(host.challenged(e, 1))) for host in (h1, h2)}
    kit.run(e.tick())
    assert state(e, 1) == "finalized"
    got = by_host(e, 1)
    assert [got[a].reasons[0] for a in opened] == [
        f"{PASSED} cosine +1.0000, norm ratio 1.0000 with the replay of slot {where[a]}'s round 1 "
        f"(on 3 opened residual chunks, opening sha256 {row.body_sha256.hex()})" for a, row in opened.items()]
