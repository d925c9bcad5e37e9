"""Object storage: one small interface over a local directory and any S3-speaking service.

Keys are `/`-separated relative names ("shards/00000.tok"); a store never follows a key outside its
root or prefix. Writes are whole-object and atomic: a reader sees the old object, the new one, or no
object, never a part (local: temporary file, fsync, rename; S3: a PUT is atomic by the protocol).

`open_store(uri)` picks the implementation: a directory path, or `s3://bucket/prefix` with an optional
`?endpoint=http://host:port` (MinIO, R2, a test server). S3 credentials and region come from the
environment or the AWS config files as boto3 reads them (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...); this
module never reads, stores or logs them. An endpoint may also come from AWS_ENDPOINT_URL, which boto3
reads itself.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import parse_qs, urlsplit

CHUNK = 1 << 20


class StoreError(Exception):
    """A storage failure a person can act on; the message names the store and the key."""


class StoreUriError(StoreError, ValueError):
    """A store address that is neither a directory path nor a well-formed s3:// URI."""


class ObjectMissing(StoreError, KeyError):
    """The key names no object in the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class StoreUnavailable(StoreError, ConnectionError):
    """A failure that may pass: the connection failed or timed out, or the service answered 5xx/slow
    down. A `ConnectionError`, so readers in `training/` (which imports nothing of ours) retry it."""


class BadKey(StoreError, ValueError):
    """A key that is empty, absolute, or climbs out of the store ("..")."""


class ObjectStore(Protocol):
    """What the rest of the node uses; `LocalStore` and `S3Store` are the two implementations."""

    uri: str

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_file(self, key: str, path: Path) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes: ...

    def download(self, key: str, path: Path) -> None: ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("..", ".", "") for p in parts):
        raise BadKey(f"object key {key!r} must be a relative name without '.', '..' or backslashes")
    return key


def durable_write(path: Path, chunks: Iterator[bytes] | bytes) -> None:
    """Write `path` atomically: a temporary file beside it, fsync, rename, fsync of the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash only once the folder is synced
    finally:
        os.close(dir_fd)


def _file_chunks(handle: IO[bytes]) -> Iterator[bytes]:
    while chunk := handle.read(CHUNK):
        yield chunk


class LocalStore:
    """Objects as files under `root` (created on the first write)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _existing(self, key: str) -> Path:
        path = self._path(key)
        if not path.is_file():
            raise ObjectMissing(f"{self.uri}: no object {key!r}")
        return path

    def put_bytes(self, key: str, data: bytes) -> None:
        durable_write(self._path(key), data)

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as handle:
            durable_write(self._path(key), _file_chunks(handle))

    def get_bytes(self, key: str) -> bytes:
        return self._existing(key).read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with open(self._existing(key), "rb") as handle:
            handle.seek(start)
            return handle.read(length)

    def download(self, key: str, path: Path) -> None:
        with open(self._existing(key), "rb") as handle:
            durable_write(path, _file_chunks(handle))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        return self._existing(key).stat().st_size

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith("."):  # temporary files of writes in progress
                    continue
                key = (Path(dirpath) / name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


# S3 error codes that say "try again" (besides any 5xx status).
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                             "ServiceUnavailable"})


def _boto_error(exc: Exception, message: str) -> StoreError:
    """A botocore failure as ours: connection failures, timeouts and broken streams may pass."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError, IncompleteReadError

    transient = isinstance(exc, BotoConnectionError | HTTPClientError | IncompleteReadError)
    return (StoreUnavailable if transient else StoreError)(message)


PRESIGNED_OPERATIONS = {"GET": "get_object", "PUT": "put_object"}
UPLOAD_CONTENT_TYPE = "application/octet-stream"


class S3Store:
    """Objects under `s3://bucket/prefix` through boto3. `client` is passed in (tests, custom sessions)
    or made on first use from the environment's credentials."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self._client = client
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3  # imported here: a node that never touches S3 does not pay for it

            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url)
        return self._client

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, key: str, what: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, what)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise ObjectMissing(f"{self.uri}: no object {key!r}") from None
            kind = StoreUnavailable if status >= 500 or code in TRANSIENT_CODES else StoreError
            raise kind(f"{self.uri}: {what} {key!r} refused: {code or exc}") from None
        except BotoCoreError as exc:
            raise _boto_error(exc, f"{self.uri}: {what} {key!r} failed: {exc}") from None

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(key, "put_object", Key=self._key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as handle:
            self._call(key, "put_object", Key=self._key(key), Body=handle)

    def get_bytes(self, key: str) -> bytes:
        body = self._call(key, "get_object", Key=self._key(key))["Body"]
        return bytes(body.read())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        window = f"bytes={start}-{start + length - 1}"
        return bytes(self._call(key, "get_object", Key=self._key(key), Range=window)["Body"].read())

    def download(self, key: str, path: Path) -> None:
        from botocore.exceptions import BotoCoreError

        body = self._call(key, "get_object", Key=self._key(key))["Body"]
        try:
            durable_write(path, iter(lambda: body.read(CHUNK), b""))
        except BotoCoreError as exc:  # the connection broke while the body streamed
            raise _boto_error(exc, f"{self.uri}: download {key!r} failed: {exc}") from None

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectMissing:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._call(key, "head_object", Key=self._key(key))["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        if ".." in prefix.split("/") or prefix.startswith("/"):
            raise BadKey(f"list prefix {prefix!r} must be relative, without '..'")
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(f"{self.prefix}/") if self.prefix else 0
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
        try:
            return sorted(obj["Key"][strip:] for page in pages for obj in page.get("Contents", []))
        except Exception as exc:  # botocore raises ClientError lazily, while paging
            raise StoreError(f"{self.uri}: cannot list {prefix!r}: {exc}") from None

    def delete(self, key: str) -> None:
        self._call(key, "delete_object", Key=self._key(key))

    def presigned_url(self, key: str, method: str, expires_s: int) -> str:
        """A URL with which anyone holding it may GET (or PUT) this one object for `expires_s` seconds,
        without credentials: signed locally with this store's credentials, no request is made."""
        from botocore.exceptions import BotoCoreError

        operation = PRESIGNED_OPERATIONS[method]
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        if method == "PUT":  # the signature covers the content type: `upload_url` sends this one
            params["ContentType"] = UPLOAD_CONTENT_TYPE
        try:
            return str(self.client.generate_presigned_url(operation, Params=params, ExpiresIn=expires_s))
        except BotoCoreError as exc:  # no credentials to sign with
            raise StoreError(f"{self.uri}: cannot sign a {method} URL for {key!r}: {exc}") from None


def open_store(uri: str | Path, endpoint_url: str | None = None) -> LocalStore | S3Store:
    """A store for a directory path or `s3://bucket[/prefix][?endpoint=URL]`."""
    text = str(uri)
    if not text:
        raise StoreUriError("empty store address: give a directory or s3://bucket/prefix")
    if "://" not in text:
        return LocalStore(Path(text).expanduser())
    parts = urlsplit(text)
    if parts.scheme != "s3":
        raise StoreUriError(f"store address {text!r}: only directories and s3:// URIs are supported")
    if not parts.netloc:
        raise StoreUriError(f"store address {text!r} names no bucket: write s3://BUCKET/PREFIX")
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - {"endpoint"})
    if unknown:
        raise StoreUriError(f"store address {text!r}: unknown option(s) {unknown}; known: ['endpoint']")
    endpoint = query.get("endpoint", [endpoint_url])[-1]
    return S3Store(parts.netloc, parts.path.strip("/"), endpoint)


class UrlRefused(StoreError, ValueError):
    """A download address that is not http(s): a URL handed over the network never reads local files."""


class ObjectMismatch(StoreError):
    """A downloaded object is not what it was announced to be (length or sha256): changed in the store
    or in transit. Nothing from it is kept."""


def download_url(url: str, sink: IO[bytes], length: int, sha256: bytes, timeout_s: float = 60.0) -> int:
    """GET `url` into `sink`, refusing more than `length` bytes, and check the whole download's length and
    sha256 (ObjectMismatch; the caller discards what `sink` holds). Only http and https are followed."""
    import hashlib
    import urllib.error
    import urllib.request

    if urlsplit(url).scheme not in ("http", "https"):
        raise UrlRefused(f"download address {url[:60]!r}: only http:// and https:// URLs are followed")
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            while chunk := response.read(CHUNK):
                size += len(chunk)
                if size > length:
                    raise ObjectMismatch(f"{_where(url)}: more than the announced {length:,} bytes")
                digest.update(chunk)
                sink.write(chunk)
    except urllib.error.HTTPError as exc:
        kind = StoreUnavailable if exc.code >= 500 else StoreError
        raise kind(f"{_where(url)}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StoreUnavailable(f"{_where(url)}: {getattr(exc, 'reason', exc)}") from None
    if size != length or digest.digest() != sha256:
        raise ObjectMismatch(f"{_where(url)}: {size:,} bytes that do not hash to the announced sha256 "
                             f"{sha256.hex()[:16]}… ({length:,} bytes)")
    return size


def upload_url(url: str, data: bytes, timeout_s: float = 60.0) -> None:
    """PUT `data` to a presigned `url` (http(s) only); a refusal or a broken connection is a StoreError."""
    import urllib.error
    import urllib.request

    if urlsplit(url).scheme not in ("http", "https"):
        raise UrlRefused(f"upload address {url[:60]!r}: only http:// and https:// URLs are followed")
    request = urllib.request.Request(url, data=data, method="PUT", headers={"Content-Type": UPLOAD_CONTENT_TYPE})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        kind = StoreUnavailable if exc.code >= 500 else StoreError
        raise kind(f"{_where(url)}: PUT refused: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StoreUnavailable(f"{_where(url)}: PUT failed: {getattr(exc, 'reason', exc)}") from None


def _where(url: str) -> str:
    """A URL as messages show it: without its query (a presigned URL's signature stays out of logs)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def copy_tree(src: LocalStore | S3Store, dst: LocalStore | S3Store, prefix: str = "") -> int:
    """Copy every object under `prefix` from one store to another (through a temporary file)."""
    keys = src.list(prefix)
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            local = Path(tmp) / "object"
            src.download(key, local)
            dst.put_file(key, local)
    return len(keys)


__all__ = [
    "BadKey", "LocalStore", "ObjectMismatch", "ObjectMissing", "ObjectStore", "S3Store", "StoreError",
    "StoreUriError", "UrlRefused", "copy_tree", "download_url", "durable_write", "open_store", "upload_url",
]
