"""Fixtures every test folder shares."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster single-threaded, and the test machines are shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--explorer-screenshot", metavar="PNG", default=None,
        help="also write the explorer browser test's screenshot of the epoch page here (docs/explorer-epoch.png)",
    )
