"""`checkpoint pull`'s transfer: a checkpoint streamed from an aggregator's Checkpoints service (TLS,
pinned) into a temporary file beside the target, the stream's FileMeta checked as it goes, then the
canonical tensor sha256 against the chain and the file's model config against the epoch's (refused if
it differs, stripped if nothing vouches for it); only a verified file is renamed into place.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint
from gonka_node.core.tls import TlsError, check_peer

# A chunk is at most 1 MiB; the default 4 MiB receive limit leaves room for the protobuf framing.
MESSAGE_LIMIT = 4 << 20
DEFAULT_MAX_BYTES = 64 << 30  # refuse a stream that announces more than this (a 1B fp32 model is ~4 GiB)


def check_aggregator(target: str, pin: bytes, timeout_s: float) -> None:
    """Fail with what is wrong (unreachable, no TLS, another certificate) before streaming anything."""
    try:
        check_peer(target, pin, timeout_s)
    except TlsError as exc:
        raise CliError(f"--aggregator: {exc}") from None
    except ValueError as exc:
        raise CliError(f"--aggregator {exc}") from None
    except OSError as exc:
        raise CliError(f"--aggregator {target}: cannot connect ({exc.strerror or exc})") from None


def pull_checkpoint(
    channel: grpc.Channel, want: ChainCheckpoint, out: Path, *, timeout_s: float, max_bytes: int,
    model: Any = None, model_source: str = "",
) -> tuple[int, str]:
    """Stream (epoch, round) into `out`, verified against `want.sha256` and its metadata against `model`
    (the epoch's ModelConfig from `model_source`; None: no source, the metadata is stripped); returns the
    file size and a line saying what became of the metadata (`verified_into`)."""

    def write(tmp: Path) -> int:
        with tmp.open("r+b") as handle:
            return fetch_into(channel, want, handle, timeout_s, max_bytes)

    try:
        return verified_into(out, want, model, model_source, write, lambda tmp: _verify_file(tmp, want))
    except grpc.RpcError as exc:
        raise CliError(
            f"--aggregator: StreamCheckpoint epoch {want.epoch} round {want.round} failed: "
            f"{exc.code().name} {exc.details()}"
        ) from None


def verified_into(
    out: Path, want: ChainCheckpoint, model: Any, model_source: str,
    write: Callable[[Path], int], verify: Callable[[Path], object],
) -> tuple[int, str]:
    """`write` the checkpoint into a temporary file beside `out` (returning its size), `verify` it
    against the chain, settle its metadata (`_settle_metadata`), then rename it onto `out`: nothing is
    left behind unless verified."""
    from training.durable import durable_replace, fsync_path

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        size = write(tmp)
        fsync_path(tmp)
        verify(tmp)
        note = _settle_metadata(tmp, want, model, model_source)
        durable_replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, note


def fetch_into(channel: grpc.Channel, want: ChainCheckpoint, handle: Any, timeout_s: float, max_bytes: int,
               where: str = "aggregator stream") -> int:
    """The checkpoint's bytes into `handle`: from the aggregator's object store when it names a URL for
    the round, else (or when that download fails or is not the object announced) its gRPC stream."""
    from proto.gonka.v1 import checkpoints_pb2 as cpb
    from proto.gonka.v1 import checkpoints_pb2_grpc as cpb_grpc

    stored = _from_store(channel, want, handle, timeout_s, max_bytes)
    if stored is not None:
        return stored
    handle.seek(0)
    handle.truncate()  # whatever a failed store download left
    request = cpb.StreamCheckpointRequest(epoch=want.epoch, round=want.round)
    stream = cpb_grpc.CheckpointsStub(channel).StreamCheckpoint(request, timeout=timeout_s)
    return receive_stream(stream, want, handle, max_bytes, where)


def _from_store(channel: grpc.Channel, want: ChainCheckpoint, handle: Any, timeout_s: float,
                max_bytes: int) -> int | None:
    """Download the round's checkpoint from the URL the aggregator's LocateRound names; None (saying why
    on stderr) when it names none or the download fails. Verified against the chain afterwards, as any."""
    from gonka_node.core.storage import StoreError, download_url
    from proto.gonka.v1 import aggregator_pb2 as pb
    from proto.gonka.v1 import aggregator_pb2_grpc as pb_grpc

    try:
        location = pb_grpc.AggregatorStub(channel).LocateRound(
            pb.RoundRef(epoch=want.epoch, round=want.round), timeout=timeout_s)
    except grpc.RpcError:  # an older aggregator, or a round it does not hold: its stream says why
        return None
    obj = location.checkpoint
    if not obj.url:
        return None
    if obj.length > max_bytes:
        raise CliError(f"the store's checkpoint of epoch {want.epoch} round {want.round} is {obj.length:,} bytes, "
                       f"more than --max-bytes {max_bytes:,}")
    try:
        size = download_url(obj.url, handle, obj.length, obj.file_sha256, timeout_s)
    except StoreError as exc:
        print(f"warning: the object store's copy was refused ({exc}); streaming from the aggregator instead",
              file=sys.stderr)
        return None
    print(f"downloaded {obj.key} from the aggregator's object store", file=sys.stderr)
    return size


def _settle_metadata(path: Path, want: ChainCheckpoint, model: Any, model_source: str) -> str:
    """Keep the file's model config only if it is the epoch's; refuse a contradicting one; strip one that
    nothing vouches for (a server can rewrite metadata freely: the chain's hash covers tensors only)."""
    from safetensors import safe_open

    from training.hf_export import MODEL_CONFIG_KEY, ExportError, config_from_metadata
    from training.model import ModelConfig

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    claimed: ModelConfig | ExportError | None
    try:
        claimed = config_from_metadata(metadata)
    except ExportError as exc:
        claimed = exc
    if claimed is None:
        return "the file records no model config"
    if model is not None and claimed == model:
        return f"its model config is {model_source}'s"
    if model is not None:
        raise CliError(
            f"epoch {want.epoch} round {want.round}: the file's tensors match the chain but its metadata "
            f"{MODEL_CONFIG_KEY!r} ({claimed}) is not {model_source}'s model ({model}): the aggregator "
            "rewrote what the hash does not cover; the file was deleted"
        )
    _rewrite_metadata(path, {k: v for k, v in metadata.items() if k != MODEL_CONFIG_KEY})
    return (f"its metadata {MODEL_CONFIG_KEY!r} was removed: no recipe on chain or --recipe vouches for it "
            "(export/generate then need --recipe or --preset)")


def _rewrite_metadata(path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata=metadata)


def receive_stream(stream: Iterator[Any], want: ChainCheckpoint, handle: Any, max_bytes: int,
                   where: str = "aggregator stream") -> int:
    """Write the FileChunk stream to `handle`, checking its FileMeta as it goes; returns the length."""
    where = f"{where} for epoch {want.epoch} round {want.round}"
    first = next(stream, None)
    if first is None or first.WhichOneof("part") != "meta":
        raise CliError(f"{where}: did not start with a FileMeta message")
    meta = first.meta
    if (meta.epoch, meta.round) != (want.epoch, want.round):
        raise CliError(f"{where}: FileMeta is for epoch {meta.epoch} round {meta.round}")
    if meta.content_sha256 != want.sha256:
        raise CliError(
            f"{where}: FileMeta.content_sha256 is {meta.content_sha256.hex() or '(empty)'}, the chain records "
            f"{want.sha256.hex()}: this aggregator serves a different checkpoint; nothing was written"
        )
    if meta.length > max_bytes:
        raise CliError(f"{where}: FileMeta.length {meta.length:,} exceeds --max-bytes {max_bytes:,}")
    digest, size = hashlib.sha256(), 0
    for message in stream:
        if message.WhichOneof("part") != "data":
            raise CliError(f"{where}: a second FileMeta in the stream")
        size += len(message.data)
        if size > meta.length:
            raise CliError(f"{where}: more bytes than FileMeta.length {meta.length:,}")
        digest.update(message.data)
        handle.write(message.data)
    if size != meta.length:
        raise CliError(f"{where}: ended after {size:,} of FileMeta.length {meta.length:,} bytes (truncated)")
    if digest.digest() != meta.file_sha256:
        raise CliError(f"{where}: the bytes do not hash to FileMeta.file_sha256 (corrupted in transfer)")
    return size


def _verify_file(path: Path, want: ChainCheckpoint) -> None:
    from training.checkpoint import CheckpointError, load_checkpoint

    try:
        load_checkpoint(path, expected_sha256=want.sha256.hex())
    except CheckpointError as exc:
        fragment = _fragment_of(path)
        if fragment:  # one shard's part of a sharded epoch's model, pulled as if it were the whole
            raise CliError(
                f"epoch {want.epoch} round {want.round}: the aggregator serves fragment {fragment} of a sharded "
                "epoch, and no recipe says how many shards it has: give the epoch's recipe (--recipe FILE) so "
                "that every shard's fragment is pulled and checked against the chain's root; it was deleted"
            ) from None
        raise CliError(
            f"epoch {want.epoch} round {want.round}: the downloaded file fails verification against the "
            f"chain ({exc}); it was deleted"
        ) from None


def _fragment_of(path: Path) -> str:
    """The "k/S" a fragment file's metadata names ("" for a whole checkpoint, or no readable file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return str((handle.metadata() or {}).get("fragment", ""))
    except (SafetensorError, OSError):
        return ""
