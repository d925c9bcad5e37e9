"""Test and benchmark machinery built on the real roles, never imported by them: the adversary kit
(`adversary`, `adversary_open`, `adversary_tap`, `adversary_view`: hosts and strangers that attack the
real aggregator and chain) and the Byzantine runner (`byzantine`: one epoch in one process with a
driven aggregator clock, for tests and scripts/bench_byzantine.py)."""
