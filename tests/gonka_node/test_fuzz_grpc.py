"""Property-based tests of the aggregator's gRPC handlers over a real server on 127.0.0.1:0.

Claims, for every method of `Aggregator` and `Checkpoints`: any request bytes get an answer (OK, or an
error status chosen by our code — never UNKNOWN, which is what an exception escaping a handler becomes),
the server keeps serving, and nothing is stored. For `Submit` with structured headers (real hosts'
keys, near-valid fields, garbage payloads): a refusal with a known reason, the documented status, and
a receipt signed by the aggregator saying "rejected".
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "aggregator"))  # the aggregator tests' harness
from agg_harness import Harness, ServerThread, chain_world, windows

from gonka_node.aggregator.reasons import Reason
from gonka_node.aggregator.server import STATUS
from gonka_node.core.client import SubmitRejected
from gonka_node.core.envelope import EnvelopeError, Submission
from gonka_node.core.tls import pinned_channel
from gonka_node.core.wire import header_pb, verify_receipt
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc
from proto.gonka.v1 import checkpoints_pb2 as cpb
from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc

__all__ = ["chain_world", "windows"]  # module-scoped fixtures of the harness, used below

FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# An error status our handlers pick on purpose. UNKNOWN is what an exception escaping a handler
# becomes; it is allowed only for bytes that are not the request message at all, which grpc's asyncio
# server refuses that way before any handler runs.
CHOSEN = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, *STATUS.values()}
REQUEST = {
    "/gonka.v1.Aggregator/GetOpenRound": pb.GetOpenRoundRequest,
    "/gonka.v1.Aggregator/GetRoundResult": pb.RoundRef,
    "/gonka.v1.Aggregator/GetRewardProof": pb.GetRewardProofRequest,
    "/gonka.v1.Aggregator/GetSubmission": pb.SubmissionRef,
    "/gonka.v1.Checkpoints/ListEpochs": cpb.ListEpochsRequest,
    "/gonka.v1.Checkpoints/ListRounds": cpb.ListRoundsRequest,
    "/gonka.v1.Aggregator/GetRoundUpdate": pb.RoundRef,
    "/gonka.v1.Aggregator/GetCheckpoint": pb.RoundRef,
    "/gonka.v1.Checkpoints/StreamCheckpoint": cpb.StreamCheckpointRequest,
}
DECODE_TIME = {Reason.UNDECODABLE, Reason.WRONG_SHAPE, Reason.NON_FINITE, Reason.NORM_TOO_LARGE}
STREAMING = {"/gonka.v1.Aggregator/GetRoundUpdate", "/gonka.v1.Aggregator/GetCheckpoint",
             "/gonka.v1.Checkpoints/StreamCheckpoint"}


def parses(message_type: type, data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except DecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def server(chain_world, windows, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Harness, ServerThread]]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    snapshot = chain_world.backend.snapshot()
    h = Harness(chain_world, tmp_path_factory.mktemp("fuzz-grpc"), windows)
    try:
        h.schedule()
        yield h, h.start_server()
    finally:
        h.stop()
        chain_world.backend.revert(snapshot)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def channel(server: tuple[Harness, ServerThread]) -> Iterator[grpc.Channel]:
    with pinned_channel(server[1].target, server[1].identity.cert_pem) as ch:
        yield ch


def state(server: ServerThread) -> tuple[object, ...]:
    """Everything a request could change: the open round, its submissions, files under the data dir."""
    e = server.engine
    r = e.current
    assert r is not None
    # Evidence of signed garbage is kept on purpose (it is what slashes its signer): not round state.
    files = sorted(str(p.relative_to(e.store.root)) for p in e.store.root.rglob("*") if p.is_file()
                   and not p.name.startswith("state.sqlite3") and p.parent.name != "evidence")
    return (e.store.get_round(r.epoch, r.round), e.store.submissions(r.epoch, r.round), files, e.closing)


def still_serving(ch: grpc.Channel) -> None:
    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    pb.RoundInfo.FromString(ch.unary_unary("/gonka.v1.Aggregator/GetOpenRound")(b"", timeout=10))


@FUZZ
@given(method=st.sampled_from(sorted(REQUEST)), data=st.binary(max_size=300))
def test_any_request_bytes_get_a_chosen_answer_and_change_nothing(
    server: tuple[Harness, ServerThread], channel: grpc.Channel, method: str, data: bytes
) -> None:
    before = state(server[1])
    try:
        if method in STREAMING:
            for _ in channel.unary_stream(method)(data, timeout=30):
                pass
        else:
            channel.unary_unary(method)(data, timeout=30)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNKNOWN:
            assert not parses(REQUEST[method], data), f"{method}: a handler raised: {exc.details()}"
        else:
            assert exc.code() in CHOSEN, f"{method}: {exc.code()} {exc.details()}"
    assert state(server[1]) == before
    still_serving(channel)


@FUZZ
@given(messages=st.lists(st.binary(max_size=200), max_size=5))
def test_any_submit_stream_of_raw_messages_is_refused_and_changes_nothing(
    server: tuple[Harness, ServerThread], channel: grpc.Channel, messages: list[bytes]
) -> None:
    before = state(server[1])
    with pytest.raises(grpc.RpcError) as caught:
        channel.stream_unary("/gonka.v1.Aggregator/Submit")(iter(messages), timeout=30)
    code = caught.value.code()
    if code == grpc.StatusCode.UNKNOWN:
        assert not all(parses(pb.SubmitRequest, m) for m in messages), caught.value.details()
    else:
        assert code in CHOSEN, caught.value.details()
    assert state(server[1]) == before
    still_serving(channel)


# ---- structured submissions -------------------------------------------------------------------------

U64 = st.integers(min_value=0, max_value=2**64 - 1)


def fuzzed_fields(
    data: st.DataObject, info: pb.RoundInfo, host: bytes, body: bytes
) -> dict[str, object]:
    """The open round's true values with at most two fields replaced by a near miss or garbage, so
    most examples get past the cheap checks to the signature, the stream and the decoder."""
    now = time.time_ns() // 1_000_000
    true: dict[str, object] = {
        "chain_id": info.chain_id,
        "registry": bytes(info.registry),
        "epoch": info.epoch,
        "round": info.round,
        "host": host,
        "base_checkpoint_sha256": bytes(info.base_checkpoint_sha256),
        "codec": info.codec,
        "payload_sha256": hashlib.sha256(body).digest(),
        "payload_length": len(body),
        "tokens_trained": 1000,
        "timestamp_ms": now,
        "residual_root": hashlib.sha256(host).digest(),
    }
    other: dict[str, st.SearchStrategy[object]] = {
        "chain_id": U64,
        "registry": st.binary(min_size=20, max_size=20),
        "epoch": st.one_of(st.just(info.epoch + 1), U64),
        "round": st.one_of(st.just(info.round + 1), st.just(0), U64),
        "host": st.binary(min_size=20, max_size=20),
        "base_checkpoint_sha256": st.binary(min_size=32, max_size=32),
        "codec": st.sampled_from(["int8", "bf16", "topk"]),
        "payload_sha256": st.binary(min_size=32, max_size=32),
        "payload_length": st.one_of(st.integers(0, len(body) + 10), st.just(2**40), U64),
        "tokens_trained": U64,
        "timestamp_ms": st.one_of(st.just(now - 10**9), U64),
        "residual_root": st.binary(max_size=40),
    }
    for name in data.draw(st.sets(st.sampled_from(sorted(true)), max_size=2)):
        true[name] = data.draw(other[name])
    return true


@FUZZ
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), size=st.integers(0, 3000),
       host_index=st.integers(0, 2), sign_with_own_key=st.sampled_from([True, True, True, False]), chunk=st.sampled_from([1, 7, 512, 4096]))
def test_structured_garbage_submissions_are_refused_with_a_signed_receipt(
    server: tuple[Harness, ServerThread], channel: grpc.Channel, data: st.DataObject, seed: int, size: int,
    host_index: int, sign_with_own_key: bool, chunk: int,
) -> None:
    harness, srv = server
    host = harness.hosts[host_index]
    with srv.client(30) as client:
        info = client.open_round()
        body = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
        fields = fuzzed_fields(data, info, host.address, body)
        try:
            sub = Submission(**fields)  # type: ignore[arg-type]
        except EnvelopeError:
            return  # cannot be expressed on the wire either (uint64 fields, fixed widths)
        key = host.key if sign_with_own_key else harness.hosts[(host_index + 1) % 3].key
        requests = [pb.SubmitRequest(header=header_pb(sub, sub.sign(key)))]
        requests += [pb.SubmitRequest(chunk=body[i : i + chunk]) for i in range(0, len(body), chunk)]
        before = state(srv)
        try:
            receipt = client.submit_raw(iter(requests))
        except SubmitRejected as exc:
            rejected = exc
        else:  # received and stored; its checks, after the receipt, refuse it (and leave no file)
            status = client.checked(info.epoch, info.round, sub.host)
            assert receipt.accepted and verify_receipt(receipt, info.aggregator_key)
            assert status.state == pb.SubmissionStatus.FAILED and Reason(status.reason) in DECODE_TIME, status
            event(f"{Reason(status.reason).name} after the receipt")
            srv.run(srv.engine.checks.drain(info.epoch, info.round))  # the check's own end: its file removed
            assert state(srv) == before
            return
    reason = Reason[rejected.reason]
    event(reason.name)
    assert rejected.code == STATUS[reason]
    assert rejected.receipt is not None and not rejected.receipt.accepted
    assert rejected.receipt.reason == reason.value
    assert verify_receipt(rejected.receipt, info.aggregator_key)
    assert state(srv) == before


@FUZZ
@given(epoch=U64, round_=U64, host=st.binary(max_size=24))
def test_reads_of_any_epoch_round_and_host_are_answered_or_not_found(
    server: tuple[Harness, ServerThread], channel: grpc.Channel, epoch: int, round_: int, host: bytes
) -> None:
    ref = pb.RoundRef(epoch=epoch, round=round_)
    calls = [
        lambda s: s.GetRoundResult(ref, timeout=30),
        lambda s: s.GetRewardProof(pb.GetRewardProofRequest(epoch=epoch, round=round_, host=host), timeout=30),
        lambda s: list(s.GetRoundUpdate(ref, timeout=30)),
        lambda s: list(s.GetCheckpoint(ref, timeout=30)),
    ]
    stub = pb_grpc.AggregatorStub(channel)
    checkpoints = cpb_grpc.CheckpointsStub(channel)
    calls += [
        lambda _: checkpoints.ListRounds(cpb.ListRoundsRequest(epoch=epoch), timeout=30),
        lambda _: list(checkpoints.StreamCheckpoint(cpb.StreamCheckpointRequest(epoch=epoch, round=round_), timeout=30)),
    ]
    before = state(server[1])
    for call in calls:
        try:
            call(stub)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, f"{exc.code()}: {exc.details()}"
    assert state(server[1]) == before
