"""Fragments of a model for sharded aggregators (docs/PROTOCOL.md "Sharded aggregators").

An epoch with S aggregators splits the model's tensors into S fixed fragments, balanced by size; the
round's checkpoint hash is a Merkle root over the fragments' canonical hashes, so a client verifies
one fragment alone with log2(S) sibling hashes. Pure functions of the spec and S: hosts, shards and
clients compute the same plan and the same root.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# The plan is training's (streamed epochs cut by it too); named here for the shards, hosts and clients.
from training.fragments import Fragment as Fragment
from training.fragments import FragmentError as FragmentError
from training.fragments import Spec as Spec
from training.fragments import plan_fragments as plan_fragments

if TYPE_CHECKING:
    from torch import Tensor

LEAF_TAG = b"gonka-fragment-v1\n"
NODE_TAG = b"\x01"


def global_offsets(spec: Spec) -> dict[str, int]:
    """Each tensor's first coordinate in the whole update (tensors in sorted name order, as a payload
    and the count sketch lay them out): what a shard's fragment sketch is computed at."""
    offsets, at = {}, 0
    for name in sorted(spec):
        offsets[name] = at
        at += math.prod(spec[name])
    return offsets


def fragment_leaf(index: int, shards: int, fragment_sha256: bytes) -> bytes:
    if not 0 <= index < shards or len(fragment_sha256) != 32:
        raise FragmentError(f"fragment {index} of {shards} with a {len(fragment_sha256)}-byte hash")
    return hashlib.sha256(LEAF_TAG + index.to_bytes(4, "little") + shards.to_bytes(4, "little") + fragment_sha256).digest()


def _parent(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_TAG + left + right).digest()


def _levels(hashes: Sequence[bytes]) -> list[list[bytes]]:
    level = [fragment_leaf(i, len(hashes), h) for i, h in enumerate(hashes)]
    levels = [level]
    while len(level) > 1:
        level = [_parent(level[j], level[j + 1]) if j + 1 < len(level) else level[j] for j in range(0, len(level), 2)]
        levels.append(level)
    return levels


def fragment_root(hashes: Sequence[bytes]) -> bytes:
    """The round's checkpoint hash from its fragments' canonical hashes, in fragment order; one
    fragment (an unsharded epoch): its canonical hash itself."""
    if not hashes:
        raise FragmentError("no fragment hashes")
    if len(hashes) == 1:
        return bytes(hashes[0])
    return _levels(hashes)[-1][0]


def fragment_proof(hashes: Sequence[bytes], index: int) -> list[bytes]:
    """Sibling hashes from fragment `index`'s leaf to the root (a carried-up odd node has none)."""
    if not 0 <= index < len(hashes):
        raise FragmentError(f"fragment {index} of {len(hashes)}")
    proof = []
    for level in _levels(hashes)[:-1]:
        sibling = index ^ 1
        if sibling < len(level):
            proof.append(level[sibling])
        index //= 2
    return proof


def verify_fragment(fragment_sha256: bytes, index: int, shards: int, proof: Sequence[bytes], root: bytes) -> bool:
    """Whether fragment `index` of `shards` with this canonical hash is part of `root`."""
    if shards == 1:
        return index == 0 and not proof and fragment_sha256 == root
    node, width = fragment_leaf(index, shards, fragment_sha256), shards
    steps = iter(proof)
    while width > 1:
        sibling = index ^ 1
        if sibling < width:
            other = next(steps, None)
            if other is None:
                return False
            node = _parent(other, node) if index & 1 else _parent(node, other)
        index, width = index // 2, (width + 1) // 2
    return next(steps, None) is None and node == root


@dataclass(frozen=True)
class FragmentProof:
    """Fragment `index` of `count`'s place under a round's root: its canonical hash and the sibling
    hashes from its leaf up (`fragment_proof`). No side bits: the side of each sibling follows from
    the index (an even node is the left one), so a proof cannot claim a side its index contradicts.
    What a shard serves with its fragment; a client trusts none of it but what `proves` checks."""

    index: int
    count: int
    fragment_sha256: bytes
    siblings: tuple[bytes, ...]

    @classmethod
    def of(cls, hashes: Sequence[bytes], index: int) -> FragmentProof:
        """Fragment `index`'s proof from the S fragment hashes, in fragment order."""
        siblings = tuple(fragment_proof(hashes, index))  # refuses an index outside the hashes
        return cls(index, len(hashes), bytes(hashes[index]), siblings)

    def proves(self, root: bytes) -> bool:
        """Whether this proof places its fragment hash at its index under `root` (a malformed one, an
        index outside its count or a hash not 32 bytes long, proves nothing)."""
        try:
            return verify_fragment(self.fragment_sha256, self.index, self.count, self.siblings, root)
        except FragmentError:
            return False


def model_root(tensors: Mapping[str, Tensor], shards: int) -> bytes:
    """The checkpoint hash the chain records for a whole model of a sharded epoch: the root over its
    fragments' canonical hashes (one shard: the canonical hash itself). What a host following rounds,
    or a client holding every fragment, compares with `round_result`."""
    from training.checkpoint import canonical_sha256  # torch: only where tensors are hashed

    spec = {name: tuple(t.shape) for name, t in tensors.items()}
    hashes = [bytes.fromhex(canonical_sha256({n: tensors[n] for n in f.names})) for f in plan_fragments(spec, shards)]
    return fragment_root(hashes)


def verify_fragment_tensors(
    tensors: Mapping[str, Tensor], index: int, shards: int, proof: Sequence[bytes], root: bytes
) -> bool:
    """Whether these tensors are fragment `index` of the checkpoint whose root is `root` (a client that
    pulled one fragment, with the sibling hashes of its leaf)."""
    from training.checkpoint import canonical_sha256

    return verify_fragment(bytes.fromhex(canonical_sha256(tensors)), index, shards, proof, root)


def plain_metadata(meta: Mapping[str, str]) -> dict[str, str]:
    """A fragment file's metadata without what describes that file alone (its recorded hash, its
    fragment "k/S"): a merged file keeps the round's own (epoch, round, model config)."""
    return {k: v for k, v in meta.items() if not k.startswith("gonka.") and k != "fragment"}


def merged_header(parts: Sequence[tuple[Mapping[str, Any], int]]) -> bytes:
    """The start of one safetensors file holding every part's tensors (`parts`: each file's parsed
    header and its data size, in the order their data will follow): the 8-byte length and the JSON, each
    part's offsets moved past the parts before it, the first part's metadata without what describes that
    file alone, padded with spaces to 8 bytes as safetensors writes it."""
    header: dict[str, Any] = {}
    base = 0
    for entries, size in parts:
        for name, entry in entries.items():
            if name == "__metadata__":
                continue
            if name in header:
                raise FragmentError(f"tensor {name!r} is in two fragments")
            begin, end = entry["data_offsets"]
            header[name] = {**entry, "data_offsets": [begin + base, end + base]}
        base += size
    meta = parts[0][0].get("__metadata__") if parts else None
    if isinstance(meta, dict):
        header["__metadata__"] = plain_metadata(meta)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
