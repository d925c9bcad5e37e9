"""A top-k host's answer to the challenge of its round (docs/PROTOCOL.md "Challenge and opening").

A real host (one process, its own chain world) trains rounds 1 and 2 of a top-k epoch; an aggregator
stand-in challenges round 2 (the aggregator's side is another branch's) and records what comes. The
opening verifies against the roots the host signed, and its Δ̂ = decode(P_2) + e_2 − d·e_1 is the Δ
the host trained; a challenge that is not the seed's sample, a state that does not open to the signed
roots, and a refusal are each one line and no (further) upload.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import test_host_node as base
import torch
from torch import Tensor

from gonka_node.core.client import SubmitRejected
from gonka_node.core.opening import challenge, decode_body, record_of
from gonka_node.core.recipe import Recipe
from gonka_node.host.events import HostEvents
from gonka_node.host.follow import GlobalModel
from gonka_node.host.node import HostNode
from gonka_node.host.opening import sample_settings
from gonka_node.host.rig_round import LocalRounds, RigError, RigOptions, RigRounds, make_worker
from gonka_node.host.store import HostStore, Progress
from proto.gonka.v1 import aggregator_pb2 as pb
from training.codecs import get_codec, round_seed
from training.model import ModelConfig
from training.residual_commit import (
    ChunkLayout,
    claimed_delta,
    compare,
    gather_chunks,
    residual_root,
    verify_opening,
    zero_root,
)
from training.worker import Assignment

TOPK = "topk:chunk=4096,k=128,bits=2"
SEED = b"\x11" * 32


class Notes(HostEvents):
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)


class Challenger:
    """An aggregator that reports `status` for the host's submission and takes (or refuses) openings."""

    target = "127.0.0.1:9"

    def __init__(self, status: pb.SubmissionStatus, refusal: SubmitRejected | None = None) -> None:
        self.status, self.refusal = status, refusal
        self.opened: list[tuple[pb.OpeningHeader, bytes, int]] = []

    def submission(self, epoch: int, round_: int, host: bytes) -> pb.SubmissionStatus:
        return self.status

    def open_residual(self, header: pb.OpeningHeader, body: bytes, chunk: int) -> pb.OpeningReceipt:
        self.opened.append((header, body, chunk))
        if self.refusal is not None:
            raise self.refusal
        return pb.OpeningReceipt(accepted=True)


@dataclass
class Trained:
    node: HostNode
    notes: Notes
    progress: Progress
    info: pb.RoundInfo
    layout: ChunkLayout
    delta: dict[str, Tensor]  # round 2's pseudo-gradient as the host trained it
    payload: bytes  # round 2's
    sample: tuple[int, ...]  # the seed's sample for this host and round 2
    gm: GlobalModel  # the held global model (rounds 3 and 4 train from it too)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    tmp = tmp_path_factory.mktemp("opening")
    # a sample minimum of 3 of the tiny model's 31 chunks: a sample is a strict subset, so one drawn for
    # another seed, round or host is another set of chunks
    world = base.build_world(tmp, replay_probability=0.0, codec=TOPK, inner_steps=4, n_rounds=4,
                             residual_sample_min=3 * 4096)
    notes = Notes()
    node = base.make_node(world, 1, "127.0.0.1:9", tmp / "host1", events=notes)  # no aggregator is asked
    gm, progress = node._prepare()
    node._spec, node._busy_until = {n: tuple(t.shape) for n, t in gm.params.items()}, time.monotonic()
    first = node._train(1, gm, progress)
    node._keep(first)  # where the root it is signed with is hashed
    node._record_accepted(1, first.payload, progress)
    worker = node._local_worker()
    assert worker is not None
    twin = make_worker(world.recipe, worker.assignment, None)  # the same state: on a CPU the same Δ
    twin.load_state_dict(copy.deepcopy(worker.state_dict()))
    delta = twin.local_delta(2, gm.params)[0]
    second = node._train(2, gm, progress)
    node._keep(second)  # where the root it is signed with is hashed
    node._record_accepted(2, second.payload, progress)
    assert twin.feedback.compress(delta, twin.round_codec(2)) == second.payload  # Δ is the host's, bit for bit
    layout = ChunkLayout.of(node._spec)
    sample = challenge(SEED, 2, node.host_bytes, layout, *sample_settings(world.recipe))
    info = pb.RoundInfo(chain_id=world.deployment.chain_id, registry=bytes.fromhex(world.deployment.registry[2:]),
                        epoch=world.epoch, round=2)
    return Trained(node, notes, progress, info, layout, delta, second.payload, sample, gm)


def challenged(sample: tuple[int, ...]) -> pb.SubmissionStatus:
    return pb.SubmissionStatus(state=pb.SubmissionStatus.CHALLENGED, round_seed=SEED, challenged_chunks=sample,
                               opening_deadline_unix_ms=int(time.time() * 1000) + 60_000)


def answer(t: Trained, aggregator: Challenger, progress: Progress | None = None) -> list[str]:
    """The host's answer to `aggregator`'s challenge; the notes it logged meanwhile."""
    t.node.challenges.aggregator = aggregator  # type: ignore[assignment]
    before = len(t.notes.notes)
    assert t.node.challenges.answer(t.info, progress or t.progress)  # settled: nothing more to do
    return t.notes.notes[before:]


def test_the_opening_verifies_against_the_signed_roots_and_reproduces_the_trained_delta(trained: Trained) -> None:
    t = trained
    agg = Challenger(challenged(t.sample))
    assert answer(t, agg) == [f"round 2: challenged; opened {len(t.sample)} chunks of its residual "
                              f"({len(agg.opened[0][1])} bytes)"]
    [(header, body, _)] = agg.opened
    roots = {r: bytes.fromhex(t.progress.residual_roots[str(r)]) for r in (1, 2)}
    assert (header.previous_root, header.residual_root) == (roots[1], roots[2])
    assert roots[1] != zero_root(t.layout)  # round 1 left a residual: e_1 is no zero tensor
    assert record_of(header).verify(header.signature, t.node.keys.node_public_key)
    previous, current = decode_body(body, t.sample)
    assert verify_opening(roots[1], previous, t.layout, t.sample)
    assert verify_opening(roots[2], current, t.layout, t.sample)
    recipe = t.node.recipe
    decoded = get_codec(recipe.codec).for_round(round_seed(recipe.epoch_seed, 2)).decode(t.payload, t.node._spec)
    claimed = claimed_delta(gather_chunks(decoded, t.layout, t.sample).float(), previous.values(), current.values(),
                            recipe.ef_decay)
    cos, ratio = compare(claimed, gather_chunks(t.delta, t.layout, t.sample))
    assert cos > 1 - 1e-9 and abs(ratio - 1) < 1e-6
    # decode(P_2) alone, what a top-k replay compared before the residuals were opened, is far off.
    cos_wrong, _ = compare(gather_chunks(decoded, t.layout, t.sample).double(), gather_chunks(t.delta, t.layout, t.sample))
    assert cos_wrong < 0.9


def test_a_challenge_that_is_not_the_seeds_sample_is_not_answered(trained: Trained) -> None:
    t = trained
    settings = sample_settings(t.node.recipe)
    other_host = b"\x42" * 20
    others = (t.sample[:-1],  # one chunk short
              (*t.sample[1:], t.layout.n_chunks),  # one swapped for a chunk the layout does not have
              challenge(SEED, 2, other_host, t.layout, *settings),  # another host's sample
              challenge(SEED, 1, t.node.host_bytes, t.layout, *settings),  # another round's
              challenge(b"\x12" * 32, 2, t.node.host_bytes, t.layout, *settings))  # another seed's
    assert len(t.sample) == 3 < t.layout.n_chunks and all(set(o) != set(t.sample) for o in others)
    for chunks in others:
        agg = Challenger(challenged(chunks))
        [line] = answer(t, agg)
        assert line.startswith(f"round 2: the aggregator's challenge ({len(chunks)} chunks) is not the sample of "
                               f"the round seed {SEED.hex()[:16]}…")
        assert agg.opened == []


def test_a_state_that_does_not_open_to_the_signed_root_sends_nothing(trained: Trained) -> None:
    t = trained
    other = replace(t.progress, residual_roots={**t.progress.residual_roots, "2": "ab" * 32})
    agg = Challenger(challenged(t.sample))
    assert answer(t, agg, other) == [
        f"round 2: the residual e_r this host holds does not open to the root it signed ({'ab' * 8}…): its "
        "state is not the one that signed it; not opened"
    ]
    assert agg.opened == []


def test_a_refused_opening_is_one_line_and_not_sent_again(trained: Trained) -> None:
    t = trained
    refusal = SubmitRejected(grpc.StatusCode.FAILED_PRECONDITION, "NOT_CHALLENGED", "already opened", None)
    agg = Challenger(challenged(t.sample), refusal)
    assert answer(t, agg) == ["round 2: the opening of its residual was refused: NOT_CHALLENGED: already opened"]
    assert len(agg.opened) == 1


def test_a_host_keeps_asking_until_challenged_or_settled(trained: Trained) -> None:
    t = trained
    for state, settled in ((pb.SubmissionStatus.PENDING, False), (pb.SubmissionStatus.CHECKED, False),
                           (pb.SubmissionStatus.OPENED, True), (pb.SubmissionStatus.FAILED, True)):
        agg = Challenger(pb.SubmissionStatus(state=state))
        t.node.challenges.aggregator = agg  # type: ignore[assignment]
        progress = copy.deepcopy(t.progress)
        assert t.node.challenges.answer(t.info, progress) is settled
        assert agg.opened == []
        # FAILED: no submission; the round's root is forgotten (e_{r−1} of the next is the one before)
        assert ("2" in progress.residual_roots) is (state != pb.SubmissionStatus.FAILED)


class Retried(Challenger):
    """The first attempt's answer is lost (UNAVAILABLE) though it was stored; the retry is NOT_CHALLENGED."""

    def open_residual(self, header: pb.OpeningHeader, body: bytes, chunk: int) -> pb.OpeningReceipt:
        self.opened.append((header, body, chunk))
        if len(self.opened) == 1:
            self.status = pb.SubmissionStatus(state=pb.SubmissionStatus.OPENED)
            raise SubmitRejected(grpc.StatusCode.UNAVAILABLE, "", "connection reset", None)
        raise SubmitRejected(grpc.StatusCode.FAILED_PRECONDITION, "NOT_CHALLENGED", "already stored", None)


def test_a_retry_refused_as_not_challenged_finds_its_first_attempt_stored(trained: Trained) -> None:
    t = trained
    agg, sleep = Retried(challenged(t.sample)), t.node.challenges.sleep
    t.node.challenges.sleep = lambda _s: None
    try:
        [line] = answer(t, agg)
    finally:
        t.node.challenges.sleep = sleep
    assert len(agg.opened) == 2 and line.startswith("round 2: challenged; opened 3 chunks of its residual (") \
        and line.endswith("bytes, stored by an earlier attempt)")


def test_a_rig_opens_the_union_of_its_processes_residuals(tmp_path: Path) -> None:
    """A sharded rig's processes each keep the residuals of the tensors they own in their state files;
    the daemon opens from the union of those files of the rig's current version."""
    recipe = Recipe(model=ModelConfig.preset("tiny"), grad_accum=2)
    rounds = RigRounds(RigOptions(procs=2), recipe, Assignment(0, 0, 4), None, tmp_path)
    assert rounds.residuals() == ({}, {})  # before the first round: zero
    owned = ({"a": torch.full((3,), 1.0)}, {"b": torch.full((2,), 2.0)})
    version = tmp_path / "state" / "after-2"
    version.mkdir(parents=True)
    for rank, mine in enumerate(owned):
        previous = {n: t - 0.5 for n, t in mine.items()}
        torch.save({"inner": {}, "feedback": {"residual": mine, "previous": previous}}, version / f"rank-{rank}.pt")
    rounds.base = 2
    previous, current = rounds.residuals()
    assert {n: t.tolist() for n, t in current.items()} == {"a": [1.0] * 3, "b": [2.0] * 2}
    assert {n: t.tolist() for n, t in previous.items()} == {"a": [0.5] * 3, "b": [1.5] * 2}
    layout = ChunkLayout((("a", 3), ("b", 2)), chunk=2)
    assert residual_root(current, layout) == residual_root({"a": owned[0]["a"], "b": owned[1]["b"]}, layout)
    # Overlapped: round 3 trained since, the kept state of round 2 names version 2, which the rig keeps.
    rounds.base = 3
    kept = rounds.residuals_of({"rig": {"base": 2, "procs": 2}})
    assert [{n: t.tolist() for n, t in part.items()} for part in kept] == [
        {n: t.tolist() for n, t in part.items()} for part in (previous, current)]
    with pytest.raises(RigError, match="one-process host"):
        rounds.residuals_of({"inner": {}, "feedback": {}})


def test_an_overlapped_host_opens_the_state_kept_with_its_round_until_the_next_but_one(
    trained: Trained, tmp_path: Path,
) -> None:
    """An overlapped top-k host keeps round r's worker state while it trains and keeps round r + 1, and
    opens round r's residuals from it (mapped from disk), not from the worker; round r + 2's save drops it."""
    t, store = trained, HostStore(tmp_path)
    rounds = t.node.rounds
    roots = (bytes.fromhex(t.progress.residual_roots["1"]), bytes.fromhex(t.progress.residual_roots["2"]))
    store.save_sent(2, t.payload, roots[1], rounds.state_dict(), keep_previous=True)
    empty = {"inner": {}, "feedback": {"residual": {}, "previous": {}}}
    store.save_sent(3, b"round 3", b"\x03" * 32, empty, keep_previous=True)
    kept = store.load_sent(2)
    assert kept is not None and kept.has_state and kept.residual_root == roots[1]
    previous, current = rounds.residuals_of(store.load_sent_state(2, mmap=True))
    assert (residual_root(previous, t.layout), residual_root(current, t.layout)) == roots
    store.save_sent(4, b"round 4", b"\x04" * 32, empty, keep_previous=True)
    assert store.load_sent(2) is None and store.load_payload(3) == b"round 3"
    store.save_sent(5, b"round 5", b"\x05" * 32, empty)  # not kept: overlap "off" or a dense codec
    assert [getattr(store.load_sent(r), "has_state", None) for r in (4, 5)] == [False, True]
    with pytest.raises(RigError, match="rig of 2 processes"):
        rounds.residuals_of({"rig": {"base": 2, "procs": 2}})


class Closing:
    """The chain as the host sees it while its round 2 closes: final after `polls` looks."""

    def __init__(self, real: object, polls: int) -> None:
        self.real, self.polls, self.looked = real, polls, 0
        self.deployment = real.deployment  # type: ignore[attr-defined]
        self.chain_id = real.chain_id  # type: ignore[attr-defined]

    def latest_round(self, epoch: int) -> int:
        self.looked += 1
        return 1 if self.looked <= self.polls else 2


class Sequenced(Challenger):
    """Reports the host's submission CHECKED for a while, then CHALLENGED."""

    def __init__(self, statuses: list[pb.SubmissionStatus]) -> None:
        super().__init__(statuses[-1])
        self.statuses = statuses

    def submission(self, epoch: int, round_: int, host: bytes) -> pb.SubmissionStatus:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


def test_a_host_restarted_while_its_round_closes_still_answers_its_challenge(trained: Trained) -> None:
    """No round is open (round 2 waits for its openings) and round 2 is not final: the host, restarted
    with round 2 recorded as submitted, polls GetSubmission until final and opens once, the header bound
    to the chain's id and registry; a round it did not submit to is not polled for."""
    t = trained
    real = t.node.chain
    agg = Sequenced([pb.SubmissionStatus(state=pb.SubmissionStatus.CHECKED)] * 3 + [challenged(t.sample)])
    t.node.challenges.aggregator = agg  # type: ignore[assignment]
    try:
        t.node.challenges.chain = Closing(real, polls=8)  # type: ignore[assignment]
        t.node.challenges.await_closing(2, replace(t.progress, max_chunk_bytes=1000))  # the round's limit, recorded
        assert t.node.challenges.chain.looked == 9  # type: ignore[attr-defined]  # until final
        [(header, _, chunk)] = agg.opened  # answered once, though polled on
        assert (header.chain_id, header.registry, header.epoch, header.round) == (
            t.info.chain_id, t.info.registry, t.info.epoch, 2)
        assert chunk == 1000
        t.node.challenges.chain = Closing(real, polls=8)  # type: ignore[assignment]
        t.node.challenges.await_closing(3, t.progress)
        assert t.node.challenges.chain.looked == 0 and len(agg.opened) == 1  # type: ignore[attr-defined]
    finally:
        t.node.challenges.chain = real


class KeptOnly(LocalRounds):
    """A worker whose live residuals must not be opened (an overlapped host has compressed since)."""

    def residuals(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        raise AssertionError("the live worker's residuals were opened")


class Reopened(Sequenced):
    """`Sequenced`, with no round open (round 2 waits for its openings)."""

    def open_round(self) -> pb.RoundInfo | None:
        return None


def test_an_overlapped_host_restarted_before_its_round_is_final_answers_from_a_thread(
    trained: Trained, tmp_path: Path,
) -> None:
    """Killed after round 2's upload, before its upload thread answered: the restarted overlapped host
    asks for round 2's challenge from a thread and opens the residuals of the state kept with round 2
    (not the live worker's), against the roots its progress
    recorded; once round 2 is final nothing is asked."""
    t = trained
    twin = copy.copy(t.node)  # the same worker, keys and chain; an overlapped recipe, its own state folder
    twin.__dict__.pop("challenges", None)  # built again from the twin's recipe, store and worker
    twin.recipe, twin.store, twin.residual_roots = replace(t.node.recipe, overlap="delayed"), HostStore(tmp_path), {}
    roots = (bytes.fromhex(t.progress.residual_roots["1"]), bytes.fromhex(t.progress.residual_roots["2"]))
    twin.store.save_sent(2, t.payload, roots[1], t.node.rounds.state_dict())
    worker = t.node._local_worker()
    assert worker is not None
    twin.rounds = KeptOnly(worker)
    agg = Reopened([pb.SubmissionStatus(state=pb.SubmissionStatus.CHECKED)] * 2 + [challenged(t.sample)])
    twin.aggregator = agg  # type: ignore[assignment]
    stop = twin.challenges.answer_restarted(t.progress, latest=1)
    assert stop is not None
    deadline = time.monotonic() + 30
    while not agg.opened and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    [(header, body, _)] = agg.opened
    record = record_of(header)
    assert (record.round, record.previous_root, record.residual_root) == (2, roots[0], roots[1])
    previous, current = decode_body(body, t.sample)
    assert verify_opening(roots[0], previous, t.layout, t.sample) and verify_opening(roots[1], current, t.layout, t.sample)
    assert twin.challenges.answer_restarted(t.progress, latest=2) is None


class Duplicate:
    """An aggregator holding this host's round-3 payload already (DUPLICATE), whose checks it failed."""

    target = "127.0.0.1:9"

    def submit(self, *args: object, **kwargs: object) -> pb.Receipt:
        raise SubmitRejected(grpc.StatusCode.ALREADY_EXISTS, "DUPLICATE", "already submitted", None)

    def submission(self, epoch: int, round_: int, host: bytes) -> pb.SubmissionStatus:
        return pb.SubmissionStatus(state=pb.SubmissionStatus.FAILED, message="norm too large")


def test_a_failed_round_is_undone_and_the_next_challenge_opens_against_the_round_before(trained: Trained) -> None:
    """(Last: it trains rounds 3 and 4 on the module's host.) Round 3 gets a receipt, then FAILS its
    checks: the host undoes it (worker state and root), so round 4's opening signs e_{r−1} = e_2 under
    round 2's root — the aggregator's rule, the residual after the host's last *checked* payload — and it
    verifies. A restarted host's DUPLICATE of a failed payload is not counted as accepted either."""
    t, node = trained, trained.node
    progress = copy.deepcopy(t.progress)
    info = {r: replace_round(t.info, r) for r in (3, 4)}
    before = node.rounds.snapshot()
    third = node._train(3, t.gm, progress)
    node._keep(third)  # where the root it is signed with is hashed
    node.aggregator = node.challenges.aggregator = Duplicate()  # type: ignore[assignment]
    assert node._submit(info[3], third.payload, 1) == (False, "DUPLICATE of a payload that failed its checks: "
                                                              "norm too large")
    node._record_accepted(3, third.payload, progress)
    node._before_round[3] = before
    assert node.challenges.answer(info[3], progress)  # FAILED: settled, and undone
    assert "3" not in progress.submitted and "3" not in progress.residual_roots
    assert residual_root(node.rounds.residuals()[1], t.layout).hex() == progress.residual_roots["2"]
    fourth = node._train(4, t.gm, progress)
    node._keep(fourth)  # where the root it is signed with is hashed
    node._record_accepted(4, fourth.payload, progress)
    sample = challenge(SEED, 4, node.host_bytes, t.layout, *sample_settings(node.recipe))
    agg = Challenger(challenged(sample))
    node.challenges.aggregator = agg  # type: ignore[assignment]
    assert node.challenges.answer(info[4], progress)
    [(header, body, _)] = agg.opened
    roots = node.residual_roots  # hashed where each round was saved (`_keep`)
    assert header.previous_root.hex() == progress.residual_roots["2"] != roots[3].hex()
    previous, current = decode_body(body, sample)
    assert verify_opening(header.previous_root, previous, t.layout, sample)
    assert verify_opening(roots[4], current, t.layout, sample)


def replace_round(info: pb.RoundInfo, round_: int) -> pb.RoundInfo:
    out = pb.RoundInfo()
    out.CopyFrom(info)
    out.round = round_
    return out
