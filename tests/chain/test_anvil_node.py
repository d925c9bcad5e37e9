"""`AnvilNode`'s process lifetime, on a stand-in binary (a real subprocess that speaks anvil's start-up
line): stopping it ends the process, its log thread, and closes the pipe (no file left to the GC)."""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path

import pytest

from chain.anvil import AnvilNode
from chain.errors import ChainError

STAND_IN = """#!/bin/sh
echo "Listening on 127.0.0.1:8545"
exec sleep 60
"""


def stand_in(tmp_path: Path, script: str = STAND_IN) -> str:
    path = tmp_path / "anvil"
    path.write_text(script)
    path.chmod(0o755)
    return str(path)


def test_stopping_ends_the_process_and_its_log_thread_and_closes_the_pipe(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        node = AnvilNode(binary=stand_in(tmp_path))
        assert node.start() == "http://127.0.0.1:8545"
        proc, drainer = node._proc, node._drainer
        assert proc is not None and proc.stdout is not None and drainer is not None
        node.stop()
        gc.collect()  # an unclosed pipe would warn here, an error in this block
    assert proc.returncode is not None and proc.stdout.closed and not drainer.is_alive()
    node.stop()  # a second stop is a no-op


def test_a_node_that_never_reports_its_port_is_stopped_and_says_so(tmp_path: Path) -> None:
    node = AnvilNode(binary=stand_in(tmp_path, "#!/bin/sh\necho starting\nexit 3\n"))
    with pytest.raises(ChainError, match="anvil did not report its port:\nstarting"):
        node.start()
    assert node._proc is None


def test_stopping_a_wrapper_also_stops_what_it_started(tmp_path: Path) -> None:
    """npm's `anvil` is a wrapper that starts the real binary, which shares the pipe: the whole process
    group is stopped, so the pipe ends and nothing is left running (before, the child kept the pipe)."""
    node = AnvilNode(binary=stand_in(tmp_path, '#!/bin/sh\necho "Listening on 127.0.0.1:8545"\nsleep 60 &\nwait\n'))
    node.start()
    proc = node._proc
    assert proc is not None and proc.stdout is not None
    started = time.monotonic()
    node.stop()
    # Closed only once the drainer read the pipe's end: every writer, the child too, has exited.
    assert time.monotonic() - started < 5 and proc.stdout.closed
