"""OpenResidual's checks: take a challenged host's opening, or refuse it storing nothing.

Order (docs/PROTOCOL.md "Challenge and opening"): the header's field widths (MALFORMED), chain and
registry (WRONG_CHAIN), the host on chain and its signature (UNKNOWN_HOST, BAD_SIGNATURE, as Submit),
a CHALLENGED submission of the round (NOT_CHALLENGED: never picked, not checked, or already opened;
UNAVAILABLE, retryable, while an earlier stream of the host's opening has not ended), the deadline (LATE), the two roots (ROOT_MISMATCH: this round's signed root, and the root of
the host's last earlier checked submission of the epoch or the zero root), the declared body length
against what the challenge's chunks can take (OVERSIZE); then the body streams (chunk limit, TRUNCATED,
DIGEST_MISMATCH) into `incoming/`, and is stored (file fsync'd beside the payloads, row committed)
before the receipt. Whether the chunks verify against the roots, fit the payloads and agree with the
replay is the close's verdict (aggregator/opened_replay.py): a signed opening that fails it is evidence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from eth_utils import to_checksum_address

from gonka_node.aggregator.challenges import Challenge, challenge_of, max_body_bytes, previous_root
from gonka_node.aggregator.engine_types import clock_text
from gonka_node.aggregator.ingest import StreamGuard, receive_payload
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.store import OpeningRow, SubmissionRow
from gonka_node.core.envelope import EnvelopeError
from gonka_node.core.opening import OpeningRecord, record_of
from proto.gonka.v1 import aggregator_pb2 as pb
from training.durable import fsync_path
from training.residual_commit import commitment_layout

if TYPE_CHECKING:
    from gonka_node.aggregator.rounds import RoundEngine


class OpeningDesk:
    """The engine's intake of openings; `lock` orders a store against the close's read of the openings
    (an opening is stored before its deadline, or the close sees the deadline passed, never both)."""

    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine
        self.layout = commitment_layout(engine.ctx.spec, engine.ctx.codec)
        self.lock = threading.Lock()
        self._in_flight: set[bytes] = set()

    def challenge(self, sub: SubmissionRow) -> Challenge | None:
        """The stored submission's challenge (None: not challenged)."""
        row = self.engine.store.get_round(sub.epoch, sub.round)
        if row is None:
            return None
        return challenge_of(self.engine.ctx, self.layout, row, sub, self.engine.aggregation.opening_timeout_s)

    async def open(self, header: pb.OpeningHeader, chunks: AsyncIterator[bytes], guard: StreamGuard) -> OpeningRow:
        """Check, stream and store one opening; raises Rejected (nothing stored)."""
        record = _record(header)
        chosen = await self._challenged(record, header.signature)
        self._in_flight.add(record.host)
        try:
            part = await receive_payload(
                chunks, declared_length=record.body_length, declared_sha256=record.body_sha256,
                max_chunk_bytes=self.engine.settings.max_chunk_bytes, incoming=self.engine.store.incoming, guard=guard,
            )
            guard.disarm()
            try:
                await asyncio.to_thread(fsync_path, part)
                return self._store(record, header.signature, chosen, part)
            finally:
                part.unlink(missing_ok=True)
        finally:
            self._in_flight.discard(record.host)

    async def _challenged(self, record: OpeningRecord, signature: bytes) -> Challenge:
        """Every check before the body's first byte; the host's challenge."""
        e = self.engine
        if record.chain_id != e.ctx.chain_id or record.registry != e.ctx.registry:
            raise Rejected(Reason.WRONG_CHAIN,
                           f"this aggregator serves chain {e.ctx.chain_id}, registry 0x{e.ctx.registry.hex()}")
        try:
            member = await e.chain.member(e.ctx.epoch, record.host)
        except Exception as exc:  # the chain is unreachable: the host may retry, nothing was judged
            raise Rejected(Reason.UNAVAILABLE, f"cannot read the chain: {exc}") from exc
        if member is None:
            raise Rejected(Reason.UNKNOWN_HOST,
                           f"host {to_checksum_address(record.host)} is not signed in to epoch {e.ctx.epoch}")
        if not record.verify(signature, member.node_key):
            raise Rejected(Reason.BAD_SIGNATURE, "signature does not verify under the node key registered on chain")
        # e_{r−1}'s root may be the zero residual's, a hash over the whole model: never on the event loop,
        # and before the checks below, so that nothing awaits between them and the caller's `_in_flight`
        want = await asyncio.to_thread(previous_root, e.store, self.layout, record.epoch, record.round, record.host)
        sub, chosen = self._challenge_of(record)
        if e.clock() > chosen.deadline_ms:
            raise Rejected(Reason.LATE, f"the opening of round {record.epoch}/{record.round} was due by "
                                        f"{clock_text(chosen.deadline_ms)}")
        self._check_roots(record, sub, want)
        limit = max_body_bytes(self.layout, chosen.chunks)
        if record.body_length > limit:
            raise Rejected(Reason.OVERSIZE, f"declared body of {record.body_length} bytes; an opening of "
                                            f"{len(chosen.chunks)} chunks takes at most {limit}")
        return chosen

    def _challenge_of(self, record: OpeningRecord) -> tuple[SubmissionRow, Challenge]:
        e, where = self.engine, f"round {record.epoch}/{record.round}"
        sub = e.store.submission(record.epoch, record.round, record.host) if record.epoch == e.ctx.epoch else None
        chosen = self.challenge(sub) if sub is not None else None
        if sub is None or chosen is None:
            raise Rejected(Reason.NOT_CHALLENGED, f"the host's submission of {where} is not challenged "
                                                  "(GetSubmission says CHALLENGED when it is)")
        if e.store.opening(record.epoch, record.round, record.host) is not None:
            raise Rejected(Reason.NOT_CHALLENGED, f"the host's opening of {where} is already stored")
        if record.host in self._in_flight:  # most likely a stream broken on the host's side that this server
            # has not yet seen end (idle or keepalive timeout): retryable, so the host's retry is not lost
            raise Rejected(Reason.UNAVAILABLE, f"an opening of {where} from this host is still streaming; "
                                               f"retry once it ends (at most {self.engine.stream_limits.idle_s:g} s "
                                               "idle)")
        return sub, chosen

    def _check_roots(self, record: OpeningRecord, sub: SubmissionRow, want: bytes) -> None:
        if record.residual_root != sub.residual_root:
            raise Rejected(Reason.ROOT_MISMATCH, f"residual_root {record.residual_root.hex()} is not the "
                                                 f"{sub.residual_root.hex()} signed with this round's payload")
        if record.previous_root != want:
            raise Rejected(Reason.ROOT_MISMATCH, f"previous_root {record.previous_root.hex()} is not {want.hex()}, "
                                                 "the root signed with the host's last earlier payload of the epoch "
                                                 "(or the zero residual's before its first)")

    def _store(self, record: OpeningRecord, signature: bytes, chosen: Challenge, part: Path) -> OpeningRow:
        e = self.engine
        row = OpeningRow(
            epoch=record.epoch, round=record.round, host=record.host, previous_root=record.previous_root,
            residual_root=record.residual_root, body_sha256=record.body_sha256, body_length=record.body_length,
            timestamp_ms=record.timestamp_ms, signature=signature, received_ms=0,
            path=str(e.store.opening_path(record.epoch, record.round, record.host)),
        )
        with self.lock:  # the deadline and the store, as one step against the close's read
            now = e.clock()
            if now > chosen.deadline_ms:
                raise Rejected(Reason.LATE, f"the opening was due by {clock_text(chosen.deadline_ms)}; "
                                            "it finished streaming after")
            stored = dataclasses.replace(row, received_ms=now)
            e.store.add_opening(stored, part)
        return stored


def _record(header: pb.OpeningHeader) -> OpeningRecord:
    try:
        return record_of(header)
    except EnvelopeError as exc:
        raise Rejected(Reason.MALFORMED, f"opening header: {exc}") from exc

