"""gonka_node/core/storage.py against a real directory and a real S3-speaking server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from gonka_node.core.storage import (
    BadKey,
    LocalStore,
    ObjectMismatch,
    ObjectMissing,
    S3Store,
    StoreError,
    StoreUriError,
    UrlRefused,
    copy_tree,
    download_url,
    open_store,
)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> LocalStore | S3Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/data/set?endpoint={endpoint}")  # type: ignore[return-value]


def test_put_get_range_size_list_delete(store: LocalStore | S3Store, tmp_path: Path) -> None:
    store.put_bytes("a/one.bin", b"0123456789")
    source = tmp_path / "two.bin"
    source.write_bytes(b"x" * 3_000_000)  # larger than one read chunk
    store.put_file("b/two.bin", source)
    assert store.get_bytes("a/one.bin") == b"0123456789"
    assert store.get_range("a/one.bin", 3, 4) == b"3456"
    assert store.size("b/two.bin") == 3_000_000
    assert store.exists("a/one.bin") and not store.exists("a/none.bin")
    assert store.list() == ["a/one.bin", "b/two.bin"]
    assert store.list("b/") == ["b/two.bin"]
    out = tmp_path / "down" / "two.bin"
    store.download("b/two.bin", out)
    assert out.read_bytes() == source.read_bytes()
    store.put_bytes("a/one.bin", b"replaced")
    assert store.get_bytes("a/one.bin") == b"replaced"
    store.delete("a/one.bin")
    assert store.list() == ["b/two.bin"]


def test_missing_objects_raise_object_missing(store: LocalStore | S3Store, tmp_path: Path) -> None:
    for read in (lambda: store.get_bytes("nope"), lambda: store.size("nope"),
                 lambda: store.download("nope", tmp_path / "x"), lambda: store.get_range("nope", 0, 1)):
        with pytest.raises(ObjectMissing, match="no object 'nope'"):
            read()
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../../b", "a\\b", "./a"])
def test_bad_keys_refused(store: LocalStore | S3Store, key: str) -> None:
    with pytest.raises(BadKey):
        store.put_bytes(key, b"x")


def test_s3_prefix_isolates_stores(s3_endpoint: str, s3_bucket: str) -> None:
    one = open_store(f"s3://{s3_bucket}/one", endpoint_url=s3_endpoint)
    two = open_store(f"s3://{s3_bucket}/two", endpoint_url=s3_endpoint)
    one.put_bytes("k", b"1")
    assert two.list() == [] and not two.exists("k")
    assert one.list() == ["k"]


def test_s3_missing_bucket_is_a_store_error(s3_endpoint: str) -> None:
    store = open_store(f"s3://no-such-bucket-here?endpoint={s3_endpoint}")
    with pytest.raises(StoreError, match="no-such-bucket-here") as info:
        store.put_bytes("k", b"1")
    assert not isinstance(info.value, ObjectMissing)


def test_local_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_bytes("k", b"1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


@pytest.mark.parametrize(
    ("uri", "kind"),
    [("/data/x", LocalStore), ("relative/dir", LocalStore), ("s3://b/p/q", S3Store), ("s3://b", S3Store)],
)
def test_open_store_picks_the_implementation(uri: str, kind: type) -> None:
    assert isinstance(open_store(uri), kind)


def test_open_store_parses_bucket_prefix_endpoint() -> None:
    store = open_store("s3://bucket/a/b/?endpoint=http://127.0.0.1:9")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.endpoint_url, store.uri) == (
        "bucket", "a/b", "http://127.0.0.1:9", "s3://bucket/a/b")


@pytest.mark.parametrize(
    ("uri", "message"),
    [("", "empty store address"), ("gs://b/p", "only directories and s3://"), ("s3:///p", "names no bucket"),
     ("s3://b/p?region=x", "unknown option")],
)
def test_bad_uris_refused(uri: str, message: str) -> None:
    with pytest.raises(StoreUriError, match=message):
        open_store(uri)


def test_copy_tree_between_local_and_s3(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = LocalStore(tmp_path)
    local.put_bytes("m.json", b"{}")
    local.put_bytes("shards/0.tok", b"\x01\x02")
    remote = open_store(f"s3://{s3_bucket}/ds", endpoint_url=s3_endpoint)
    assert copy_tree(local, remote) == 2
    assert remote.get_bytes("shards/0.tok") == b"\x01\x02"


def test_a_presigned_url_downloads_the_object_checked_against_length_and_sha256(
    s3_endpoint: str, s3_bucket: str
) -> None:
    import hashlib
    import io

    store = open_store(f"s3://{s3_bucket}/p?endpoint={s3_endpoint}")
    assert isinstance(store, S3Store)
    data = b"z" * 3_000_000
    store.put_bytes("o.bin", data)
    url = store.presigned_url("o.bin", "GET", 60)
    sink = io.BytesIO()
    assert download_url(url, sink, len(data), hashlib.sha256(data).digest()) == len(data)
    assert sink.getvalue() == data
    with pytest.raises(ObjectMismatch, match="more than the announced 1,000,000 bytes") as info:
        download_url(url, io.BytesIO(), 1_000_000, hashlib.sha256(data).digest())
    assert "Signature" not in str(info.value)  # the URL's signature stays out of messages
    with pytest.raises(ObjectMismatch, match="do not hash to the announced sha256"):
        download_url(url, io.BytesIO(), len(data), bytes(32))
    with pytest.raises(StoreError, match="HTTP 404"):
        download_url(store.presigned_url("none.bin", "GET", 60), io.BytesIO(), 1, bytes(32))


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x", "/etc/passwd"])
def test_download_url_follows_only_http(url: str) -> None:
    import io

    with pytest.raises(UrlRefused, match="only http:// and https:// URLs are followed"):
        download_url(url, io.BytesIO(), 10, bytes(32))
