"""Fixtures of the aggregator tests; the harness itself lives in agg_harness.py (importable by tests),
the server-less engine of the fast unit tests in engine_kit.py."""

from agg_harness import chain_world, harness, windows
from engine_kit import kit

__all__ = ["chain_world", "harness", "kit", "windows"]
