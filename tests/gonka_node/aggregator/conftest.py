"""Fixtures of the aggregator tests; the harness itself lives in agg_harness.py (importable by tests)."""

from agg_harness import chain_world, harness, windows

__all__ = ["chain_world", "harness", "windows"]
