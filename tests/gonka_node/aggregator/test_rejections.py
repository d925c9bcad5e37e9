"""Every refusal path: the gRPC status, the machine-readable reason, a signed receipt, and no state change."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from agg_harness import Harness, Host, ServerThread
from nacl.signing import SigningKey

from gonka_node.aggregator.reasons import Reason
from gonka_node.core.client import AggregatorClient, SubmitRejected
from gonka_node.core.envelope import Submission
from gonka_node.core.wire import header_pb, receipt_body, verify_receipt
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import common_pb2

RESIDUAL_ROOT = hashlib.sha256(b"a host's residual").digest()  # any 32 bytes: opened in the next slice


def envelope(info: pb.RoundInfo, host: Host, payload: bytes, **overrides: object) -> Submission:
    fields: dict[str, object] = dict(
        chain_id=info.chain_id,
        registry=info.registry,
        epoch=info.epoch,
        round=info.round,
        host=host.address,
        base_checkpoint_sha256=info.base_checkpoint_sha256,
        codec=info.codec,
        payload_sha256=hashlib.sha256(payload).digest(),
        payload_length=len(payload),
        tokens_trained=1000,
        timestamp_ms=time.time_ns() // 1_000_000,
        residual_root=RESIDUAL_ROOT,
    )
    fields.update(overrides)
    return Submission(**fields)  # type: ignore[arg-type]


def stream(sub: Submission, key: SigningKey, body: bytes, chunk: int = 1 << 16) -> Iterator[pb.SubmitRequest]:
    yield pb.SubmitRequest(header=header_pb(sub, sub.sign(key)))
    for i in range(0, len(body), chunk):
        yield pb.SubmitRequest(chunk=body[i : i + chunk])


def state_snapshot(server: ServerThread) -> tuple[object, ...]:
    e = server.engine
    r = e.current
    assert r is not None
    files = sorted(p.name for p in e.store.root.rglob("*") if p.is_file() and p.suffix in (".bin", ".part"))
    return (e.store.get_round(r.epoch, r.round), e.store.submissions(r.epoch, r.round), files)


@pytest.fixture
def running(harness: Harness) -> Iterator[tuple[Harness, ServerThread, AggregatorClient]]:
    harness.schedule(3)
    server = harness.start_server()
    with server.client() as client:
        yield harness, server, client


def good_payload(h: Harness) -> bytes:
    # Any well-formed update passes the submission checks; scoring happens at round close.
    gen = torch.Generator().manual_seed(1)
    return h.payload({n: torch.randn(s, generator=gen) * 1e-3 for n, s in h.spec.items()})


def mutate(h: Harness, fn: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
    gen = torch.Generator().manual_seed(2)
    update = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in h.spec.items()}
    fn(update)
    return h.payload(update)


def expect(
    server: ServerThread,
    client: AggregatorClient,
    requests: Iterator[pb.SubmitRequest],
    code: grpc.StatusCode,
    reason: Reason,
) -> SubmitRejected:
    before = state_snapshot(server)
    with pytest.raises(SubmitRejected) as info:
        client.submit_raw(requests)
    err = info.value
    assert (err.code, err.reason) == (code, reason.name), err
    assert err.message  # a sentence a person can act on
    assert err.receipt is not None and not err.receipt.accepted and err.receipt.reason == reason.value
    assert verify_receipt(err.receipt, server.engine.aggregator_key)
    assert state_snapshot(server) == before  # nothing stored, nothing half-written
    return err


def expect_failed_check(
    server: ServerThread, client: AggregatorClient, requests: Iterator[pb.SubmitRequest], host: bytes, reason: Reason,
) -> pb.SubmissionStatus:
    """A payload the decode-time checks refuse: received (an accepted receipt: stored, checks pending),
    then FAILED with `reason`, and no submission of the round (the round's checked rows unchanged)."""
    e = server.engine
    r = e.current
    assert r is not None
    before = e.store.submissions(r.epoch, r.round)
    receipt = client.submit_raw(requests)
    assert receipt.accepted and verify_receipt(receipt, e.aggregator_key)
    status = client.checked(r.epoch, r.round, host)
    assert (status.state, status.reason) == (pb.SubmissionStatus.FAILED, reason.value), status
    assert status.message and status.payload_sha256 == receipt.payload_sha256  # a sentence a person can act on
    assert e.store.submissions(r.epoch, r.round) == before and host not in e.store.submitted_hosts(r.epoch, r.round)
    return status


def test_reason_enum_matches_the_proto() -> None:
    proto_names = {
        v.name.removeprefix("REJECT_"): v.number
        for v in common_pb2.RejectReason.DESCRIPTOR.values
        if v.number
    }
    assert proto_names == {r.name: r.value for r in Reason}


def test_header_rejections(running: tuple[Harness, ServerThread, AggregatorClient]) -> None:
    h, server, client = running
    info = client.open_round()
    host, payload = h.hosts[0], good_payload(h)
    S = grpc.StatusCode
    other_key = SigningKey(b"\x55" * 32)
    outsider = Host(7, h.world.accounts[7], SigningKey(b"\x77" * 32))
    cases: list[tuple[str, Iterator[pb.SubmitRequest], grpc.StatusCode, Reason]] = [
        (
            "bad signature",
            stream(envelope(info, host, payload), other_key, payload),
            S.UNAUTHENTICATED,
            Reason.BAD_SIGNATURE,
        ),
        (
            "unknown host",
            stream(envelope(info, outsider, payload), outsider.key, payload),
            S.PERMISSION_DENIED,
            Reason.UNKNOWN_HOST,
        ),
        (
            "wrong round",
            stream(envelope(info, host, payload, round=info.round + 1), host.key, payload),
            S.FAILED_PRECONDITION,
            Reason.WRONG_ROUND,
        ),
        (
            "wrong epoch",
            stream(envelope(info, host, payload, epoch=info.epoch + 5), host.key, payload),
            S.FAILED_PRECONDITION,
            Reason.WRONG_ROUND,
        ),
        (
            "stale base",
            stream(envelope(info, host, payload, base_checkpoint_sha256=b"\x01" * 32), host.key, payload),
            S.FAILED_PRECONDITION,
            Reason.STALE_BASE,
        ),
        (
            "other chain",
            stream(envelope(info, host, payload, chain_id=info.chain_id + 1), host.key, payload),
            S.FAILED_PRECONDITION,
            Reason.WRONG_CHAIN,
        ),
        (
            "wrong codec",
            stream(envelope(info, host, payload, codec="bf16"), host.key, payload),
            S.FAILED_PRECONDITION,
            Reason.WRONG_CODEC,
        ),
        (
            "oversize declared",
            stream(
                envelope(info, host, payload, payload_length=h.settings.max_payload_bytes + 1),
                host.key,
                payload,
            ),
            S.RESOURCE_EXHAUSTED,
            Reason.OVERSIZE,
        ),
        (
            "clock skew",
            stream(envelope(info, host, payload, timestamp_ms=1), host.key, payload),
            S.FAILED_PRECONDITION,
            Reason.CLOCK_SKEW,
        ),
        ("no header", iter([pb.SubmitRequest(chunk=b"x")]), S.INVALID_ARGUMENT, Reason.MALFORMED),
    ]
    for name, requests, code, reason in cases:
        err = expect(server, client, requests, code, reason)
        assert err.reason == reason.name, name


def test_stream_rejections(running: tuple[Harness, ServerThread, AggregatorClient]) -> None:
    h, server, client = running
    info = client.open_round()
    host, payload = h.hosts[0], good_payload(h)
    S = grpc.StatusCode
    sub = envelope(info, host, payload)
    # Truncated: the stream ends before the declared length.
    expect(server, client, stream(sub, host.key, payload[:-100]), S.DATA_LOSS, Reason.TRUNCATED)
    # Longer than declared: refused as soon as the excess arrives.
    expect(
        server, client, stream(sub, host.key, payload + b"\x00" * 10), S.RESOURCE_EXHAUSTED, Reason.OVERSIZE
    )
    # Right length, other bytes: the signed digest does not match.
    flipped = bytearray(payload)
    flipped[-1] ^= 0xFF
    expect(server, client, stream(sub, host.key, bytes(flipped)), S.DATA_LOSS, Reason.DIGEST_MISMATCH)
    # A chunk above the round's chunk limit.
    assert len(payload) > h.settings.max_chunk_bytes
    expect(
        server,
        client,
        stream(sub, host.key, payload, chunk=len(payload)),
        S.RESOURCE_EXHAUSTED,
        Reason.OVERSIZE,
    )
    # A second header in place of a chunk.
    bad = iter(
        [
            pb.SubmitRequest(header=header_pb(sub, sub.sign(host.key))),
            pb.SubmitRequest(header=pb.SubmitHeader()),
        ]
    )
    expect(server, client, bad, S.INVALID_ARGUMENT, Reason.MALFORMED)


def test_content_rejections(running: tuple[Harness, ServerThread, AggregatorClient]) -> None:
    h, server, client = running
    info = client.open_round()
    host = h.hosts[0]
    name0 = sorted(h.spec)[0]

    def signed(payload: bytes) -> Iterator[pb.SubmitRequest]:
        return stream(envelope(info, host, payload), host.key, payload)

    # Codecs refuse to encode NaN, so patch one into the bytes: fp32 payload = 32-byte header, then per
    # tensor (sorted names) a u64 element count and the little-endian values.
    nan = bytearray(good_payload(h))
    nan[40:44] = struct.pack("<f", float("nan"))
    nan = bytes(nan)
    # Each fails a check after its receipt; a failed payload is no submission, so the host sends the next.
    expect_failed_check(server, client, signed(nan), host.address, Reason.NON_FINITE)
    huge = mutate(h, lambda u: u[name0].mul_(1e6))
    expect_failed_check(server, client, signed(huge), host.address, Reason.NORM_TOO_LARGE)
    wrong_shape = h.payload(
        {n: torch.zeros(s) if n != name0 else torch.zeros(3, 3) for n, s in h.spec.items()}
    )
    expect_failed_check(server, client, signed(wrong_shape), host.address, Reason.WRONG_SHAPE)
    missing = h.payload({n: torch.zeros(s) for n, s in h.spec.items() if n != name0})
    expect_failed_check(server, client, signed(missing), host.address, Reason.WRONG_SHAPE)
    garbage = hashlib.sha256(b"g").digest() * 1000
    status = expect_failed_check(server, client, signed(garbage), host.address, Reason.UNDECODABLE)
    assert status.message.startswith("payload does not decode")
    # And a good payload after all of them is the host's submission.
    assert client.submit(info, host.address, good_payload(h), host.key).accepted
    assert client.checked(info.epoch, info.round, host.address).state == pb.SubmissionStatus.CHECKED
    assert server.engine.store.submitted_hosts(info.epoch, info.round, checked_only=True) == {host.address}


def test_accept_then_replay_and_copy(running: tuple[Harness, ServerThread, AggregatorClient]) -> None:
    h, server, client = running
    info = client.open_round()
    a, b = h.hosts[0], h.hosts[1]
    payload = good_payload(h)
    sub = envelope(info, a, payload)
    frozen = list(stream(sub, a.key, payload))
    receipt = client.submit_raw(iter(frozen))
    assert receipt.accepted and verify_receipt(receipt, info.aggregator_key)
    assert receipt.payload_sha256 == hashlib.sha256(payload).digest()
    assert client.checked(info.epoch, info.round, a.address).state == pb.SubmissionStatus.CHECKED
    assert len(server.engine.store.submissions(info.epoch, info.round)) == 1
    # The very same signed bytes again: a replay.
    expect(server, client, iter(frozen), grpc.StatusCode.ALREADY_EXISTS, Reason.DUPLICATE)
    # Another host sending the identical payload: a copy.
    expect(
        server,
        client,
        stream(envelope(info, b, payload), b.key, payload),
        grpc.StatusCode.ALREADY_EXISTS,
        Reason.COPY,
    )
    # A receipt is bound to its fields.
    body = dataclasses.replace(receipt_body(receipt), accepted=False)
    assert not body.verify(receipt.signature, info.aggregator_key)


def test_late_submission_is_refused_after_close(
    running: tuple[Harness, ServerThread, AggregatorClient],
) -> None:
    h, server, client = running
    info = client.open_round()
    payload = good_payload(h)
    server.engine.closing = True  # the round is being closed: nothing more may join it
    try:
        expect(
            server,
            client,
            stream(envelope(info, h.hosts[0], payload), h.hosts[0].key, payload),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            Reason.LATE,
        )
    finally:
        server.engine.closing = False
