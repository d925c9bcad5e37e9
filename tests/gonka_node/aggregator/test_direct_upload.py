"""Hosts PUT payloads straight into the aggregator's S3 store (`[store] direct_upload`): a presigned PUT
per host and round from `GetUploadSlot`, then Submit names the object and the aggregator reads it back
through the same ingest as a stream. Real S3 server (moto, tests/conftest.py), real TLS gRPC server,
the engine kit's real chain and store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agg_harness import ServerThread
from engine_kit import Kit, payload, update
from test_engine_close import row

from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.aggregator.store import now_ms
from gonka_node.core.client import AggregatorClient, SubmitRejected
from gonka_node.core.storage import S3Store, open_store, upload_url
from gonka_node.core.tls import create_identity
from gonka_node.core.wire import header_for
from proto.gonka.v1 import aggregator_pb2 as pb


@pytest.fixture
def server(kit: Kit, s3_endpoint: str, s3_bucket: str) -> Iterator[ServerThread]:
    objects = open_store(f"s3://{s3_bucket}/agg?endpoint={s3_endpoint}")
    assert isinstance(objects, S3Store)

    def build() -> RoundEngine:
        e = kit.engine(start=False)
        e.publisher = RoundPublisher(e.store, objects, url_expiry_s=600, direct_upload=True)
        return e

    running = ServerThread(build, create_identity()).start()
    try:
        yield running
    finally:
        running.stop()


def open_round(kit: Kit, client: AggregatorClient) -> pb.RoundInfo:
    kit.clock.ms = now_ms()  # the kit's held clock: headers are stamped with the real one
    return client.open_round()


def test_an_honest_payload_put_into_the_store_is_accepted(kit: Kit, server: ServerThread) -> None:
    h, data = kit.hosts[0], payload(update(1))
    with server.client(20) as client:
        info = open_round(kit, client)
        assert info.direct_upload
        receipt = client.submit(info, h.address, data, h.key)
    assert receipt.accepted and receipt.payload_length == len(data)
    e = server.engine
    server.run(e.checks.drain(kit.world.epoch, 1))  # its checks follow the receipt
    stored = e.store.submissions(kit.world.epoch, 1)
    assert [s.host for s in stored] == [h.address]
    assert e.store.payload_path(kit.world.epoch, 1, h.address).read_bytes() == data
    assert e.publisher is not None
    key = e.publisher.upload_key(kit.world.epoch, 1, h.address)
    assert key == f"uploads/{kit.world.epoch}/1/{h.address.hex()}.bin" and e.publisher.objects.get_bytes(key) == data


@pytest.mark.parametrize(("put", "reason"), [
    (lambda data: data + b"\x00", "OBJECT_MISMATCH"),  # not the signed length
    (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "DIGEST_MISMATCH"),  # the length, not the bytes
    (None, "OBJECT_MISMATCH"),  # nothing was PUT
])
def test_an_object_that_is_not_the_signed_payload_is_refused(
    kit: Kit, server: ServerThread, put: object, reason: str
) -> None:
    h, data = kit.hosts[1], payload(update(2))
    with server.client(20) as client:
        info = open_round(kit, client)
        header = header_for(info, h.address, data, 64, h.key, b"\x05" * 32)
        slot = client.upload_slot(header)
        if callable(put):
            upload_url(slot.url, put(data))
        stream = [pb.SubmitRequest(header=header), pb.SubmitRequest(stored=pb.StoredPayload(key=slot.key))]
        with pytest.raises(SubmitRejected) as info_:
            client.submit_raw(iter(stream))
    assert info_.value.reason == reason and info_.value.receipt is not None
    assert not info_.value.receipt.accepted
    assert server.engine.store.submissions(kit.world.epoch, 1) == []
    # Nothing was judged against the host: it may PUT the right bytes and submit again.
    upload_url(slot.url, data)
    with server.client(20) as again:
        assert again.submit_raw(iter(stream)).accepted


def test_another_hosts_key_and_unsigned_slot_requests_are_refused(kit: Kit, server: ServerThread) -> None:
    h, other, data = kit.hosts[0], kit.hosts[1], payload(update(3))
    with server.client(20) as client:
        info = open_round(kit, client)
        header = header_for(info, h.address, data, 64, h.key, b"\x05" * 32)
        forged = pb.SubmitHeader()
        forged.CopyFrom(header)
        forged.signature = bytes(64)
        with pytest.raises(SubmitRejected) as refused:
            client.upload_slot(forged)
        assert refused.value.reason == "BAD_SIGNATURE"
        slot = client.upload_slot(header)
        upload_url(slot.url, data)
        assert server.engine.publisher is not None
        theirs = server.engine.publisher.upload_key(kit.world.epoch, 1, other.address)
        stream = [pb.SubmitRequest(header=header), pb.SubmitRequest(stored=pb.StoredPayload(key=theirs))]
        with pytest.raises(SubmitRejected) as wrong_key:
            client.submit_raw(iter(stream))
    assert wrong_key.value.reason == "MALFORMED" and "must be" in wrong_key.value.message
    assert row(server.engine).state == "open"
