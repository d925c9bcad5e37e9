"""Finalized rounds written through the object store (aggregator/publish.py) and pulled from it: the
engine kit's real SQLite store, real EVM and real checkpoint files, and a real S3-speaking server on
127.0.0.1 (moto, once per session: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_kit import Kit
from test_engine_close import row, submit_all

from gonka_node.aggregator.publish import RoundPublisher
from gonka_node.aggregator.rounds import RoundEngine
from gonka_node.core.config import ConfigError, load_aggregator_config
from gonka_node.core.storage import LocalStore, S3Store, open_store
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


@pytest.mark.parametrize(("line", "message"), [
    ("url_expiry_s = 0", r"\[store\] url_expiry_s must be in \[1, 604800\], got 0"),
    ('public_url = "ftp://cdn.example"', r"\[store\] public_url must start with http:// or https://"),
    ('bucket = "b"', "bucket"),
])
def test_bad_store_settings_are_refused(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "agg.toml"
    path.write_text(f"[store]\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        load_aggregator_config(path, environ={})
