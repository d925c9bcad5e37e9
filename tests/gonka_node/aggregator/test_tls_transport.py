"""The aggregator's real server speaks TLS only, and its client trusts nothing but the pinned certificate."""

from __future__ import annotations

import time

import grpc
import pytest
from agg_harness import Harness
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gonka_node.core.client import AggregatorClient
from gonka_node.core.tls import PeerCertificateError, create_identity, pinned_channel
from proto.gonka.v1 import aggregator_pb2 as pb
from proto.gonka.v1 import checkpoints_pb2 as cpb
from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc


def test_a_pinned_client_uses_every_service(harness: Harness) -> None:
    harness.schedule(3)
    server = harness.start_server()
    with server.client(30) as client:
        info = client.open_round()
        assert (info.epoch, info.round, info.base_checkpoint_sha256) == (harness.epoch, 1, harness.init_sha)
        assert client.checkpoint(harness.epoch, 0).meta.content_sha256 == harness.init_sha
    with pinned_channel(server.target, harness.identity.cert_pem) as channel:
        epochs = cpb_grpc.CheckpointsStub(channel).ListEpochs(cpb.ListEpochsRequest(), timeout=30)
        assert [e.epoch for e in epochs.epochs] == [harness.epoch]
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_another_pin_fails_fast_with_both_certificates_named(harness: Harness) -> None:
    harness.schedule(3)
    server = harness.start_server()
    other = create_identity()
    with pinned_channel(server.target, other.cert_pem) as channel, pytest.raises(grpc.RpcError) as raw:
        pb.RoundInfo.FromString(channel.unary_unary("/gonka.v1.Aggregator/GetOpenRound")(b"", timeout=30))
    assert raw.value.code() == grpc.StatusCode.UNAVAILABLE  # what gRPC itself says
    host = harness.hosts[0]
    with server.client(30) as honest:
        info = honest.open_round()
    started = time.monotonic()
    with AggregatorClient(server.target, other.cert_pem, 30) as client:
        with pytest.raises(PeerCertificateError) as opening:
            client.open_round()
        with pytest.raises(PeerCertificateError):  # a submission too: never a retryable SubmitRejected
            client.submit(info, host.address, b"payload", host.key)
    assert time.monotonic() - started < 10  # told at once, not after the call's timeout
    assert f"presents TLS certificate sha256 {harness.identity.sha256.hex()}" in str(opening.value)
    assert f"not the pinned {other.sha256.hex()}" in str(opening.value)
    assert server.engine.store.submissions(harness.epoch, 1) == []


def test_a_plaintext_client_gets_nothing(harness: Harness) -> None:
    harness.schedule(3)
    server = harness.start_server()
    with grpc.insecure_channel(server.target) as channel:
        for method in ("/gonka.v1.Aggregator/GetOpenRound", "/grpc.health.v1.Health/Check"):
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(method)(b"", timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, method
