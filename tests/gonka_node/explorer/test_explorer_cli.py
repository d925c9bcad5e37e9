"""`gonka-node explorer`: a real process against the embedded chain served on loopback prints its URL
once it answers and stops on SIGTERM; user mistakes get one line and exit status 2."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from chain.client import ChainClient
from gonka_node.cli import main
from gonka_node.devnet_chain import start_chain


def test_the_explorer_process_serves_the_chain_and_stops_on_sigterm(tmp_path: Path) -> None:
    chain = start_chain()
    try:
        deployment = ChainClient(chain.backend, chain.backend.dev_accounts()[0]).connect().deploy_all()
        deployment.extra["rpc_url"] = chain.url
        deployment.save(tmp_path / "deployment.json")
        log = tmp_path / "explorer.log"
        with open(log, "w") as sink, subprocess.Popen(
            [sys.executable, "-m", "gonka_node", "explorer", "--deployment", str(tmp_path / "deployment.json"),
             "--port", "0"], stdout=subprocess.PIPE, stderr=sink, text=True,
        ) as proc:
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line.startswith("explorer: http://127.0.0.1:"), log.read_text()
                url = line.split()[1]
                with urllib.request.urlopen(url + "api/status", timeout=10) as r:
                    status = json.loads(r.read())
                assert (status["chain_id"], status["registry"]) == (deployment.chain_id, deployment.registry)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        chain.stop()
    assert (tmp_path / "explorer.sqlite3").exists()  # the default index sits beside the deployment file


def test_mistakes_get_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explorer", "--deployment", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err == (
        f"gonka-node explorer: error: {tmp_path / 'missing.json'}: no such deployment file (run `gonka-node chain deploy`)\n"
    )
    assert main(["explorer", "--aggregator", "nowhere"]) == 2
    assert capsys.readouterr().err == "gonka-node explorer: error: --aggregator 'nowhere': give HOST:PORT\n"
    assert main(["explorer", "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err


def test_a_port_in_use_is_refused_with_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain = start_chain()
    try:
        deployment = ChainClient(chain.backend, chain.backend.dev_accounts()[0]).connect().deploy_all()
        deployment.save(tmp_path / "deployment.json")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            rc = main(["explorer", "--deployment", str(tmp_path / "deployment.json"), "--rpc", chain.url,
                       "--port", str(port)])
    finally:
        chain.stop()
    assert rc == 2
    assert capsys.readouterr().err == (
        f"gonka-node explorer: error: the explorer cannot listen on 127.0.0.1:{port} (in use, or not an address "
        "of this machine): pick another --port or --host\n"
    )
