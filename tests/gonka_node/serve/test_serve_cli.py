"""`gonka-node serve` as a user runs it: a process that prints its URL, answers, and ends on SIGTERM;
mistakes get one line and exit status 2."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from serve_world import ServeWorld

from gonka_node.cli import main


def test_serve_prints_its_url_answers_and_stops_on_sigterm(world: ServeWorld, tmp_path: Path):
    argv = [sys.executable, "-m", "gonka_node", "serve", "--rpc", world.rpc_url, "--deployment",
            str(world.deployment), "--epoch", "1", "--round", "1", "--port", "0", "--cache-dir", str(tmp_path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            lines = []
            while not lines or not lines[-1].startswith("model: "):
                line = process.stdout.readline()  # type: ignore[union-attr]
                assert line, f"the server ended: {process.stderr.read()}"  # type: ignore[union-attr]
                lines.append(line.strip())
            assert lines[0].startswith(f"serving gonka-epoch-1-round-1: checkpoint sha256 {world.shas[1]} verified")
            url = lines[-1].removeprefix("model: ")
            assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
            with urllib.request.urlopen(url + "/models", timeout=30) as response:
                assert [m["id"] for m in json.loads(response.read())["data"]] == ["gonka-epoch-1-round-1"]
                assert response.headers["X-Gonka-Checkpoint-Sha256"] == world.shas[1]
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0
        finally:
            process.kill()
    assert (tmp_path / "epoch-1-round-1.safetensors").is_file()  # the verified file, kept with --cache-dir


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["serve", *argv])
    return code, capsys.readouterr().err


def test_serve_refusals(world: ServeWorld, tmp_path: Path, capsys):
    base = ["--deployment", str(world.deployment), "--epoch", "1", "--port", "0", "--cache-dir", str(tmp_path)]
    code, err = run(capsys, *base, "--round", "9")
    assert code == 2 and "no finalized round 9 yet (latest finalized: 2)" in err and err.count("\n") == 1
    code, err = run(capsys, *base, "--round", "two")
    assert code == 2 and "--round 'two': give a round number or 'latest'" in err
    code, err = run(capsys, *base, "--max-batch", "0")
    assert code == 2 and "max_batch must be >= 1" in err
    code, err = run(capsys, *[a if a != "1" else "7" for a in base])
    assert code == 2 and "--epoch 7: no such epoch" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, err = run(capsys, *[a if a != "0" else port for a in base], "--round", "1")
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1
