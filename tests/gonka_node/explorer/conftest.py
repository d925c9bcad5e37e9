"""Fixtures of the explorer's tests over the small epoch of `explorer_chain`: the chain once per module,
and each test on a snapshot of it, reverted after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from explorer_chain import Net, deploy


@pytest.fixture(scope="module")
def net() -> Net:
    return deploy()


@pytest.fixture
def fresh(net: Net) -> Iterator[Net]:
    snapshot = net.backend.snapshot()
    yield net
    net.backend.revert(snapshot)
