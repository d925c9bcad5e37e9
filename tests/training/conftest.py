from collections.abc import Iterator

import pytest
import torch

from training.data import TokenCorpus, Windows, builtin_corpus_files


@pytest.fixture(scope="session")
def small_corpus() -> TokenCorpus:
    """~100 kB of real Python source: enough for a tiny model to learn something in a few steps."""
    return TokenCorpus.from_files(builtin_corpus_files(max_bytes=200_000))


@pytest.fixture(scope="session")
def small_windows(small_corpus: TokenCorpus) -> Windows:
    return small_corpus.windows(seq_len=32, heldout_fraction=0.05)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster single-threaded, and the test machines are shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
