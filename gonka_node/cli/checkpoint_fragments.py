"""`checkpoint pull` of a sharded epoch (recipe `shards` S > 1): each of the S aggregators the chain
announced holds one fragment of every round's model, and the chain records the Merkle root over the
fragments' canonical hashes (gonka_node/core/fragments.py), not a hash of one file.

Every shard's fragment is downloaded from the shard's object store when it publishes one (each shard
its own key, `gonka_node/aggregator/publish.py`), else streamed (pinned to the certificate it announced
on chain, its FileMeta checked as any stream's), into a temporary file; the fragments are merged and the whole model's root
is compared with the chain's before anything is renamed into place. The merged file is an ordinary
checkpoint: `export`, `generate` and the model server read it like any other, and `verified_tensors`
checks it again by its root. Round 0 (the initial model, recorded as a plain sha256) comes whole from
the first shard.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from gonka_node.cli import CliError
from gonka_node.cli.checkpoint_chain import ChainCheckpoint
from gonka_node.cli.checkpoint_pull import MESSAGE_LIMIT, check_aggregator, fetch_into, verified_into

if TYPE_CHECKING:
    from torch import Tensor


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
        return verified_into(out, want, model, model_source, lambda tmp: _merge(parts, tmp),
                             lambda tmp: _verify(tmp, want, shards))


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
    """The fragments' tensors in one safetensors file with the round's own metadata (each part's
    description of itself, its fragment index and recorded hash, dropped); returns its size. The merge
    holds the model's tensors in memory once, as a host following the epoch does."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    from gonka_node.core.fragments import plain_metadata

    tensors: dict[str, Tensor] = {}
    metadata: dict[str, str] = {}
    for part in parts:
        try:
            with safe_open(str(part), framework="pt") as handle:
                names = list(handle.keys())
                clash = sorted(set(names) & set(tensors))
                if clash:
                    raise CliError(f"{part.name}: tensor {clash[0]} is in two shards' fragments; nothing was written")
                tensors.update({name: handle.get_tensor(name) for name in names})
                metadata = metadata or plain_metadata(dict(handle.metadata() or {}))
        except SafetensorError as exc:
            raise CliError(f"{part.name}: not a readable safetensors file ({exc}); nothing was written") from None
    save_file(tensors, str(out), metadata=metadata)
    return out.stat().st_size


def _verify(path: Path, want: ChainCheckpoint, shards: int) -> None:
    try:
        checked_by_root(path, want, shards)
    except CliError as exc:
        raise CliError(f"{exc}; nothing was written") from None


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

