"""`checkpoint pull` of a sharded epoch (recipe `shards` S > 1): each of the S aggregators the chain
announced holds one fragment of every round's model, and the chain records the Merkle root over the
fragments' canonical hashes (gonka_node/core/fragments.py), not a hash of one file.

Every shard's fragment is downloaded from the shard's object store when it publishes one (each shard
its own key, `gonka_node/aggregator/publish.py`), else streamed (pinned to the certificate it announced
on chain, its FileMeta checked as any stream's), into a temporary file. Each file must hold exactly its
fragment of the plan, and the fragments' Merkle root (each fragment hashed with only it in memory) must
be the chain's; then the files are merged (bytes copied under one header, no tensor held) and the merge
is renamed into place. The merged file is an ordinary checkpoint: `export`, `generate` and the model
server read it like any other, and `checked_by_root` checks it again by its root. Round 0 (the initial
model, recorded as a plain sha256) comes whole from the first shard.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint
from gonka_node.cli.checkpoint_pull import MESSAGE_LIMIT, check_aggregator, fetch_into, verified_into

if TYPE_CHECKING:
    from torch import Tensor

COPY_CHUNK = 8 << 20


def pull_fragments(
    chain: Any, shards: int, want: ChainCheckpoint, out: Path, *, timeout_s: float, max_bytes: int,
    model: Any = None, model_source: str = "",
) -> tuple[int, str]:
    """Round `want.round` of a sharded epoch from every shard announced on chain, merged into `out`
    once its Merkle root is the chain's; returns the merged file's size and what became of its
    metadata (as `pull_checkpoint`)."""
    announced = chain.aggregator_endpoints(want.epoch)
    if len(announced) != shards:
        raise CliError(f"epoch {want.epoch} has {shards} aggregator shards and {len(announced)} announced "
                       "their endpoint on chain: every shard's fragment is needed, so wait until all have")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        parts, budget = [], max_bytes
        for i, shard in enumerate(announced):
            part = Path(scratch) / f"fragment-{i}.safetensors"
            budget -= _fetch_fragment(shard, i, want, part, timeout_s, budget)
            parts.append(part)
        _verify(parts, want, shards)
        return verified_into(out, want, model, model_source, lambda tmp: _merge(parts, tmp), lambda tmp: None)


def _fetch_fragment(shard: Any, index: int, want: ChainCheckpoint, path: Path, timeout_s: float,
                    max_bytes: int) -> int:
    """Shard `index`'s file of the round into `path`, from its object store or its stream (as
    `fetch_into`); returns its length."""
    from gonka_node.core.tls import pinned_channel

    where = f"shard {index} ({shard.endpoint})"
    check_aggregator(shard.endpoint, shard.tls_cert_pem, min(timeout_s, 10.0))
    try:
        with pinned_channel(shard.endpoint, shard.tls_cert_pem,
                            options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)]) as channel, \
                path.open("w+b") as handle:
            return fetch_into(channel, want, handle, timeout_s, max_bytes, where)
    except grpc.RpcError as exc:
        raise CliError(f"{where}: StreamCheckpoint epoch {want.epoch} round {want.round} failed: "
                       f"{exc.code().name} {exc.details()}") from None


def _merge(parts: list[Path], out: Path) -> int:
    """The fragments as one safetensors file, bytes copied (a merged header, then each fragment's data):
    no tensor is held; returns the file's size."""
    from gonka_node.core.fragments import merged_header

    headers = [_header(part) for part in parts]
    with out.open("wb") as sink:
        sink.write(merged_header([(entries, part.stat().st_size - size) for part, (entries, size) in
                                  zip(parts, headers, strict=True)]))
        for part, (_, size) in zip(parts, headers, strict=True):
            with part.open("rb") as source:
                source.seek(size)
                shutil.copyfileobj(source, sink, COPY_CHUNK)
    return out.stat().st_size


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's parsed header and its size with the 8-byte length."""
    with path.open("rb") as handle:
        (n,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(n)), 8 + n


def _verify(parts: list[Path], want: ChainCheckpoint, shards: int) -> None:
    try:
        _check_fragments(parts, want, shards)
    except (CliError, KeyError, TypeError, ValueError, struct.error) as exc:  # ValueError: JSON, the plan
        raise CliError(f"epoch {want.epoch} round {want.round}: {exc}; nothing was written") from None


def _check_fragments(parts: list[Path], want: ChainCheckpoint, shards: int) -> None:
    """Each file is its fragment of the plan and their Merkle root is the chain's: checked one fragment
    in memory at a time, before anything is merged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from gonka_node.core.fragments import fragment_root, plan_fragments
    from training.checkpoint import canonical_sha256

    names = [{n: tuple(e["shape"]) for n, e in _header(p)[0].items() if n != "__metadata__"} for p in parts]
    spec = {name: shape for held in names for name, shape in held.items()}
    if sum(len(held) for held in names) != len(spec):
        raise CliError("a tensor is in two shards' fragments")
    hashes = []
    for fragment, part, held in zip(plan_fragments(spec, shards), parts, names, strict=True):
        if set(held) != set(fragment.names):
            raise CliError(f"shard {fragment.index} served {len(held)} tensors, not the {len(fragment.names)} of "
                           f"fragment {fragment.index}")
        try:
            hashes.append(bytes.fromhex(canonical_sha256(load_file(str(part)))))
        except SafetensorError as exc:
            raise CliError(f"shard {fragment.index}'s file is not a readable safetensors file ({exc})") from None
    got = fragment_root(hashes)
    if got != want.sha256:
        raise CliError(f"the {shards} fragments' Merkle root is {got.hex()}, the chain records "
                       f"{want.sha256.hex()}: a shard served another fragment")


def checked_by_root(path: Path, want: ChainCheckpoint, shards: int) -> dict[str, Tensor]:
    """The file's tensors, if their Merkle root over `shards` fragments is the chain's hash (CliError
    otherwise): a pulled file before it is renamed into place, or one already on disk."""
    from gonka_node.core.fragments import FragmentError, model_root
    from training.checkpoint import CheckpointError, load_checkpoint

    try:
        tensors = load_checkpoint(path).tensors
        got = model_root(tensors, shards)
    except (CheckpointError, FragmentError) as exc:
        raise CliError(f"epoch {want.epoch} round {want.round}: {exc}") from None
    if got != want.sha256:
        raise CliError(
            f"epoch {want.epoch} round {want.round}: the {shards} fragments' Merkle root is {got.hex()}, the chain "
            f"records {want.sha256.hex()}: a shard served another fragment"
        )
    return tensors

