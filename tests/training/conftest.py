
import pytest

from training.data import TokenCorpus, Windows, builtin_corpus_files


@pytest.fixture(scope="session")
def small_corpus() -> TokenCorpus:
    """~100 kB of real Python source: enough for a tiny model to learn something in a few steps."""
    return TokenCorpus.from_files(builtin_corpus_files(max_bytes=200_000))


@pytest.fixture(scope="session")
def small_windows(small_corpus: TokenCorpus) -> Windows:
    return small_corpus.windows(seq_len=32, heldout_fraction=0.05)
