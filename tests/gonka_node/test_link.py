"""The shaped link: token-bucket arithmetic on a held clock, the DOWN/UP text, and `run --link` refusing
a malformed value before it reads anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from gonka_node.cli import main
from gonka_node.core.link import MBIT, LinkError, LinkSpec, TokenBucket


def test_a_bucket_paces_bytes_at_its_rate_after_the_latency() -> None:
    bucket = TokenBucket(1000.0, burst=0.0, latency_s=0.5)
    assert bucket.reserve(1000, 0.0, first=True) == 1.5  # 0.5 s latency, then 1 s of bytes
    assert bucket.reserve(500, 0.0) == 2.0  # queued behind the first transfer, as on one wire
    assert bucket.reserve(100, 10.0, first=True) == pytest.approx(10.6)  # an idle link starts fresh


def test_a_burst_lets_the_last_bytes_leave_early() -> None:
    bucket = TokenBucket(1000.0, burst=10.0)
    assert bucket.reserve(1000, 0.0) == pytest.approx(0.99)
    assert bucket.reserve(1000, 0.0) == pytest.approx(1.99)


def test_pace_sleeps_on_the_buckets_clock() -> None:
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    link = LinkSpec.parse("8/0.8@20").buckets(clock=lambda: now[0])
    link.up.sleep = sleep
    for _ in range(4):  # 400 kB up at 0.8 Mbit/s (100 kB/s): 4 s plus 20 ms of latency
        link.up.pace(100_000, first=not slept)
    assert now[0] == pytest.approx(4.02 - link.up.burst / link.up.rate)
    assert link.down.rate == 8 * MBIT and link.up.rate == 0.8 * MBIT


@pytest.mark.parametrize("text", ["fast", "100", "100/0", "-1/10", "100/10@x", "100/10@-5"])
def test_a_malformed_link_is_refused(text: str) -> None:
    with pytest.raises(LinkError, match="link"):
        LinkSpec.parse(text)


def test_run_refuses_a_malformed_link_before_reading_its_config(tmp_path: Path, capsys) -> None:
    assert main(["run", "--config", str(tmp_path / "absent.toml"), "--link", "100:10"]) == 2
    err = capsys.readouterr().err
    assert "--link: link '100:10': give DOWN/UP in Mbit/s" in err and "absent.toml" not in err
    assert LinkSpec.parse("100/10@20").text() == "100/10@20"
