"""One pool of threads for the CPU work a host does on whole models (the outer step's exact fma, the
residual commitment's hashes): torch and hashlib release the GIL inside each operation, so slices of
one tensor run on every core torch is allowed (`torch.get_num_threads()`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


@functools.cache
def cpu_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="cpu-pool")


# A forked child (a bench's worker process, a rig's) has none of the parent's pool threads: a pool
# inherited from the parent would take its work and never run it.
os.register_at_fork(after_in_child=cpu_pool.cache_clear)


def workers_for(n: int, grain: int) -> int:
    """How many of the pool's threads `n` items are worth, at least `grain` items each (at least 1)."""
    return max(1, min(torch.get_num_threads(), -(-n // grain)))


def map_parts(run: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """`run` over `parts` in order, on the pool when there are several (tasks must not wait on the pool)."""
    if len(parts) <= 1:
        return [run(p) for p in parts]
    return list(cpu_pool().map(run, parts))
