"""gRPC servicers: translate protobuf ↔ the round engine, and nothing else.

A refused submission ends with an error status (code per reason, below), a message a person can act
on, and two trailing metadata entries: `gonka-reason` (the RejectReason name, machine-readable) and
`gonka-receipt-bin` (the aggregator's signed Receipt saying "rejected, reason N").
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gonka_node.aggregator.challenges import challenges_round
from gonka_node.aggregator.checkpoint_service import (
    CheckpointsService,
    checkpoint_stream,
    file_meta,
    stream_file,
)
from gonka_node.aggregator.engine_types import SignedReceipt
from gonka_node.aggregator.ingest import StreamGuard
from gonka_node.aggregator.reasons import Reason, Rejected
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.shard_close import served_proof
from gonka_node.aggregator.shard_net import NetExchange
from gonka_node.aggregator.shard_service import ShardService
from gonka_node.aggregator.store import CHECKED, DECIDED, FAILED, PENDING, STEPPED, RoundRow
from gonka_node.core.config import RoundSettings
from gonka_node.core.envelope import EnvelopeError, Submission
from gonka_node.core.storage import ObjectMissing, StoreError
from gonka_node.core.tls import TlsIdentity, server_credentials
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc
from proto.gonka.v1 import checkpoints_pb2 as cpb
from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc
from proto.gonka.v1 import common_pb2 as common
from proto.gonka.v1 import shard_pb2_grpc as spb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", pb.SubmitRequest, pb.OpeningRequest)  # a client stream: a header, then chunks
PAYLOAD_CHUNKS = "payload chunks may follow the header"
MESSAGE_LIMIT = 4 << 20  # chunks are <= 1 MiB; larger messages die in the transport, before our code

STATUS: dict[Reason, grpc.StatusCode] = {
    Reason.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.WRONG_CHAIN: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.BAD_SIGNATURE: grpc.StatusCode.UNAUTHENTICATED,
    Reason.UNKNOWN_HOST: grpc.StatusCode.PERMISSION_DENIED,
    Reason.WRONG_ROUND: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STALE_BASE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.LATE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Reason.OVERSIZE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.TRUNCATED: grpc.StatusCode.DATA_LOSS,
    Reason.DIGEST_MISMATCH: grpc.StatusCode.DATA_LOSS,
    Reason.WRONG_CODEC: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.UNDECODABLE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.WRONG_SHAPE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NON_FINITE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NORM_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.COPY: grpc.StatusCode.ALREADY_EXISTS,
    Reason.CLOCK_SKEW: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Reason.STREAM_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.OBJECT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.NOT_CHALLENGED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.ROOT_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
}
CHECK_STATES = {PENDING: pb.SubmissionStatus.PENDING, CHECKED: pb.SubmissionStatus.CHECKED,
                FAILED: pb.SubmissionStatus.FAILED}
STORE_READ = 8 << 20  # bytes of a stored payload read per range request (then cut into chunks)


def receipt_pb(r: SignedReceipt, message: str = "") -> pb.Receipt:
    b = r.body
    return pb.Receipt(
        accepted=b.accepted,
        reason=cast(common.RejectReason, b.reason),  # a RejectReason number (the stubs want the enum type)
        message=message,
        chain_id=b.chain_id,
        registry=b.registry,
        epoch=b.epoch,
        round=b.round,
        host=b.host,
        payload_sha256=b.payload_sha256,
        payload_length=b.payload_length,
        received_unix_ms=b.received_ms,
        aggregator_key=r.aggregator_key,
        signature=r.signature,
    )


def submission_from_pb(h: pb.SubmitHeader) -> Submission:
    try:
        return Submission(
            chain_id=h.chain_id,
            registry=h.registry,
            epoch=h.epoch,
            round=h.round,
            host=h.host,
            base_checkpoint_sha256=h.base_checkpoint_sha256,
            codec=h.codec,
            payload_sha256=h.payload_sha256,
            payload_length=h.payload_length,
            tokens_trained=h.tokens_trained,
            timestamp_ms=h.timestamp_unix_ms,
            residual_root=h.residual_root,  # any 32 bytes: what it commits to is checked when opened
        )
    except EnvelopeError as exc:
        raise Rejected(Reason.MALFORMED, f"header: {exc}") from exc


async def _header_first(
    request_iterator: AsyncIterator[M], guard: StreamGuard, header: str
) -> tuple[M, AsyncIterator[M]]:
    """A client stream's first message, which must be its header (`header` names it in the refusal),
    and the rest; the guard is touched once the first message came (an upload's and an opening's)."""
    requests = aiter(request_iterator)
    first = await anext(requests, None)
    guard.touch()
    if first is None or first.WhichOneof("part") != "header":
        raise Rejected(Reason.MALFORMED, f"the stream must start with {header}")
    return first, requests


async def _chunks(stream: AsyncIterator[M], after: str) -> AsyncIterator[bytes]:
    """The body chunks that follow a stream's header (`after`: what the refusal says follows what)."""
    async for msg in stream:
        if msg.WhichOneof("part") != "chunk":
            raise Rejected(Reason.MALFORMED, f"only {after}")
        yield msg.chunk


async def _store_read(read: Callable[[], T], what: str) -> T:
    """A store call off the event loop; a missing object or a failing store as the refusal it is."""
    try:
        return await asyncio.to_thread(read)
    except ObjectMissing:
        raise Rejected(Reason.OBJECT_MISMATCH, f"no object {what}: PUT the payload to the upload slot's URL first"
                       ) from None
    except StoreError as exc:  # the host may retry; nothing was judged
        raise Rejected(Reason.UNAVAILABLE, f"cannot read the object store: {exc}") from None


class AggregatorService(pb_grpc.AggregatorServicer):
    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine

    async def GetOpenRound(
        self, request: pb.GetOpenRoundRequest, context: grpc.aio.ServicerContext
    ) -> pb.RoundInfo:
        e, r = self.engine, self.engine.current
        if r is None or e.closing:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no round is open in epoch {e.ctx.epoch}")
        assert r is not None
        s = e.settings
        return pb.RoundInfo(
            chain_id=e.ctx.chain_id,
            registry=e.ctx.registry,
            epoch=r.epoch,
            round=r.round,
            base_checkpoint_sha256=r.base_sha256,
            deadline_unix_ms=r.deadline_ms,
            codec=e.ctx.codec_name,
            limits=pb.Limits(
                max_payload_bytes=s.max_payload_bytes,
                max_chunk_bytes=s.max_chunk_bytes,
                max_update_norm=s.max_update_norm,
                max_clock_skew_ms=int(s.max_clock_skew_s * 1000),
            ),
            aggregator_key=e.aggregator_key,
            submissions=len(e.store.submitted_hosts(r.epoch, r.round)),
            expected_hosts=len(await e.chain.hosts(r.epoch)),
            direct_upload=e.publisher is not None and e.publisher.direct_upload,
        )

    async def Submit(
        self, request_iterator: AsyncIterator[pb.SubmitRequest], context: grpc.aio.ServicerContext
    ) -> pb.Receipt:
        sub: Submission | None = None
        # Armed from the first byte: a connection that never sends its header is dropped too.
        guard = self.engine.stream_guard(f"stream from {context.peer()}").arm()
        try:
            first, requests = await _header_first(request_iterator, guard, "a SubmitHeader")
            sub = submission_from_pb(first.header)
            guard.what = f"upload of 0x{sub.host.hex()}"
            receipt = await self.engine.submit(sub, first.header.signature, self._payload(sub, requests), guard)
            self.engine.metrics.submission("accepted", sub.payload_length)
            return receipt_pb(receipt)
        except asyncio.CancelledError as exc:
            refusal = guard.refused(exc)
            if refusal is None:  # the host went away mid-stream: its partial file is already gone
                log.warning(
                    "submission from %s cancelled mid-stream (connection lost); nothing stored",
                    f"0x{sub.host.hex()}" if sub else "?",
                )
                raise
            await self._refuse(sub, refusal, context)
        except Rejected as exc:
            await self._refuse(sub, exc, context)
        finally:
            guard.disarm()
        raise AssertionError("unreachable")

    async def _payload(self, sub: Submission, requests: AsyncIterator[pb.SubmitRequest]) -> AsyncIterator[bytes]:
        """The payload's bytes: the chunks that follow the header, or the store object `stored` names."""
        first = await anext(requests, None)
        if first is None:
            return
        if first.WhichOneof("part") != "stored":
            if first.WhichOneof("part") != "chunk":
                raise Rejected(Reason.MALFORMED, f"only {PAYLOAD_CHUNKS}")
            yield first.chunk
            async for chunk in _chunks(requests, PAYLOAD_CHUNKS):
                yield chunk
            return
        async for chunk in self._stored(sub, first.stored.key):
            yield chunk
        if await anext(requests, None) is not None:
            raise Rejected(Reason.MALFORMED, "nothing may follow a stored payload")

    async def _stored(self, sub: Submission, key: str) -> AsyncIterator[bytes]:
        """A payload the host PUT into the store, read back in chunks for the same ingest as a stream
        (its length and sha256 are checked there against the signed header, as for streamed bytes)."""
        publisher = self.engine.publisher
        if publisher is None or not publisher.direct_upload:
            raise Rejected(Reason.MALFORMED, "this aggregator takes payloads in chunks (RoundInfo.direct_upload is off)")
        expected = publisher.upload_key(sub.epoch, sub.round, sub.host)
        if key != expected:
            raise Rejected(Reason.MALFORMED, f"the stored payload's key must be {expected!r}, got {key[:100]!r}")
        objects = publisher.objects
        size = await _store_read(lambda: objects.size(key), key)
        if size != sub.payload_length:
            raise Rejected(Reason.OBJECT_MISMATCH,
                           f"the object {key} is {size} bytes; the signed header says {sub.payload_length}")
        step = self.engine.settings.max_chunk_bytes
        per_read = step * max(1, STORE_READ // step)
        for start in range(0, size, per_read):
            block = await _store_read(functools.partial(objects.get_range, key, start, per_read), key)
            for offset in range(0, len(block), step):
                yield block[offset : offset + step]

    async def GetUploadSlot(self, request: pb.SubmitHeader, context: grpc.aio.ServicerContext) -> pb.UploadSlot:
        publisher, sub = self.engine.publisher, None
        if publisher is None or not publisher.direct_upload:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this aggregator takes payloads in Submit's chunks (RoundInfo.direct_upload is off)")
        assert publisher is not None
        try:
            sub = submission_from_pb(request)
            await self.engine.authenticate(sub, request.signature)  # every check Submit makes before bytes
            slot = await _store_read(
                lambda: publisher.upload_slot(sub.epoch, sub.round, sub.host, self.engine.clock()), "an upload URL")
        except Rejected as exc:
            await self._refuse(sub, exc, context)
            raise AssertionError("unreachable: abort raises") from exc
        return pb.UploadSlot(url=slot.url, key=slot.key, expires_unix_ms=slot.expires_ms)

    async def _refuse(self, sub: Submission | None, exc: Rejected, context: grpc.aio.ServicerContext) -> None:
        log.info("rejected %s: %s", f"0x{sub.host.hex()}" if sub else "?", exc)
        self.engine.metrics.submission(exc.reason.name)
        signed = self.engine.receipt(sub, accepted=False, reason=exc.reason.value)
        trailing = (
            ("gonka-reason", exc.reason.name),
            ("gonka-receipt-bin", receipt_pb(signed, exc.message).SerializeToString()),
        )
        await context.abort(STATUS[exc.reason], exc.message, trailing_metadata=trailing)

    async def GetSubmission(
        self, request: pb.SubmissionRef, context: grpc.aio.ServicerContext
    ) -> pb.SubmissionStatus:
        row = self.engine.store.submission(request.epoch, request.round, bytes(request.host))
        if row is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no payload of 0x{bytes(request.host).hex()} is "
                                f"stored in round {request.epoch}/{request.round}")
            raise AssertionError("unreachable: abort raises")
        status = pb.SubmissionStatus(
            state=CHECK_STATES[row.check_state],
            reason=cast(common.RejectReason, row.check_reason),
            message=row.check_message,
            payload_sha256=row.payload_sha256,
            received_unix_ms=row.received_ms,
        )
        if not challenges_round(self.engine.ctx):
            return status
        chosen = await asyncio.to_thread(self.engine.openings.challenge, row)  # a sample hashes every chunk index
        if chosen is not None:
            opened = self.engine.store.opening(row.epoch, row.round, row.host) is not None
            status.state = pb.SubmissionStatus.OPENED if opened else pb.SubmissionStatus.CHALLENGED
            status.round_seed = chosen.round_seed
            status.challenged_chunks.extend(chosen.chunks)
            status.opening_deadline_unix_ms = chosen.deadline_ms
        return status

    async def OpenResidual(
        self, request_iterator: AsyncIterator[pb.OpeningRequest], context: grpc.aio.ServicerContext
    ) -> pb.OpeningReceipt:
        """A challenged host's opening (aggregator/openings.py); a refusal: status, reason, nothing stored."""
        guard = StreamGuard(self.engine.stream_limits, asyncio.Event(), f"opening from {context.peer()}").arm()
        try:
            first, requests = await _header_first(request_iterator, guard, "an OpeningHeader")
            body = _chunks(requests, "body chunks may follow the opening header")
            row = await self.engine.openings.open(first.header, body, guard)
            log.info("opening of 0x%s in round %d/%d stored (%d bytes)", row.host.hex(), row.epoch, row.round,
                     row.body_length)
            return pb.OpeningReceipt(accepted=True, body_sha256=row.body_sha256, received_unix_ms=row.received_ms)
        except asyncio.CancelledError as exc:
            refusal = guard.refused(exc)
            if refusal is None:
                log.warning("an opening was cancelled mid-stream (connection lost); nothing stored")
                raise
            await self._refuse_opening(refusal, context)
        except Rejected as exc:
            await self._refuse_opening(exc, context)
        finally:
            guard.disarm()
        raise AssertionError("unreachable")

    async def _refuse_opening(self, exc: Rejected, context: grpc.aio.ServicerContext) -> None:
        log.info("opening refused: %s", exc)
        await context.abort(STATUS[exc.reason], exc.message, trailing_metadata=(("gonka-reason", exc.reason.name),))

    async def GetRoundResult(self, request: pb.RoundRef, context: grpc.aio.ServicerContext) -> pb.RoundResult:
        row = await self._done_round(request.epoch, request.round, context)
        contributions = self.engine.store.contributions(row.epoch, row.round)
        sizes = {s.host: s.payload_length for s in self.engine.store.submissions(row.epoch, row.round)}
        return pb.RoundResult(
            epoch=row.epoch,
            round=row.round,
            state=row.state,
            base_checkpoint_sha256=row.base_sha256,
            checkpoint_sha256=row.checkpoint_sha256 or b"",
            rewards_root=row.rewards_root or b"",
            total_reward=row.total_reward or 0,
            aggregation=row.aggregation or "",
            contributions=[
                pb.Contribution(
                    host=c.host, score=c.score, reward=c.reward, aggregated=c.aggregated, reasons=c.reasons,
                    payload_length=sizes.get(c.host, 0),
                )
                for c in contributions
            ],
            finalize_tx=row.finalize_tx or b"",
            heldout_loss_base=row.heldout_loss_base,
            heldout_loss=row.heldout_loss,
        )

    async def GetRoundUpdate(
        self, request: pb.RoundRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common.FileChunk]:
        row = await self._done_round(request.epoch, request.round, context)
        path = self.engine.store.update_path(row.epoch, row.round)
        if row.state not in STEPPED or not path.exists():
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"round {row.epoch}/{row.round} was skipped: no update"
            )
        async for chunk in stream_file(path, await file_meta(path, row.epoch, row.round, b"")):
            yield chunk
        self.engine.metrics.update_served(path.stat().st_size)

    async def GetRewardProof(
        self, request: pb.GetRewardProofRequest, context: grpc.aio.ServicerContext
    ) -> pb.RewardProof:
        row = await self._done_round(request.epoch, request.round, context)
        tree = self.engine.reward_tree(row.round)
        host = "0x" + bytes(request.host).hex()
        if tree is None or len(request.host) != 20 or host.lower() not in {h.lower() for h in tree.hosts}:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"{host} has no reward in round {row.epoch}/{row.round}"
            )
        assert tree is not None
        return pb.RewardProof(
            epoch=row.epoch,
            round=row.round,
            host=request.host,
            amount=tree.amount(host),
            proof=tree.proof(host),
            rewards_root=tree.root,
        )

    async def GetCheckpoint(
        self, request: pb.RoundRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common.FileChunk]:
        async for chunk in checkpoint_stream(self.engine, request.epoch, request.round, context):
            yield chunk

    async def LocateRound(self, request: pb.RoundRef, context: grpc.aio.ServicerContext) -> pb.RoundLocation:
        row = await self._done_round(request.epoch, request.round, context)
        out = pb.RoundLocation(epoch=row.epoch, round=row.round)
        proof = await self._fragment_proof(row)
        if proof is not None:
            out.fragment.CopyFrom(proof)
        publisher = self.engine.publisher
        if publisher is None or row.state != "finalized":
            return out
        try:
            found = await asyncio.to_thread(publisher.locate, row.epoch, row.round, self.engine.clock())
        except StoreError as exc:  # cannot sign URLs (no credentials): clients stream over gRPC instead
            log.warning("round %d/%d: no download URLs handed out: %s", row.epoch, row.round, exc)
            return out
        for kind, where in found.items():
            getattr(out, kind).CopyFrom(pb.StoredObject(
                url=where.url, key=where.key, length=where.length, file_sha256=where.file_sha256,
                expires_unix_ms=where.expires_ms,
            ))
        return out

    async def _fragment_proof(self, row: RoundRow) -> pb.FragmentProof | None:
        """A shard's proof of its fragment of a finalized round (None: unsharded, or nothing stepped)."""
        shard = self.engine.ctx.shard
        if shard is None or row.state not in STEPPED:
            return None
        path = self.engine.store.checkpoint_path(row.epoch, row.round)
        proof = await asyncio.to_thread(served_proof, path, shard)
        if proof is None:
            return None
        return pb.FragmentProof(index=proof.index, count=proof.count, fragment_sha256=proof.fragment_sha256,
                                siblings=proof.siblings)

    async def _done_round(self, epoch: int, round_: int, context: grpc.aio.ServicerContext) -> RoundRow:
        row = self.engine.store.get_round(epoch, round_)
        if row is None or row.state not in DECIDED:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"round {epoch}/{round_} is not finalized")
            raise AssertionError("unreachable: abort raises")
        return row


def server_options(settings: RoundSettings) -> list[tuple[str, int]]:
    """Transport limits: no connection is kept beyond what the longest legitimate upload needs.

    Keepalive pings find dead peers (a host whose link dropped without a FIN) within about three
    minutes; the ack may take up to a minute, since it queues behind a saturated home uplink's data (a
    shorter timeout cut honest slow uploads in the throttled-link fault test); idle connections are
    closed; a connection's age is capped at the longest allowed upload, after which the client reconnects
    (open calls get the same time again to finish). Per-stream idle and total deadlines, and one upload
    per host at a time, are enforced by the round engine; volume (many connections) is out of scope."""
    upload_ms = int(settings.longest_upload_s() * 1000)
    return [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
        ("grpc.keepalive_time_ms", 120_000),
        ("grpc.keepalive_timeout_ms", 60_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.max_connection_idle_ms", 300_000),
        ("grpc.max_connection_age_ms", upload_ms),
        ("grpc.max_connection_age_grace_ms", upload_ms),
    ]


class AggregatorServer:
    """The asyncio gRPC server around one RoundEngine: bind (TLS only), serve, tick rounds, stop."""

    def __init__(
        self, engine: RoundEngine, identity: TlsIdentity, listen: str = "127.0.0.1:0", model_name: str = ""
    ) -> None:
        self.engine = engine
        self.identity = identity
        self.listen = listen
        self.model_name = model_name
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.engine.start()
        server = grpc.aio.server(options=server_options(self.engine.settings))
        pb_grpc.add_AggregatorServicer_to_server(AggregatorService(self.engine), server)
        cpb_grpc.add_CheckpointsServicer_to_server(CheckpointsService(self.engine, self.model_name), server)
        if isinstance(self.engine.exchange, NetExchange):  # a shard meeting the others over the network
            spb_grpc.add_ShardServicer_to_server(ShardService(self.engine.exchange), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = (
            pb.DESCRIPTOR.services_by_name["Aggregator"].full_name,
            cpb.DESCRIPTOR.services_by_name["Checkpoints"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        self.port = server.add_secure_port(self.listen, server_credentials(self.identity))
        if self.port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await server.start()
        for name in ("", *names[:2]):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._ticker = asyncio.create_task(self.engine.run(self._stop))
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        if self._ticker is not None:
            await self._ticker
        if self._server is not None:
            await self._server.stop(grace_s)
        if isinstance(self.engine.exchange, NetExchange):
            self.engine.exchange.close()
        await asyncio.to_thread(self.engine.checks.close)  # pending rows stay so: a restart checks them

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()
