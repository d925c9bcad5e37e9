"""A rig's processes end with their rig, and a hung rig fails its round instead of the host waiting forever.

torchrun's agent starts every rig process in a session of its own, so they once outlived the agent and
the daemon (found orphaned, blocked in a rendezvous, 20 minutes after a test). `follow_daemon` ties a
rig process to both; `RigRounds` stops a rig that takes no step for `stall_s`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_host_rig import alive, tiny_recipe, wait_gone

from gonka_node.cli import main
from gonka_node.host.rig_round import RigError, RigOptions, RigRounds
from training.rig_service import Mailbox
from training.worker import Assignment

# A stand-in for torchrun's agent: starts one "rig process" in a session of its own (as the agent
# does), prints its pid, then waits. The rig process ties itself to the agent and to DAEMON, then
# waits as a process blocked in a rendezvous would.
AGENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""
RIG_PROCESS = """
import sys, time
from gonka_node.host.rig_round import follow_daemon
follow_daemon({daemon}, poll_s=0.1)  # armed once it returns
print("following", flush=True)
time.sleep(120)
"""


@contextmanager
def daemon_agent_and_rig_process() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[str], int]]:
    """A stand-in daemon, an agent, and the rig process the agent started (its death signal armed);
    whatever is left of them is killed afterwards."""
    daemon = subprocess.Popen(["sleep", "120"])
    agent = subprocess.Popen([sys.executable, "-c", AGENT, RIG_PROCESS.format(daemon=daemon.pid)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    assert agent.stdout is not None
    child = int(agent.stdout.readline())
    try:
        assert agent.stdout.readline() == "following\n"  # the rig process inherits the agent's stdout
        yield daemon, agent, child
    finally:
        for proc in (agent, daemon):
            proc.kill()
            proc.wait()
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rig_process_dies_with_its_agent_though_it_runs_in_a_session_of_its_own() -> None:
    with daemon_agent_and_rig_process() as (daemon, agent, child):
        assert alive(child) and os.getsid(child) == child  # its own session: killpg(agent) misses it
        agent.kill()
        agent.wait()
        assert wait_gone(child), "the rig process outlived its agent"
        assert daemon.poll() is None  # the daemon is not the rig's to stop


def test_a_rig_process_stops_its_agent_and_itself_when_the_daemon_is_gone() -> None:
    with daemon_agent_and_rig_process() as (daemon, agent, child):
        assert alive(child)
        daemon.kill()
        daemon.wait()
        assert agent.wait(timeout=20) == -signal.SIGTERM  # the agent is told to stop (it restarts nothing)
        assert wait_gone(child)


def test_a_rig_that_takes_no_step_fails_the_round_and_is_stopped(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path)
    rig = RigRounds(RigOptions(2, stall_s=0.5), recipe, Assignment(recipe.epoch_seed, 0, 2), None, tmp_path / "rig")
    # A rig that never answers: a process in a session of its own, as the real agent is started.
    rig.proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    rig.mailbox = Mailbox(tmp_path / "mailbox")
    hung = rig.proc
    started = time.monotonic()
    with pytest.raises(RigError, match=r"round 1: the rig took no step for 0 s, so it was stopped .*--rig-stall-s"):
        rig.train_round(1, {}, lambda: tmp_path / "global.safetensors", lambda s, loss: None)
    assert time.monotonic() - started < 30
    assert hung.returncode == -signal.SIGKILL and rig.proc is None
    order = rig.mailbox.order()
    assert order is not None and order.stop  # the stop order, then the kill


def test_a_rig_that_steps_is_not_stalled_by_a_long_round(tmp_path: Path) -> None:
    """The stall limit bounds the time between steps, not the round: steps keep a slow round alive."""
    recipe = tiny_recipe(tmp_path)
    rig = RigRounds(RigOptions(2, stall_s=1.0), recipe, Assignment(recipe.epoch_seed, 0, 2), None, tmp_path / "rig")
    mailbox = Mailbox(tmp_path / "mailbox")
    # A "rig" that logs a step every 0.4 s for 3 s, then reports round 1.
    script = f"""
import json, time
from pathlib import Path
root = Path({str(mailbox.root)!r}); root.mkdir(parents=True, exist_ok=True)
with (root / "progress-1.jsonl").open("w") as f:
    for step in range(1, 8):
        time.sleep(0.4); f.write(json.dumps({{"step": step, "loss": 1.0}}) + "\\n"); f.flush()
(root / "payload-1.bin").write_bytes(b"p")
report = dict(seq=1, round=1, base=0, delta_norm=1.0, mean_loss=1.0, last_loss=1.0, tokens=7, seconds=2.8,
              round_s=2.9, ranks=[])
(root / "report-1.json.tmp").write_text(json.dumps(report)); (root / "report-1.json.tmp").rename(root / "report-1.json")
time.sleep(120)
"""
    rig.proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    rig.mailbox = mailbox
    try:
        seen: list[int] = []
        result = rig.train_round(1, {}, lambda: tmp_path / "global.safetensors", lambda s, loss: seen.append(s))
        assert seen == list(range(1, 8)) and result.payload == b"p" and result.tokens == 7
    finally:
        rig.close(timeout_s=0.0)


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_run_refuses_a_stall_limit_that_is_not_positive_before_reading_its_config(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--config", str(tmp_path / "absent.toml"), "--rig-stall-s", value]) == 2
    err = capsys.readouterr().err
    assert f"--rig-stall-s {float(value)}: give the seconds a round may go without a step (> 0)" in err
    assert "absent.toml" not in err and "Traceback" not in err
    with pytest.raises(RigError, match="--rig-stall-s"):
        RigOptions(2, stall_s=float(value))
