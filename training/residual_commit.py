"""Commitments to a host's error-feedback residual: the building blocks of a replay check for top-k epochs.

Error feedback (`training.codecs.ErrorFeedback`) makes an honest host's round satisfy exactly, up to fp32
rounding,

    Δ_r = decode(P_r) + e_r − d·e_{r−1}

with e_{r−1} its residual before the round's compress, e_r the one after and d the decay. The residual is
private, so a host commits to e_r in each payload's signed envelope (`residual_root`); when the replay
picks it, the aggregator samples chunks from the round's seed (`sample_chunks`), the host opens e_{r−1}
and e_r there (`open_chunks`), the aggregator checks both against the roots the host signed
(`verify_opening`) and against the payloads they were left by (`payload_misfit`: each payload must be the
top-k compression of decode + residual), and compares `claimed_delta` with its replay of the round on those chunks (`compare`).

Layout (`ChunkLayout`): tensors in sorted name order, each flattened and cut into chunks of `chunk`
elements (a tensor's last chunk may be shorter), numbered 0, 1, … across tensors in that order. No chunk
straddles two tensors: a sharded rig's owner process hashes the tensors it owns, and with the top-k
codec's chunk size a commitment chunk is exactly one codec chunk.

Tree: leaf_i = sha256(LEAF_TAG ‖ uint64_be(i) ‖ chunk bytes as fp32 little-endian); a node =
sha256(NODE_TAG ‖ left ‖ right), levels pairing neighbours left to right, an odd last node moving up
unchanged; the root of one leaf is the leaf. A path lists the sibling of each level from the leaf up,
skipping levels where the node has none; the index and the layout's chunk count say which side each is
on. Written here with sha256 rather than reusing chain/merkle.py: `training` imports nothing else of ours
(docs/ARCHITECTURE.md), and the reward tree's keccak sorted-pair leaves are for the EVM, not this.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from training.codec_base import HEADER_SIZE, HeaderError, PayloadSizeError, Spec
from training.codecs_sparse import TopKCodec
from training.cpu_pool import map_parts, workers_for

LEAF_TAG = b"gonka-residual-leaf-v1"
NODE_TAG = b"gonka-residual-node-v1"
SAMPLE_TAG = b"gonka-residual-sample-v1"
DEFAULT_CHUNK = 4096  # the top-k codec's default chunk: one commitment chunk per codec chunk
_LEAVES_PER_THREAD = 256  # below this a thread costs more than its share of hashing


@dataclass(frozen=True)
class ChunkLayout:
    """Where chunk i of a residual lies: `tensors` is (name, numel) in sorted name order."""

    tensors: tuple[tuple[str, int], ...]
    chunk: int = DEFAULT_CHUNK
    firsts: tuple[int, ...] = field(init=False, repr=False)  # each tensor's first chunk index, then the count

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"ChunkLayout: chunk must be >= 1, got {self.chunk}")
        if [n for n, _ in self.tensors] != sorted(n for n, _ in self.tensors):
            raise ValueError("ChunkLayout: tensors must be in sorted name order")
        counts = [math.ceil(numel / self.chunk) for _, numel in self.tensors]
        object.__setattr__(self, "firsts", tuple(int(x) for x in np.cumsum([0, *counts])))

    @classmethod
    def of(cls, spec: Spec, chunk: int = DEFAULT_CHUNK) -> ChunkLayout:
        return cls(tuple((n, math.prod(spec[n])) for n in sorted(spec)), chunk)

    @property
    def n_chunks(self) -> int:
        return self.firsts[-1]

    def locate(self, index: int) -> tuple[str, int, int]:
        """(tensor name, first element, end element) of chunk `index` in its flattened tensor."""
        if not 0 <= index < self.n_chunks:
            raise IndexError(f"chunk {index} is outside the layout's {self.n_chunks} chunks")
        t = int(np.searchsorted(self.firsts, index, side="right")) - 1
        name, numel = self.tensors[t]
        start = (index - self.firsts[t]) * self.chunk
        return name, start, min(start + self.chunk, numel)

    def chunk_len(self, index: int) -> int:
        _, start, end = self.locate(index)
        return end - start


@dataclass(frozen=True)
class Opening:
    """Chunks of a committed residual: per index (ascending) its fp32 little-endian bytes and Merkle path."""

    indices: tuple[int, ...]
    chunks: tuple[bytes, ...]
    paths: tuple[tuple[bytes, ...], ...]

    def values(self) -> Tensor:
        """The opened elements, chunk after chunk, as one flat fp32 tensor."""
        data = b"".join(self.chunks)
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))


def chunk_bytes(residual: Mapping[str, Tensor], layout: ChunkLayout, index: int) -> bytes:
    """Chunk `index` of `residual` (a name missing from it is zero: a host's residual before round 1)."""
    name, start, end = layout.locate(index)
    if name not in residual:
        return bytes(4 * (end - start))
    flat = residual[name].detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    return flat[start:end].numpy().astype("<f4").tobytes()


def leaf_hash(index: int, data: bytes | memoryview) -> bytes:
    h = hashlib.sha256(LEAF_TAG)
    h.update(index.to_bytes(8, "big"))
    h.update(data)  # a slice of a residual's buffer, hashed in place
    return h.digest()


def tensor_leaves(residual: Mapping[str, Tensor], layout: ChunkLayout, name: str) -> list[bytes]:
    """The leaves of tensor `name`'s chunks (missing from `residual`: zero), in layout order: what one
    process of a sharded rig contributes for a tensor it owns. The tensor's fp32 bytes are read once."""
    t = [n for n, _ in layout.tensors].index(name)
    first, numel = layout.firsts[t], layout.tensors[t][1]
    if name in residual:
        flat = residual[name].detach().to(device="cpu", dtype=torch.float32).reshape(-1).numpy()
        data = np.ascontiguousarray(flat, dtype="<f4").data.cast("B")
        if len(data) != 4 * numel:
            raise ValueError(f"{name}: {len(data) // 4} elements, the layout has {numel}")
    else:
        data = memoryview(bytes(4 * numel))
    step, n = 4 * layout.chunk, layout.firsts[t + 1] - first
    share = -(-n // workers_for(n, _LEAVES_PER_THREAD))

    def leaves(start: int) -> list[bytes]:
        return [leaf_hash(first + j, data[j * step : (j + 1) * step]) for j in range(start, min(start + share, n))]

    # hashlib lets go of the GIL while it hashes a chunk: a 1.2B residual's 300k leaves on every core
    return [leaf for part in map_parts(leaves, range(0, n, share)) for leaf in part]


def residual_leaves(residual: Mapping[str, Tensor], layout: ChunkLayout) -> list[bytes]:
    """Every chunk's leaf, in layout order."""
    return [leaf for name, _ in layout.tensors for leaf in tensor_leaves(residual, layout, name)]


def root_of_leaves(leaves: Sequence[bytes]) -> bytes:
    """The root over leaves already in layout order (a rig's rank 0 joins its processes' leaves)."""
    if not leaves:
        raise ValueError("a residual commitment needs at least one element")
    return _levels(list(leaves))[-1][0]


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_TAG + left + right).digest()


def _levels(leaves: list[bytes]) -> list[list[bytes]]:
    levels = [leaves]
    while len(levels[-1]) > 1:
        level = levels[-1]
        up = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        levels.append(up + level[len(level) - len(level) % 2 :])  # an odd last node moves up unchanged
    return levels


def _tree(leaf_of: Callable[[int], bytes], layout: ChunkLayout) -> list[list[bytes]]:
    if layout.n_chunks == 0:
        raise ValueError("a residual commitment needs at least one element")
    return _levels([leaf_of(i) for i in range(layout.n_chunks)])


def residual_tree(residual: Mapping[str, Tensor], layout: ChunkLayout) -> list[list[bytes]]:
    """Every level of the tree over `residual`'s chunks, leaves first, the root last."""
    if layout.n_chunks == 0:
        raise ValueError("a residual commitment needs at least one element")
    return _levels(residual_leaves(residual, layout))


def residual_root(residual: Mapping[str, Tensor], layout: ChunkLayout) -> bytes:
    return residual_tree(residual, layout)[-1][0]


def zero_root(layout: ChunkLayout) -> bytes:
    """The root of an all-zero residual: what every host holds before its first round."""
    return _tree(lambda i: leaf_hash(i, bytes(4 * layout.chunk_len(i))), layout)[-1][0]


def _path(levels: list[list[bytes]], index: int) -> tuple[bytes, ...]:
    path = []
    for level in levels[:-1]:
        if index ^ 1 < len(level):
            path.append(level[index ^ 1])
        index //= 2
    return tuple(path)


def open_chunks(residual: Mapping[str, Tensor], layout: ChunkLayout, indices: Iterable[int]) -> Opening:
    """The host's answer to a challenge: the chunks at `indices` (sorted, unique) and their paths."""
    wanted = tuple(sorted(set(indices)))
    levels = residual_tree(residual, layout)
    chunks = tuple(chunk_bytes(residual, layout, i) for i in wanted)
    return Opening(wanted, chunks, tuple(_path(levels, i) for i in wanted))


def _root_from_path(leaf: bytes, index: int, path: Sequence[bytes], n_leaves: int) -> bytes | None:
    """The root `path` leads to from `leaf` at `index`, or None when it has the wrong length."""
    node, width, used = leaf, n_leaves, 0
    while width > 1:
        if index ^ 1 < width:
            if used == len(path):
                return None
            sibling = path[used]
            node = _node(sibling, node) if index & 1 else _node(node, sibling)
            used += 1
        index, width = index // 2, (width + 1) // 2
    return node if used == len(path) else None


def verify_opening(root: bytes, opening: Opening, layout: ChunkLayout, sample: Sequence[int]) -> bool:
    """True when `opening` opens exactly the chunks of `sample`, each of its layout length, all values
    finite (no honest residual holds NaN or infinity), and every path leads to `root`."""
    if opening.indices != tuple(sorted(set(sample))):
        return False
    if not len(opening.chunks) == len(opening.paths) == len(opening.indices):
        return False
    for index, data, path in zip(opening.indices, opening.chunks, opening.paths, strict=True):
        if len(data) != 4 * layout.chunk_len(index):
            return False
        if _root_from_path(leaf_hash(index, data), index, path, layout.n_chunks) != root:
            return False
    return bool(torch.isfinite(opening.values()).all())


def sample_chunks(seed: bytes, n_chunks: int, fraction: float, minimum: int) -> tuple[int, ...]:
    """The chunks a challenge opens: max(minimum, ⌈fraction·n_chunks⌉) distinct indices (at most all),
    ascending: i_j = uint64_be(sha256(SAMPLE_TAG ‖ seed ‖ uint64_be(j))[:8]) mod n_chunks for j = 0, 1, …,
    skipping repeats (when more than half are wanted, the ones left out are drawn so). A pure function
    of public inputs (the seed is the round's commit–reveal seed with whatever the caller binds to it,
    e.g. the host), drawn in O(count) hashes: a server answers it for any host on request, so it must
    not cost a pass over every chunk of a large model. (The modulo's bias is below n_chunks / 2⁶⁴.)"""
    if n_chunks < 1 or minimum < 1 or not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"sample_chunks: need n_chunks >= 1, minimum >= 1 and fraction in (0, 1], got "
            f"{n_chunks}, {minimum}, {fraction}"
        )
    count = min(n_chunks, max(minimum, math.ceil(fraction * n_chunks)))
    if 2 * count > n_chunks:
        return tuple(sorted(set(range(n_chunks)) - _draw(seed, n_chunks, n_chunks - count)))
    return tuple(sorted(_draw(seed, n_chunks, count)))


def _draw(seed: bytes, n_chunks: int, count: int) -> set[int]:
    prefix, j = SAMPLE_TAG + seed, 0
    picked: set[int] = set()
    while len(picked) < count:
        picked.add(int.from_bytes(hashlib.sha256(prefix + j.to_bytes(8, "big")).digest()[:8], "big") % n_chunks)
        j += 1
    return picked


def gather_chunks(tensors: Mapping[str, Tensor], layout: ChunkLayout, indices: Sequence[int]) -> Tensor:
    """The elements of `tensors` on chunks `indices`, in that order, as one flat tensor of their dtype
    (a decoded payload, a replay or a bound on the sampled chunks)."""
    parts = []
    for index in indices:
        name, start, end = layout.locate(index)
        parts.append(tensors[name].detach().reshape(-1)[start:end])
    return torch.cat(parts)


def claimed_delta(decoded: Tensor, e_prev: Tensor, e_now: Tensor, decay: float) -> Tensor:
    """Δ̂ = decode(P_r) + e_r − d·e_{r−1} on the opened elements (fp64). d·e_{r−1} is the fp32 product
    `ErrorFeedback` forms, so an honest Δ̂ differs from the host's Δ only by the rounding of its fp32
    sum d·e_{r−1} + Δ (and of e_r = target − decode where that is inexact): ulps of |target|."""
    scaled = e_prev if decay == 1.0 else e_prev * torch.tensor(decay, dtype=torch.float32)
    return decoded.double() + e_now.double() - scaled.double()


def compare(claimed: Tensor, replay: Tensor) -> tuple[float, float]:
    """(cosine, norm ratio |claimed| / |replay|) in fp64, the figures the replay verdict takes; a zero
    vector has cosine 0 (and a zero replay an infinite ratio)."""
    a, b = claimed.double().reshape(-1), replay.double().reshape(-1)
    na, nb = float(a.norm()), float(b.norm())
    cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0
    return cos, na / nb if nb > 0 else math.inf


def payload_misfit(
    codec: TopKCodec, payload: bytes, spec: Spec, layout: ChunkLayout, indices: Sequence[int], opened: Tensor
) -> str | None:
    """Why the `opened` residual (chunks `indices` in order, their values concatenated) cannot be what
    an honest host kept after sending the top-k `payload` (`TopKCodec.residual_misfit`, tensor by
    tensor), or None. Refuses (CodecError) a payload that is not `codec`'s for `spec`; only the tensors
    the sample touches are read. The layout's chunks must be whole codec chunks (`commitment_layout`)."""
    if payload[:HEADER_SIZE] != codec.header(spec):  # the header is a function of the codec and spec
        raise HeaderError(f"payload_misfit: the header is not {codec.name}{codec.params()}'s for this spec")
    if len(payload) != codec.encoded_size(spec):
        raise PayloadSizeError(f"payload_misfit: {len(payload)} bytes, expected {codec.encoded_size(spec)}")
    if layout.chunk % codec.chunk:
        raise ValueError(f"payload_misfit: commitment chunks of {layout.chunk} are not whole codec chunks of {codec.chunk}")
    offsets, at = {}, HEADER_SIZE
    for name in sorted(spec):
        size = codec.encoded_size({name: spec[name]}) - HEADER_SIZE
        offsets[name], at = (at, at + size), at + size
    spans: dict[str, list[tuple[int, int]]] = {}
    values: dict[str, list[Tensor]] = {}
    at = 0
    for index in indices:  # a tensor's opened chunks, with their values, in the sample's order
        name, start, end = layout.locate(index)
        spans.setdefault(name, []).append((start, end))
        values.setdefault(name, []).append(opened[at : at + end - start])
        at += end - start
    for name, ranges in spans.items():
        first, last = offsets[name]
        why = codec.residual_misfit(memoryview(payload)[first:last], tuple(spec[name]), name, ranges,
                                    torch.cat(values[name]))
        if why is not None:
            return why
    return None


def commitment_layout(spec: Spec, codec: object) -> ChunkLayout:
    """The layout a host commits its residual in under `codec`: chunks of DEFAULT_CHUNK elements, rounded
    up to a whole number of a top-k codec's chunks, so that an opened chunk holds each of its codec
    chunks whole and the payload's selection and scales can be checked against it (`payload_misfit`)."""
    step = codec.chunk if isinstance(codec, TopKCodec) else 1
    return ChunkLayout.of(spec, step * math.ceil(DEFAULT_CHUNK / step))
