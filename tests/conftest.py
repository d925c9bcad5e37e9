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


S3_TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-speaking HTTP server (moto's server mode) on 127.0.0.1, bound to a port the OS picks,
    with throwaway credentials in the environment (boto3 reads them from there, as in production)."""
    import os

    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in S3_TEST_ENV}
    os.environ.update(S3_TEST_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the test server; returns its name."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.session.Session().client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow tests first, the end-to-end ones (tests/integration) before the rest. Under
    pytest-xdist (scripts/test.sh) this orders the files that have as many tests as each other (xdist
    hands out the files with the most tests first), so the two-minute single test of test_roles_cli
    starts first of the one-test files, which come last. Stable: each file keeps its own order."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slow, "integration" not in item.path.parts))
