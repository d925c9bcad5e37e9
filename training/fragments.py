"""A model's tensors cut into fragments balanced by size: a pure function of the spec and the count.

Two users cut by the same plan: sharded aggregators (gonka_node/core/fragments.py, one fragment a shard,
the round's hash a Merkle root over fragment hashes) and streamed epochs (training/streaming.py, one
fragment synced a round). No torch here: the plan is computed where only the spec is known.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

Spec = Mapping[str, tuple[int, ...]]


class FragmentError(ValueError):
    """A plan or proof that cannot be: bad shard count, index or proof shape."""


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]  # sorted
    numel: int

    def spec(self, spec: Spec) -> dict[str, tuple[int, ...]]:
        return {name: tuple(spec[name]) for name in self.names}


def plan_fragments(spec: Spec, count: int, what: str = "shards") -> list[Fragment]:
    """Tensors in descending size (ties by name), each to the fragment with the fewest elements so far
    (ties: lowest index): the largest fragment exceeds the mean by at most one tensor. `what` names the
    count in the error (the recipe field that asked for it)."""
    if not 1 <= count <= len(spec):
        raise FragmentError(f"{what} must be between 1 and the model's {len(spec)} tensors, got {count}")
    sizes = {name: math.prod(shape) for name, shape in spec.items()}
    loads = [(0, i) for i in range(count)]  # (elements, index): a heap
    members: list[list[str]] = [[] for _ in range(count)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, i = heapq.heappop(loads)
        members[i].append(name)
        heapq.heappush(loads, (load + sizes[name], i))
    return [Fragment(i, tuple(sorted(m)), sum(sizes[n] for n in m)) for i, m in enumerate(members)]
