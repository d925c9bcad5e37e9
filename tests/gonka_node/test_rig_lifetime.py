"""A rig's processes end with their rig, and a hung rig fails its round instead of the host waiting forever.

torchrun's agent starts every rig process in a session of its own, so they once outlived the agent and
the daemon (found orphaned, blocked in a rendezvous, 20 minutes after a test). `follow_daemon` ties a
rig process to both; `RigRounds` stops a rig that takes no step for `stall_s` while up, or that takes
longer than `start_s` to start or restart.
"""

from __future__ import annotations

import os
import re
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
from gonka_node.host.rig_process import follow_daemon
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


def fake_rig(rig: RigRounds, mailbox: Mailbox, body: str) -> None:
    """Stand in for `rig`'s torchrun job: a process in a session of its own (as the real agent is
    started) running `body`, with `root` (the mailbox folder), `announce()` (every rank announces this
    process, as the rig's processes do once they wait for orders), `step(n)` (a progress line) and
    `report(steps)` (round 1's payload and report) at hand."""
    script = f"""
import json, time
from pathlib import Path
from training.rig_service import Mailbox
root = Path({str(mailbox.root)!r}); root.mkdir(parents=True, exist_ok=True)
def announce():
    for rank in range({rig.options.procs}):
        Mailbox(root).announce(rank)
def step(n):
    with (root / "progress-1.jsonl").open("a") as f:
        f.write(json.dumps({{"step": n, "loss": 1.0}}) + "\\n")
def report(steps):
    (root / "payload-1.bin").write_bytes(b"p")
    report = dict(seq=1, round=1, base=0, delta_norm=1.0, mean_loss=1.0, last_loss=1.0, tokens=steps,
                  seconds=1.0, round_s=1.0, ranks=[])
    (root / "report-1.json.tmp").write_text(json.dumps(report))
    (root / "report-1.json.tmp").rename(root / "report-1.json")
""" + body
    rig.proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    rig.mailbox = mailbox


def test_a_rig_that_takes_no_step_fails_the_round_and_is_stopped(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path)
    rig = RigRounds(RigOptions(2, stall_s=0.5), recipe, Assignment(recipe.epoch_seed, 0, 2), None, tmp_path / "rig")
    fake_rig(rig, Mailbox(tmp_path / "mailbox"), "announce(); time.sleep(120)")  # up, then never answers
    hung = rig.proc
    assert hung is not None and rig.mailbox is not None
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
    # The limit well above the steps' spacing (a loaded machine delays a step by a second or more).
    rig = RigRounds(RigOptions(2, stall_s=2.0), recipe, Assignment(recipe.epoch_seed, 0, 2), None, tmp_path / "rig")
    # A "rig" that logs a step every 0.4 s for 6 s, then reports round 1.
    fake_rig(rig, Mailbox(tmp_path / "mailbox"), """
announce()
for n in range(1, 16):
    time.sleep(0.4); step(n)
report(15); time.sleep(120)
""")
    try:
        seen: list[int] = []
        result = rig.train_round(1, {}, lambda: tmp_path / "global.safetensors", lambda s, loss: seen.append(s))
        assert seen == list(range(1, 16)) and result.payload == b"p" and result.tokens == 15
    finally:
        rig.close(timeout_s=0.0)


def test_a_rig_slower_to_start_and_to_restart_than_its_stall_limit_trains_its_round(tmp_path: Path) -> None:
    """The stall clock runs while the rig is up: its first start and a restart after a process died
    (the model rebuilt: minutes on a large one) count against `start_s`, not `stall_s`. A restart shows
    as an announced pid gone, or as the ranks' restart counts differing (a dead rank's pid not reaped
    yet, or reused, still looks alive)."""
    recipe = tiny_recipe(tmp_path)
    rig = RigRounds(RigOptions(2, stall_s=1.5, start_s=30.0), recipe, Assignment(recipe.epoch_seed, 0, 2), None,
                    tmp_path / "rig")
    # 2 s to start; a step; rank 1 dies (its announced pid is gone); 2 s to restart; a step; the agent's
    # restart 1: rank 0 announces, rank 1's entry (restart 0) names a live pid for 2 s more; two steps.
    fake_rig(rig, Mailbox(tmp_path / "mailbox"), """
import os, subprocess
time.sleep(2.0); announce(); step(1)
dead = subprocess.Popen(["true"]); dead.wait()
(root / "rank-1.tmp").write_text(json.dumps({"pid": dead.pid, "restart": 0}))  # atomic, as announce() is
(root / "rank-1.tmp").rename(root / "rank-1.json")
time.sleep(2.0); announce(); step(2)
os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"; Mailbox(root).announce(0)
time.sleep(2.0); Mailbox(root).announce(1); step(3); time.sleep(0.2); step(4); report(4); time.sleep(120)
""")
    try:
        seen: list[int] = []
        started = time.monotonic()
        result = rig.train_round(1, {}, lambda: tmp_path / "global.safetensors", lambda s, loss: seen.append(s))
        assert seen == [1, 2, 3, 4] and result.payload == b"p" and result.tokens == 4
        assert time.monotonic() - started > 6.0  # the three 2 s waits were sat out, each above the stall limit
    finally:
        rig.close(timeout_s=0.0)


def test_a_rig_that_never_starts_fails_the_round_after_its_start_limit_and_is_stopped(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path)
    rig = RigRounds(RigOptions(2, stall_s=0.2, start_s=1.0), recipe, Assignment(recipe.epoch_seed, 0, 2), None,
                    tmp_path / "rig")
    fake_rig(rig, Mailbox(tmp_path / "mailbox"), "Mailbox(root).announce(0); time.sleep(120)")  # rank 1 never up
    hung = rig.proc
    assert hung is not None
    started = time.monotonic()
    with pytest.raises(RigError, match=r"round 1: the rig did not start within 1 s, so it was stopped "
                                       r"\(raise --rig-start-s if building its model and loading its data"):
        rig.train_round(1, {}, lambda: tmp_path / "global.safetensors", lambda s, loss: None)
    assert 1.0 < time.monotonic() - started < 30
    assert hung.returncode == -signal.SIGKILL and rig.proc is None


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
@pytest.mark.parametrize(("flag", "field", "says"), [
    ("--rig-stall-s", "stall_s", "give the seconds a round may go without a step (> 0)"),
    ("--rig-start-s", "start_s", "give the seconds the rig may take to start (> 0)"),
])
def test_run_refuses_a_rig_limit_that_is_not_positive_before_reading_its_config(
    value: str, flag: str, field: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--config", str(tmp_path / "absent.toml"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {float(value)}: {says}" in err
    assert "absent.toml" not in err and "Traceback" not in err
    with pytest.raises(RigError, match=f"{flag} {float(value)}: {re.escape(says)}"):
        RigOptions(2, **{field: float(value)})
