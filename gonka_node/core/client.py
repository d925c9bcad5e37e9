"""A small typed client of the Aggregator service, for hosts, tests and the benchmark.

Submitting: `submit(round_info, payload, ...)` signs the envelope with the node key and streams the
payload in chunks of the round's `max_chunk_bytes`, or, when the round says `direct_upload`, PUTs it to
the presigned URL `GetUploadSlot` hands out and submits the header naming the object. A refusal comes
back as `SubmitRejected` carrying the machine-readable reason, the gRPC status and the aggregator's
signed receipt.

Downloads (`round_update`, `checkpoint`) come from the aggregator's object store when `LocateRound`
names a URL (checked against the announced length and sha256), else from its gRPC stream; the caller
verifies them against the chain (host/follow.py).

The channel is TLS and trusts exactly the pinned certificate (`gonka_node.core.tls`). When a call fails
UNAVAILABLE, the client looks at what the server presents: another certificate raises
`PeerCertificateError`, a server without TLS `PlaintextPeerError` (neither is worth retrying); an
unreachable server leaves the gRPC error as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc
from nacl.signing import SigningKey

from gonka_node.core.link import Link, TokenBucket
from gonka_node.core.storage import StoreError, download_url, upload_url
from gonka_node.core.tls import check_peer, pinned_channel
from gonka_node.core.wire import NO_RESIDUAL, header_for, verify_receipt
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc
from proto.gonka.v1 import common_pb2 as common

log = logging.getLogger(__name__)
MESSAGE_LIMIT = 4 << 20
PEER_CHECK_S = 10.0  # at most this long to look at the certificate a failing server presents
T = TypeVar("T")


class SubmitRejected(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, message: str, receipt: pb.Receipt | None) -> None:
        super().__init__(f"{code.name} {reason}: {message}")
        self.code, self.reason, self.message, self.receipt = code, reason, message, receipt


@dataclass(frozen=True)
class Downloaded:
    meta: common.FileMeta
    data: bytes


def _chunks(data: bytes, chunk: int, up: TokenBucket | None = None) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), chunk):
        part = bytes(view[start : start + chunk])
        if up is not None:  # a shaped uplink: the chunk leaves once the link could have carried it
            up.pace(len(part), first=start == 0)
        yield part


def _requests(
    header: pb.SubmitHeader, payload: bytes, chunk: int, up: TokenBucket | None = None
) -> Iterator[pb.SubmitRequest]:
    yield pb.SubmitRequest(header=header)
    yield from (pb.SubmitRequest(chunk=part) for part in _chunks(payload, chunk, up))


class AggregatorClient:
    """Synchronous client (one TLS channel trusting exactly `tls_cert_pem`, the aggregator's pinned
    certificate). Use as a context manager or call `close()`."""

    def __init__(self, target: str, tls_cert_pem: bytes, timeout_s: float = 120.0, link: Link | None = None) -> None:
        self.target = target
        self.link = link  # payload uploads and file downloads paced like this link (gonka_node/core/link.py)
        self.tls_cert_pem = tls_cert_pem
        self.timeout_s = timeout_s
        self.channel = pinned_channel(
            target,
            tls_cert_pem,
            options=[
                ("grpc.max_receive_message_length", MESSAGE_LIMIT),
                ("grpc.max_send_message_length", MESSAGE_LIMIT),
            ],
        )
        self.stub = pb_grpc.AggregatorStub(self.channel)

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def check_peer(self) -> None:
        """Raise `PeerCertificateError`/`PlaintextPeerError` when the aggregator answers but is not the
        pinned one. An unreachable aggregator passes: a daemon waits for it, the next call says so."""
        with contextlib.suppress(OSError, ValueError):  # unreachable, or a target that is not HOST:PORT
            check_peer(self.target, self.tls_cert_pem, min(self.timeout_s, PEER_CHECK_S))

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except grpc.RpcError as exc:
            self._explain(exc)
            raise

    def _explain(self, exc: grpc.RpcError) -> None:
        # A failed TLS handshake is only ever UNAVAILABLE with a free-text detail: look instead.
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.check_peer()

    def open_round(self) -> pb.RoundInfo:
        return self._call(lambda: self.stub.GetOpenRound(pb.GetOpenRoundRequest(), timeout=self.timeout_s))

    def submit_raw(self, requests: Iterator[pb.SubmitRequest]) -> pb.Receipt:
        """Send a hand-built request stream (tests of malformed streams use this)."""
        try:
            return self.stub.Submit(requests, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._explain(exc)
            raise _rejected(exc) from exc

    def submit(
        self,
        info: pb.RoundInfo,
        host: bytes,
        payload: bytes,
        key: SigningKey,
        tokens_trained: int = 0,
        *,
        residual_root: bytes = NO_RESIDUAL,
    ) -> pb.Receipt:
        """Sign and send `payload`. The host daemon passes its residual's root after the round
        (`WorkerRound.residual_root`); the default, 32 zero bytes, is for tools and tests that send a
        payload without training one (the aggregator takes any 32 bytes until a challenge opens them)."""
        header = header_for(info, host, payload, tokens_trained, key, residual_root)
        if info.direct_upload:
            receipt = self.submit_raw(iter(self.put_payload(header, payload)))
        else:
            up = self.link.up if self.link is not None else None
            receipt = self.submit_raw(_requests(header, payload, info.limits.max_chunk_bytes or (1 << 20), up))
        if not verify_receipt(receipt, info.aggregator_key):
            raise SubmitRejected(
                grpc.StatusCode.UNAUTHENTICATED, "BAD_RECEIPT", "receipt signature does not verify", receipt
            )
        return receipt

    def upload_slot(self, header: pb.SubmitHeader) -> pb.UploadSlot:
        """A presigned PUT for this header's payload (RoundInfo.direct_upload); refusals as Submit's."""
        try:
            return self.stub.GetUploadSlot(header, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._explain(exc)
            raise _rejected(exc) from exc

    def put_payload(self, header: pb.SubmitHeader, payload: bytes) -> list[pb.SubmitRequest]:
        """Upload the payload into the aggregator's store; returns the Submit stream that names it. A
        store that refuses the PUT is `SubmitRejected` UNAVAILABLE (nothing was judged: retry)."""
        slot = self.upload_slot(header)
        if self.link is not None:  # a shaped uplink: the PUT leaves once the link could have carried it
            self.link.up.pace(len(payload), first=True)
        try:
            upload_url(slot.url, payload, self.timeout_s)
        except StoreError as exc:
            raise SubmitRejected(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", f"payload upload: {exc}", None) from exc
        return [pb.SubmitRequest(header=header), pb.SubmitRequest(stored=pb.StoredPayload(key=slot.key))]

    def open_residual(self, header: pb.OpeningHeader, body: bytes, chunk: int) -> pb.OpeningReceipt:
        """Send a challenged submission's opening (`core.opening.signed_opening` and `encode_body`) in
        chunks of `chunk` bytes (the round's `max_chunk_bytes`) over the shaped uplink when there is one.
        A refusal is `SubmitRejected` with the reason (NOT_CHALLENGED, ROOT_MISMATCH, LATE, ...)."""
        up = self.link.up if self.link is not None else None
        parts = (pb.OpeningRequest(chunk=part) for part in _chunks(body, chunk, up))
        try:
            return self.stub.OpenResidual(itertools.chain([pb.OpeningRequest(header=header)], parts),
                                          timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._explain(exc)
            raise _rejected(exc) from exc

    def submission(self, epoch: int, round_: int, host: bytes) -> pb.SubmissionStatus:
        """What became of the host's stored payload in the round (its checks run after the receipt)."""
        ref = pb.SubmissionRef(epoch=epoch, round=round_, host=host)
        return self._call(lambda: self.stub.GetSubmission(ref, timeout=self.timeout_s))

    def checked(self, epoch: int, round_: int, host: bytes, poll_s: float = 0.05) -> pb.SubmissionStatus:
        """`submission` once its checks have run (CHECKED or FAILED), asked every `poll_s` until then (at
        most the client's timeout: TimeoutError)."""
        deadline = time.monotonic() + self.timeout_s
        while (status := self.submission(epoch, round_, host)).state == pb.SubmissionStatus.PENDING:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the checks of round {epoch}/{round_}'s payload are still pending after "
                                   f"{self.timeout_s:g} s")
            time.sleep(poll_s)
        return status

    def round_result(self, epoch: int, round_: int) -> pb.RoundResult:
        ref = pb.RoundRef(epoch=epoch, round=round_)
        return self._call(lambda: self.stub.GetRoundResult(ref, timeout=self.timeout_s))

    def reward_proof(self, epoch: int, round_: int, host: bytes) -> pb.RewardProof:
        request = pb.GetRewardProofRequest(epoch=epoch, round=round_, host=host)
        return self._call(lambda: self.stub.GetRewardProof(request, timeout=self.timeout_s))

    def round_update(self, epoch: int, round_: int) -> Downloaded:
        """The round's broadcast update: from the aggregator's object store when it names a URL for it,
        else (or when that download fails or is not what was announced) streamed from the aggregator."""
        ref = pb.RoundRef(epoch=epoch, round=round_)
        stored = self._from_store(ref, "update")
        if stored is not None:
            return stored
        return self._call(lambda: download(self.stub.GetRoundUpdate(ref, timeout=self.timeout_s), self._down()))

    def checkpoint(self, epoch: int, round_: int) -> Downloaded:
        """The round's checkpoint, from the store first as `round_update`. Not verified here: the caller
        checks it against the chain's hash before using it (host/follow.py)."""
        ref = pb.RoundRef(epoch=epoch, round=round_)
        stored = self._from_store(ref, "checkpoint") if round_ > 0 else None
        if stored is not None:
            return stored
        return self._call(lambda: download(self.stub.GetCheckpoint(ref, timeout=self.timeout_s), self._down()))

    def locate(self, epoch: int, round_: int) -> pb.RoundLocation | None:
        """Where the round's files are published; None from an aggregator that does not say (older
        versions: UNIMPLEMENTED) or for a round it has not finalized."""
        ref = pb.RoundRef(epoch=epoch, round=round_)
        try:
            return self.stub.LocateRound(ref, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                return None
            self._explain(exc)
            raise

    def _from_store(self, ref: pb.RoundRef, kind: str) -> Downloaded | None:
        location = self.locate(ref.epoch, ref.round)
        if location is None or not location.HasField(kind) or not getattr(location, kind).url:
            return None
        obj: pb.StoredObject = getattr(location, kind)
        sink = io.BytesIO()
        try:
            download_url(obj.url, sink, obj.length, obj.file_sha256, self.timeout_s)
        except StoreError as exc:  # expired, unreachable or changed in the store: the aggregator serves it
            log.warning("round %d/%d: %s from the store failed (%s); streaming it from the aggregator",
                        ref.epoch, ref.round, kind, exc)
            return None
        down = self._down()
        if down is not None:  # a shaped downlink: taken once the link could have carried it
            down.pace(obj.length, first=True)
        meta = common.FileMeta(length=obj.length, file_sha256=obj.file_sha256, epoch=ref.epoch, round=ref.round,
                               format="safetensors")
        return Downloaded(meta, sink.getvalue())

    def _down(self) -> TokenBucket | None:
        return self.link.down if self.link is not None else None


def download(stream: Iterator[common.FileChunk], down: TokenBucket | None = None) -> Downloaded:
    """Collect a FileChunk stream; checks the length and the file sha256 announced by its FileMeta.
    `down`: a shaped downlink, each chunk taken once the link could have carried it."""
    it = iter(stream)
    first = next(it)
    if first.WhichOneof("part") != "meta":
        raise ValueError("file stream did not start with FileMeta")
    parts = []
    size = 0
    for msg in it:
        if down is not None:
            down.pace(len(msg.data), first=size == 0)
        size += len(msg.data)
        if size > first.meta.length:
            raise ValueError(f"file stream longer than the announced {first.meta.length} bytes")
        parts.append(msg.data)
    data = b"".join(parts)
    if len(data) != first.meta.length or hashlib.sha256(data).digest() != first.meta.file_sha256:
        raise ValueError("file stream does not match its announced length and sha256")
    return Downloaded(first.meta, data)


def _rejected(exc: grpc.RpcError) -> SubmitRejected:
    trailing = dict(exc.trailing_metadata() or ())
    receipt = None
    if "gonka-receipt-bin" in trailing:
        receipt = pb.Receipt.FromString(trailing["gonka-receipt-bin"])
    return SubmitRejected(exc.code(), str(trailing.get("gonka-reason", "")), exc.details() or "", receipt)
