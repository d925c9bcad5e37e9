"""Start and stop a local anvil node (Foundry's EVM) on 127.0.0.1 with an OS-chosen port."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque

from chain.errors import ChainError

_LISTENING = re.compile(r"Listening on (\S+):(\d+)")


class AnvilNode:
    def __init__(self, binary: str = "anvil", host: str = "127.0.0.1", extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.host = host
        self.extra_args = extra_args
        self.url: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._tail: deque[str] = deque(maxlen=50)
        self._drainer: threading.Thread | None = None

    @staticmethod
    def available(binary: str = "anvil") -> bool:
        return shutil.which(binary) is not None

    def start(self, timeout_s: float = 30.0) -> str:
        path = shutil.which(self.binary)
        if path is None:
            raise ChainError(f"{self.binary!r} not found on PATH (npm install puts it in node_modules/.bin)")
        # --port 0: the OS picks a free port and anvil prints it; no port is picked, closed and reused.
        self._proc = subprocess.Popen(
            [path, "--host", self.host, "--port", "0", *self.extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # its own process group: npm's wrapper starts the real anvil as a child
        )
        deadline = time.monotonic() + timeout_s
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._tail.append(line)
            match = _LISTENING.search(line)
            if match:
                self.url = f"http://{match.group(1)}:{match.group(2)}"
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop()
            raise ChainError("anvil did not report its port:\n" + "".join(self._tail))
        # Keep draining its output: a full pipe would block anvil.
        self._drainer = threading.Thread(target=self._drain, args=(self._proc,), name="anvil-log", daemon=True)
        self._drainer.start()
        return self.url

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        if proc.stdout is not None:
            for line in proc.stdout:
                self._tail.append(line)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        _signal_group(proc, signal.SIGTERM)  # the wrapper and what it started (which holds the pipe too)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        drainer, self._drainer = self._drainer, None
        if drainer is not None:  # it reads to the pipe's end, which the group's exit brings
            drainer.join(timeout=5)
        # Closing while the drainer still reads would wait for that read (the file's lock): then the pipe
        # is left to the collector rather than hanging the caller.
        if proc.stdout is not None and (drainer is None or not drainer.is_alive()):
            proc.stdout.close()

    def __enter__(self) -> AnvilNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, sig)
