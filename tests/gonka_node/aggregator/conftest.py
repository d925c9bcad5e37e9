"""Fixtures of the aggregator tests; the harness itself lives in agg_harness.py (importable by tests),
the server-less engine of the fast unit tests in engine_kit.py."""

from agg_harness import chain_world, harness, windows
from engine_kit import kit
from test_shard_net import pair  # two real Shard servers: test_shard_net's and test_shard_audit's

__all__ = ["chain_world", "harness", "kit", "pair", "windows"]
