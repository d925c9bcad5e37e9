"""Fixtures of the model server's tests; the world itself is in serve_world.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from serve_world import ServeWorld, build_world, serve

from gonka_node.serve.server import ModelServerHandle


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """The tiny model runs faster on one thread (engine threads read the same setting), and the test
    machines are shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeWorld]:
    world = build_world(tmp_path_factory.mktemp("serve-world"))
    yield world
    world.close()


@pytest.fixture(scope="module")
def server(world: ServeWorld, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerHandle]:
    """Serves round 2 (not following: the module's tests expect a fixed round)."""
    handle = serve(world, tmp_path_factory.mktemp("serve-cache"), round_="2")
    yield handle
    handle.stop()
