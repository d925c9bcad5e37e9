"""A finalized round's checkpoint and broadcast update, written to the aggregator's object store and located
for hosts and clients (docs/PROTOCOL.md "Object storage").

Key layout: the aggregator's data directory's own names, relative to the store's root
(`checkpoints/<epoch>/<round:06d>.safetensors`, `updates/<epoch>/<round:06d>.safetensors`; the update
holds the codec payload when the recipe's `broadcast = "codec"`). A shard of a sharded epoch holds one
fragment of each file and publishes it under its own key, `<round:06d>.fragment-<k>-of-<S>.safetensors`,
so the S shards of an epoch can share one bucket (a client takes every fragment and checks the merge by
its Merkle root), and beside it the round's S fragment hashes (the root's leaves, with which a client
checks one fragment alone), `<round:06d>.fragments.fragment-<k>-of-<S>.json`. The default store is the
data directory itself, so an aggregator configured with no store keeps today's layout and publishing
writes nothing.

`publish` runs in `RoundEngine._finish`, after the finalize intent is recorded and before the chain
transaction, on the first attempt and on every resume: it writes each object unless the store already
holds one of the same length, so a restart re-writes what a crash left out, and nothing finalized on chain
names an object the store lacks (the files it copies are durable before the intent is recorded).

With `[store] direct_upload`, hosts PUT their payloads to `uploads/<epoch>/<round>/<host hex>.bin`
through a presigned URL per host and round (`upload_slot`), and Submit names the object instead of
streaming it; the server reads it back in chunks through the same ingest as a stream.

A URL per object is handed out by `locate`: `public_url` + key when the store is served publicly (a CDN
in front of an R2 or S3 bucket: cacheable, no signing per request), else a presigned GET valid for
`url_expiry_s` for an S3 store, else none (a local store: clients stream over gRPC as before).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from gonka_node.aggregator.shard_close import fragments_path
from gonka_node.aggregator.store import Store
from gonka_node.core.storage import LocalStore, S3Store

FILE_CHUNK = 1 << 20


@dataclass(frozen=True)
class Located:
    """Where one published object can be downloaded, and what it must be (`url` empty: nowhere)."""

    key: str
    url: str
    length: int
    file_sha256: bytes
    expires_ms: int  # 0: no expiry


class RoundPublisher:
    """Writes a round's files from the aggregator's `Store` into `objects`, and says where they are."""

    def __init__(self, rounds: Store, objects: LocalStore | S3Store, public_url: str = "",
                 url_expiry_s: int = 3600, direct_upload: bool = False,
                 fragment: tuple[int, int] | None = None) -> None:
        self.rounds, self.objects = rounds, objects
        self.fragment = fragment  # (k, S): this aggregator is shard k of S and holds fragment k
        self.public_url = public_url.rstrip("/")
        self.url_expiry_s = url_expiry_s
        # Hosts PUT payloads into `objects` (an S3 store) through `upload_slot`; the config checks the kind.
        self.direct_upload = direct_upload and isinstance(objects, S3Store)
        self._digests: dict[Path, bytes] = {}  # file sha256 per published file (they never change)
        self._lock = threading.Lock()

    def files(self, epoch: int, round_: int) -> dict[str, Path]:
        """The round's publishable files by kind ("checkpoint", "update") that exist locally."""
        paths = {"checkpoint": self.rounds.checkpoint_path(epoch, round_),
                 "update": self.rounds.update_path(epoch, round_)}
        return {kind: path for kind, path in paths.items() if path.is_file()}

    def key(self, path: Path) -> str:
        key = path.relative_to(self.rounds.root).as_posix()
        if self.fragment is None:
            return key
        stem, _, suffix = key.rpartition(".")
        return f"{stem}.fragment-{self.fragment[0]}-of-{self.fragment[1]}.{suffix}"

    def _to_publish(self, epoch: int, round_: int) -> list[Path]:
        """The round's files, and a shard's S fragment hashes kept beside its checkpoint (the root's
        leaves: with them a client checks one fragment alone, from the store only)."""
        paths = list(self.files(epoch, round_).values())
        leaves = fragments_path(self.rounds.checkpoint_path(epoch, round_))
        if self.fragment is not None and leaves.is_file():
            paths.append(leaves)
        return paths

    def publish(self, epoch: int, round_: int) -> list[str]:
        """Write the round's files into the store unless already there; returns the keys written."""
        written = []
        for path in self._to_publish(epoch, round_):
            key = self.key(path)
            if self._in_place(key, path) or self._present(key, path):
                continue
            self.objects.put_file(key, path)
            written.append(key)
        return written

    def _in_place(self, key: str, path: Path) -> bool:
        """Whether the store's object for `key` is the local file itself (the default store)."""
        return isinstance(self.objects, LocalStore) and (self.objects.root / key).resolve() == path.resolve()

    def _present(self, key: str, path: Path) -> bool:
        return self.objects.exists(key) and self.objects.size(key) == path.stat().st_size

    def locate(self, epoch: int, round_: int, now_ms: int) -> dict[str, Located]:
        """Download addresses of the round's published files by kind (empty URLs: not downloadable)."""
        return {kind: self._locate(path, now_ms) for kind, path in self.files(epoch, round_).items()}

    def _locate(self, path: Path, now_ms: int) -> Located:
        key, length = self.key(path), path.stat().st_size
        if self.public_url:
            return Located(key, f"{self.public_url}/{key}", length, self.digest(path), 0)
        if isinstance(self.objects, S3Store):
            url = self.objects.presigned_url(key, "GET", self.url_expiry_s)
            return Located(key, url, length, self.digest(path), now_ms + self.url_expiry_s * 1000)
        return Located(key, "", length, b"", 0)

    def digest(self, path: Path) -> bytes:
        """The file's sha256, computed once per process (a published file is never rewritten)."""
        with self._lock:
            known = self._digests.get(path)
        if known is not None:
            return known
        h = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(FILE_CHUNK):
                h.update(block)
        with self._lock:
            self._digests[path] = h.digest()
        return h.digest()

    # ---- direct uploads ------------------------------------------------------------------------------

    def upload_key(self, epoch: int, round_: int, host: bytes) -> str:
        """Where a host's payload of a round goes (not under `payloads/`: the data directory's own; a
        shard's fragment of it under a name of its own)."""
        name = host.hex() if self.fragment is None else f"{host.hex()}.fragment-{self.fragment[0]}-of-{self.fragment[1]}"
        return f"uploads/{epoch}/{round_}/{name}.bin"

    def upload_slot(self, epoch: int, round_: int, host: bytes, now_ms: int) -> Located:
        """A presigned PUT for the host's payload of the round (the header was authenticated already)."""
        assert isinstance(self.objects, S3Store) and self.direct_upload
        key = self.upload_key(epoch, round_, host)
        url = self.objects.presigned_url(key, "PUT", self.url_expiry_s)
        return Located(key, url, 0, b"", now_ms + self.url_expiry_s * 1000)
