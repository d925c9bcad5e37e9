"""How the round engine takes a submission (`RoundEngine`'s acceptance half, a mixin over its state):
authenticate the signed header before any payload byte, stream and store the payload durably, sign
the receipt, then drain the decode-time checks (aggregator/deferred.py) into a verdict per stored row.
docs/PROTOCOL.md "Receipt" and "Rejections"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from eth_utils import to_checksum_address
from nacl.signing import SigningKey

from gonka_node.aggregator.chain_view import ChainView, Member
from gonka_node.aggregator.deferred import CheckPool
from gonka_node.aggregator.engine_types import EpochContext, EvidenceSink, InFlight, SignedReceipt, clock_text
from gonka_node.aggregator.ingest import StreamGuard, StreamLimits, receive_payload
from gonka_node.aggregator.metrics import RoundMetrics
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.store import PENDING, RoundRow, Store, SubmissionRow
from gonka_node.aggregator.validate import mapped, scan_update
from gonka_node.core.config import RoundSettings
from gonka_node.core.envelope import ReceiptBody, Submission
from training.durable import fsync_path

log = logging.getLogger("gonka_node.aggregator.rounds")  # one logger for the engine, as before the split
ZERO32 = bytes(32)
CHECK_TRIES = 3  # a payload whose checks fail this often for a reason of ours is dropped (never slashed)
MAX_TOKENS = 2**63 - 1  # the largest tokens_trained the store (SQLite INTEGER) can keep


class Acceptance:
    """The acceptance half of `RoundEngine`; the attributes below are the engine's (set in its __init__)."""

    ctx: EpochContext
    settings: RoundSettings
    store: Store
    chain: ChainView
    signer: SigningKey
    clock: Callable[[], int]
    evidence: EvidenceSink | None
    metrics: RoundMetrics
    checks: CheckPool
    current: RoundRow | None
    closing: bool
    closed_for_submissions: asyncio.Event
    stream_limits: StreamLimits
    _in_flight: dict[bytes, InFlight]
    _check_errors: dict[tuple[int, int, bytes], int]

    @property
    def aggregator_key(self) -> bytes:
        return bytes(self.signer.verify_key)

    async def authenticate(self, sub: Submission, signature: bytes) -> Member:
        """Every check that needs no payload byte; raises Rejected. Cheap checks first."""
        ctx, r = self.ctx, self.current
        if sub.chain_id != ctx.chain_id or sub.registry != ctx.registry:
            raise Rejected(
                Reason.WRONG_CHAIN,
                f"this aggregator serves chain {ctx.chain_id}, registry 0x{ctx.registry.hex()}",
            )
        if r is None:
            raise Rejected(Reason.WRONG_ROUND, f"no round is open in epoch {ctx.epoch}")
        if (sub.epoch, sub.round) != (r.epoch, r.round):
            if sub.epoch == r.epoch and sub.round < r.round:
                raise Rejected(
                    Reason.LATE,
                    f"round {sub.epoch}/{sub.round} is closed; the open round is {r.epoch}/{r.round}",
                )
            raise Rejected(
                Reason.WRONG_ROUND, f"the open round is {r.epoch}/{r.round}, not {sub.epoch}/{sub.round}"
            )
        if self.closing or self.clock() > r.deadline_ms:
            raise Rejected(
                Reason.LATE, f"round {r.epoch}/{r.round} closed for submissions at {clock_text(r.deadline_ms)}"
            )
        if sub.base_checkpoint_sha256 != r.base_sha256:
            raise Rejected(
                Reason.STALE_BASE,
                f"base checkpoint must be {r.base_sha256.hex()}, got {sub.base_checkpoint_sha256.hex()}",
            )
        if sub.tokens_trained > MAX_TOKENS:  # signed as uint64; the store keeps signed 64-bit integers
            raise Rejected(Reason.MALFORMED, f"tokens_trained {sub.tokens_trained} is above {MAX_TOKENS}")
        if sub.codec != ctx.codec_name:
            raise Rejected(
                Reason.WRONG_CODEC, f"epoch {ctx.epoch} uses codec {ctx.codec_name!r}, not {sub.codec!r}"
            )
        if sub.payload_length > self.settings.max_payload_bytes:
            raise Rejected(
                Reason.OVERSIZE,
                f"declared {sub.payload_length} bytes, limit {self.settings.max_payload_bytes}",
            )
        if abs(sub.timestamp_ms - self.clock()) > self.settings.max_clock_skew_s * 1000:
            raise Rejected(
                Reason.CLOCK_SKEW, f"timestamp {sub.timestamp_ms} ms is too far from the aggregator's clock"
            )
        try:
            member = await self.chain.member(ctx.epoch, sub.host)
        except Exception as exc:  # the chain is unreachable: the host may retry, nothing was judged
            raise Rejected(Reason.UNAVAILABLE, f"cannot read the chain: {exc}") from exc
        if member is None:
            raise Rejected(
                Reason.UNKNOWN_HOST,
                f"host {to_checksum_address(sub.host)} is not signed in to epoch {ctx.epoch}",
            )
        if not sub.verify(signature, member.node_key):
            raise Rejected(
                Reason.BAD_SIGNATURE, "signature does not verify under the node key registered on chain"
            )
        if sub.host in self._in_flight:
            raise Rejected(Reason.DUPLICATE, f"host already has an upload streaming in round {r.epoch}/{r.round}")
        if self.store.has_submission(r.epoch, r.round, sub.host):
            raise Rejected(Reason.DUPLICATE, f"host already submitted in round {r.epoch}/{r.round}")
        owner = self._digest_owner(r, sub.payload_sha256)
        if owner is not None:
            why = f"payload identical to the submission of {to_checksum_address(owner)}, whose header came first"
            if self.evidence is not None:  # signature verified above: the host signed a copy
                self.evidence.signed_rejection(sub, signature, Reason.COPY, f"0x{owner.hex()}", None)
            raise Rejected(Reason.COPY, why)
        return member

    def _digest_owner(self, r: RoundRow, payload_sha256: bytes) -> bytes | None:
        """The host whose signed header named this digest first in the round: stored, or still streaming."""
        stored = self.store.digest_owner(r.epoch, r.round, payload_sha256)
        if stored is not None:
            return stored
        return next((h for h, f in self._in_flight.items() if f.payload_sha256 == payload_sha256), None)

    def stream_guard(self, what: str) -> StreamGuard:
        """Time limits for one Submit stream, ended early by the open round's close."""
        return StreamGuard(self.stream_limits, self.closed_for_submissions, what)

    async def submit(
        self, sub: Submission, signature: bytes, chunks: AsyncIterator[bytes], guard: StreamGuard
    ) -> SignedReceipt:
        """Authenticate, stream, persist; returns the signed receipt ("received and stored durably; checks
        pending") or raises Rejected. The decode-time checks are queued (`checks`) after the store.
        `guard` (armed by the caller) times the stream until its payload is in; it is disarmed then."""
        await self.authenticate(sub, signature)
        started = self.clock()
        self._in_flight[sub.host] = InFlight(sub.payload_sha256, started, signature)
        try:
            part = await receive_payload(
                chunks,
                declared_length=sub.payload_length,
                declared_sha256=sub.payload_sha256,
                max_chunk_bytes=self.settings.max_chunk_bytes,
                incoming=self.store.incoming,
                guard=guard,
            )
            guard.disarm()  # received: storing is not interrupted (LATE is checked below)
            try:
                # Off the event loop: the store's own fsync at `add_submission` then finds nothing to flush.
                await asyncio.to_thread(fsync_path, part)
                # The round may have closed while we streamed: its aggregate no longer takes updates.
                r = self.current
                if self.closing or r is None or (r.epoch, r.round) != (sub.epoch, sub.round):
                    raise Rejected(
                        Reason.LATE, f"round {sub.epoch}/{sub.round} closed while the payload streamed"
                    )
                row = self._pending_row(sub, signature, started)
                self.store.add_submission(row, part)
            finally:
                part.unlink(missing_ok=True)
        finally:
            self._in_flight.pop(sub.host, None)
        self.checks.schedule(row)
        return self.receipt(sub, accepted=True, reason=0, received_ms=row.received_ms)

    def _pending_row(self, sub: Submission, signature: bytes, started: int) -> SubmissionRow:
        """The stored row of a received payload whose checks have not run (no norm, no sketch yet)."""
        return SubmissionRow(
            epoch=sub.epoch,
            round=sub.round,
            host=sub.host,
            payload_sha256=sub.payload_sha256,
            payload_length=sub.payload_length,
            tokens_trained=sub.tokens_trained,
            timestamp_ms=sub.timestamp_ms,
            signature=signature,
            received_ms=self.clock(),
            started_ms=started,
            norm=0.0,
            sketch=b"",
            path=str(self.store.payload_path(sub.epoch, sub.round, sub.host)),
            check_state=PENDING,
            residual_root=sub.residual_root,
        )

    def _check_stored(self, row: SubmissionRow) -> None:
        """A stored payload's decode-time checks and their verdict, recorded (in a check thread). A
        failure is what a refusal at upload was: the signed garbage kept as evidence, the reason
        recorded and counted, and the host's payload no submission (it may send another)."""
        key = (row.epoch, row.round, row.host)
        try:
            norm, sketch = self._check(Path(row.path), row.round)
        except Rejected as exc:  # the bytes hash to the signed digest: provably the host's
            log.info("payload of 0x%s in round %d/%d failed its checks: %s", row.host.hex(), row.epoch, row.round, exc)
            if self.evidence is not None:
                self.evidence.signed_rejection(self._signed(row), row.signature, exc.reason, exc.message, Path(row.path))
            # The file goes before the verdict: the host may upload again (to this path) only once the row
            # is failed, so a new payload is never the one removed here.
            Path(row.path).unlink(missing_ok=True)
            self.store.mark_failed(row.epoch, row.round, row.host, exc.reason.value, exc.message)
            self.metrics.submission(exc.reason.name)
            return
        except Exception as exc:  # ours, not the host's (a file gone after a crash, a disk, a bug)
            self._check_errors[key] = tries = self._check_errors.get(key, 0) + 1
            if tries < CHECK_TRIES and not isinstance(exc, FileNotFoundError):
                raise  # the row stays pending: the close queues it again
            log.error("cannot check the payload of 0x%s in round %d/%d (%r): dropped, the host may send it again",
                      row.host.hex(), row.epoch, row.round, exc)
            Path(row.path).unlink(missing_ok=True)
            self.store.mark_failed(row.epoch, row.round, row.host, Reason.UNAVAILABLE.value,
                                   f"the aggregator could not check this payload ({type(exc).__name__}); send it again")
            self.metrics.submission(Reason.UNAVAILABLE.name)
            return
        self.store.mark_checked(row.epoch, row.round, row.host, norm, sketch)

    def _signed(self, row: SubmissionRow) -> Submission:
        """The header the host signed for a stored row (the fields authenticate() held equal to the round's)."""
        r = self.store.get_round(row.epoch, row.round)
        assert r is not None
        return Submission(
            chain_id=self.ctx.chain_id, registry=self.ctx.registry, epoch=row.epoch, round=row.round,
            host=row.host, base_checkpoint_sha256=r.base_sha256, codec=self.ctx.codec_name,
            payload_sha256=row.payload_sha256, payload_length=row.payload_length,
            tokens_trained=row.tokens_trained, timestamp_ms=row.timestamp_ms, residual_root=row.residual_root,
        )

    def resume_checks(self) -> int:
        """Queue the checks of every stored payload of the epoch still pending (after a restart, or a
        check that failed for a reason of ours); returns how many were queued now."""
        return sum(self.checks.schedule(row) for row in self.store.pending_submissions(self.ctx.epoch))

    def _check(self, part: Path, round_: int) -> tuple[float, bytes]:
        """Decode and check a stored payload, memory-mapped, not copied."""
        with open(part, "rb") as f, mapped(f) as data:
            norm, sketch = scan_update(self.ctx.codec_for(round_), data, self.ctx.spec_for(round_),
                                       self.settings.max_update_norm, self.ctx.offsets_for(round_))
        return norm, sketch.numpy().tobytes()

    def receipt(
        self, sub: Submission | None, accepted: bool, reason: int, received_ms: int | None = None
    ) -> SignedReceipt:
        body = ReceiptBody(
            chain_id=self.ctx.chain_id,
            registry=self.ctx.registry,
            epoch=sub.epoch if sub else 0,
            round=sub.round if sub else 0,
            host=sub.host if sub else bytes(20),
            payload_sha256=sub.payload_sha256 if sub else ZERO32,
            payload_length=sub.payload_length if sub else 0,
            accepted=accepted,
            reason=reason,
            received_ms=self.clock() if received_ms is None else received_ms,
        )
        return SignedReceipt(body, body.sign(self.signer), self.aggregator_key)
