"""Finalized rounds written through the object store (aggregator/publish.py) and pulled from it: the
engine kit's real SQLite store, real EVM and real checkpoint files, a real S3-speaking server on
127.0.0.1 (moto, once per session: tests/conftest.py), and a real TLS gRPC server for the clients."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import grpc
import pytest
from agg_harness import ServerThread
from engine_kit import Kit
from test_engine_close import row, submit_all

from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint
from gonka_node.cli.checkpoint_pull import pull_checkpoint
from gonka_node.core.config import ConfigError, load_aggregator_config
from gonka_node.core.storage import LocalStore, S3Store, open_store
from gonka_node.core.tls import create_identity, pinned_channel
from training.checkpoint import canonical_sha256, tensors_view

CKPT, UPDATE = "checkpoints/{e}/000001.safetensors", "updates/{e}/000001.safetensors"


@pytest.fixture
def bucket_store(s3_endpoint: str, s3_bucket: str) -> S3Store:
    store = open_store(f"s3://{s3_bucket}/agg?endpoint={s3_endpoint}")
    assert isinstance(store, S3Store)
    return store


def publishing(kit: Kit, objects: LocalStore | S3Store, public_url: str = "") -> RoundEngine:
    """An engine on the kit's store that publishes to `objects` (a second call: the same one restarted)."""
    e = kit.engine(start=False)
    e.publisher = RoundPublisher(e.store, objects, public_url, url_expiry_s=600)
    e.start()
    return e


def finalized_round(kit: Kit, objects: S3Store) -> RoundEngine:
    e = publishing(kit, objects)
    submit_all(kit, e, 3)
    kit.run(e.tick())
    assert row(e).state == "finalized"
    return e


def test_a_restart_between_writing_and_finalizing_rewrites_what_the_store_lost(
    kit: Kit, bucket_store: S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = kit.world.epoch
    e = publishing(kit, bucket_store)
    submit_all(kit, e, 3)

    def chain_down(*args: object) -> None:
        raise ConnectionError("the chain went away")

    monkeypatch.setattr(e.chain, "finalize_round", chain_down)
    kit.run(e.tick())  # the close fails after the store was written, before the chain heard of it
    assert row(e).state == "finalizing"
    keys = [CKPT.format(e=ep), UPDATE.format(e=ep)]
    assert bucket_store.list() == keys
    assert not kit.world.chain.client(0).round_result(ep, 1).finalized
    bucket_store.delete(keys[0])  # a crash lost the checkpoint's write (or the store did)
    monkeypatch.undo()
    again = publishing(kit, bucket_store)  # restarted: resumes the intent, writes, then finalizes
    assert row(again).state == "finalized"
    on_chain = bytes(kit.world.chain.client(0).round_result(ep, 1).checkpoint_sha256)
    stored = bucket_store.get_bytes(keys[0])
    assert on_chain == row(again).checkpoint_sha256
    assert bytes.fromhex(canonical_sha256(tensors_view(stored))) == on_chain
    assert stored == e.store.checkpoint_path(ep, 1).read_bytes()
    assert bucket_store.list() == keys


def test_a_codec_broadcast_is_published_as_the_bytes_hosts_decode(kit: Kit, bucket_store: S3Store) -> None:
    e = kit.engine(start=False)
    e.ctx = dataclasses.replace(e.ctx, broadcast="codec")
    e.publisher = RoundPublisher(e.store, bucket_store)
    e.start()
    submit_all(kit, e, 3)
    kit.run(e.tick())
    assert row(e).state == "finalized"
    stored = bucket_store.get_bytes(UPDATE.format(e=kit.world.epoch))
    assert stored == e.store.update_path(kit.world.epoch, 1).read_bytes()
    assert stored[:4] == b"GNKC"  # the codec's payload (the upload format), not safetensors
    assert bucket_store.list() == [CKPT.format(e=kit.world.epoch), UPDATE.format(e=kit.world.epoch)]


def test_the_default_store_is_the_data_directory_and_copies_nothing(kit: Kit) -> None:
    e = kit.engine(start=False)
    publisher = RoundPublisher(e.store, open_store(kit.tmp / "agg"))
    e.publisher = publisher
    e.start()
    submit_all(kit, e, 3)
    kit.run(e.tick())
    assert row(e).state == "finalized"
    assert publisher.publish(kit.world.epoch, 1) == []  # the objects are the files themselves
    where = publisher.locate(kit.world.epoch, 1, now_ms=0)
    assert sorted(where) == ["checkpoint", "update"] and where["checkpoint"].url == ""
    assert where["checkpoint"].key == CKPT.format(e=kit.world.epoch)


def test_a_public_url_names_each_key_without_expiry(kit: Kit, tmp_path: Path) -> None:
    e = kit.engine(start=False)
    e.publisher = RoundPublisher(e.store, LocalStore(tmp_path / "public"), "https://cdn.example/run/")
    e.start()
    submit_all(kit, e, 3)
    kit.run(e.tick())
    got = e.publisher.locate(kit.world.epoch, 1, now_ms=5)["checkpoint"]
    path = e.store.checkpoint_path(kit.world.epoch, 1)
    assert (got.url, got.expires_ms, got.length) == (
        f"https://cdn.example/run/{CKPT.format(e=kit.world.epoch)}", 0, path.stat().st_size)
    assert (tmp_path / "public" / got.key).read_bytes() == path.read_bytes()


@pytest.fixture
def served(kit: Kit, bucket_store: S3Store) -> tuple[ServerThread, ChainCheckpoint]:
    """Round 1 finalized and published to S3, then the aggregator restarted behind a TLS gRPC server."""
    finalized_round(kit, bucket_store)
    ep = kit.world.epoch
    server = ServerThread(lambda: publishing_unstarted(kit, bucket_store), create_identity()).start()
    d = kit.world.chain.deployment
    sha = bytes(kit.world.chain.client(0).round_result(ep, 1).checkpoint_sha256)
    try:
        yield server, ChainCheckpoint(ep, 1, sha, d.chain_id, d.registry)
    finally:
        server.stop()


def publishing_unstarted(kit: Kit, objects: S3Store) -> RoundEngine:
    e = kit.engine(start=False)
    e.publisher = RoundPublisher(e.store, objects, url_expiry_s=600)
    return e


def pull(server: ServerThread, want: ChainCheckpoint, out: Path) -> int:
    with pinned_channel(server.target, server.identity.cert_pem) as channel:
        size, _note = pull_checkpoint(channel, want, out, timeout_s=20, max_bytes=1 << 20)
    return size


def test_a_client_pulls_the_checkpoint_from_s3_and_verifies_it_against_the_chain(
    served: tuple[ServerThread, ChainCheckpoint], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, want = served
    with server.client(20) as client:
        location = client.locate(want.epoch, 1)
    assert location is not None and location.checkpoint.url.startswith("http://127.0.0.1:")
    assert "Signature=" in location.checkpoint.url and location.checkpoint.expires_unix_ms > 0
    out = tmp_path / "pulled.safetensors"
    size = pull(server, want, out)
    assert "from the aggregator's object store" in capsys.readouterr().err
    assert size == out.stat().st_size == location.checkpoint.length
    assert bytes.fromhex(canonical_sha256(tensors_view(out.read_bytes()))) == want.sha256


def test_a_tampered_store_object_is_refused_and_the_aggregator_streams_it(
    served: tuple[ServerThread, ChainCheckpoint], bucket_store: S3Store, kit: Kit, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    server, want = served
    key = CKPT.format(e=want.epoch)
    bucket_store.put_bytes(key, kit.init_path.read_bytes())  # another real checkpoint, same kind of file
    out = tmp_path / "pulled.safetensors"
    pull(server, want, out)
    assert "the object store's copy was refused" in capsys.readouterr().err
    assert bytes.fromhex(canonical_sha256(tensors_view(out.read_bytes()))) == want.sha256
    caplog.set_level(logging.WARNING, "gonka_node.core.client")
    with server.client(20) as client:  # the host's follower downloads the same way
        got = client.checkpoint(want.epoch, 1).data
        update = client.round_update(want.epoch, 1).data  # untouched in the store: taken from there
    assert bytes.fromhex(canonical_sha256(tensors_view(got))) == want.sha256
    assert [m for m in caplog.messages if "from the store failed" in m] == [
        f"round {want.epoch}/1: checkpoint from the store failed (http://{bucket_store.endpoint_url[7:]}/"
        f"{bucket_store.bucket}/agg/{key}: {len(kit.init_path.read_bytes()):,} bytes that do not hash to the "
        f"announced sha256 {hashlib.sha256(server.engine.store.checkpoint_path(want.epoch, 1).read_bytes()).hexdigest()[:16]}… "
        f"({server.engine.store.checkpoint_path(want.epoch, 1).stat().st_size:,} bytes)); streaming it from the aggregator"]
    assert update == bucket_store.get_bytes(UPDATE.format(e=want.epoch))


def test_a_checkpoint_the_chain_does_not_record_leaves_nothing(
    served: tuple[ServerThread, ChainCheckpoint], bucket_store: S3Store, tmp_path: Path
) -> None:
    server, want = served
    out = tmp_path / "client" / "pulled.safetensors"
    wrong = ChainCheckpoint(want.epoch, want.round, b"\x01" * 32, want.chain_id, want.registry)
    with pytest.raises(CliError, match="fails verification against the chain"):
        pull(server, wrong, out)
    assert list(out.parent.iterdir()) == []  # the download was deleted, nothing at `out`


def test_locate_of_a_round_not_finalized_is_none(served: tuple[ServerThread, ChainCheckpoint]) -> None:
    server, want = served
    with server.client(20) as client:
        assert client.locate(want.epoch, 2) is None
        with pytest.raises(grpc.RpcError):
            client.checkpoint(want.epoch, 2)


@pytest.mark.parametrize(("line", "message"), [
    ("url_expiry_s = 0", r"\[store\] url_expiry_s must be in \[1, 604800\], got 0"),
    ('public_url = "ftp://cdn.example"', r"\[store\] public_url must start with http:// or https://"),
    ('bucket = "b"', "bucket"),
    ('uri = "/data/store"\ndirect_upload = true', r"direct_upload needs an s3:// uri"),
    ('uri = "s3://b"\ndirect_upload = true\npublic_url = "https://cdn.example"', "exclude each other"),
])
def test_bad_store_settings_are_refused(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "agg.toml"
    path.write_text(f"[store]\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        load_aggregator_config(path, environ={})
