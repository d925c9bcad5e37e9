"""No verb answers a user's mistake, or a refusal of the chain, with a Python traceback: each is one
line per problem on stderr, naming the fix, exit status 2 (issue "Every role from the command line").

The verbs run in this process (`main`, what the console script calls) against a chain served over
JSON-RPC on 127.0.0.1; one case runs the real `gonka-node` entry point as a subprocess. The mistakes
of a host before it stakes (fresh key, unknown epoch, aggregator down) are in test_cli_host.py and
governance's (voting still open, an empty treasury) in test_cli_gov.py, with the same checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chain.backends import EmbeddedBackend
from chain.server import ChainServer
from gonka_node.cli import main
from gonka_node.core.keys import INTERACTIVE_KDF, init_keys

GNK = 10**9
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tmp = tmp_path_factory.mktemp("mistakes")
    server = ChainServer(EmbeddedBackend()).start()
    assert main(["chain", "deploy", "--rpc-url", server.url, "--governor", "--mint-dev", "10",
                 "--deployment", str(tmp / "deployment.json")]) == 0
    yield tmp
    server.stop()


def one_line_each(err: str) -> list[str]:
    lines = err.splitlines()
    assert lines and all(line.startswith("gonka-node ") and ": error: " in line for line in lines), err
    assert "Traceback" not in err and "File \"" not in err
    return lines


def mistake(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> list[str]:
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    lines = one_line_each(captured.err)
    for fragment in fragments:
        assert fragment in captured.err, (argv, captured.err)
    return lines


def test_chain_and_file_mistakes_are_one_line(served: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dep = ["--deployment", str(served / "deployment.json")]
    # The chain is not there (a devnet that ended, a wrong URL).
    mistake(capsys, ["chain", "status", *dep, "--rpc-url", CLOSED], f"no JSON-RPC node answers at {CLOSED}")
    mistake(capsys, ["checkpoint", "list", *dep, "--rpc-url", CLOSED], "no JSON-RPC node answers")
    # No deployment file where one is needed.
    mistake(capsys, ["gov", "proposals", "--deployment", str(tmp_path / "none.json")],
            "none.json: no such deployment file (run `gonka-node chain deploy`)")
    # A proposal that does not exist, a vote without escrow (the contract's reason, in one line).
    mistake(capsys, ["gov", "execute", "--proposal", "7", *dep], "no proposal 7 on this Governor")
    mistake(capsys, ["gov", "create-epoch", "--spec", str(tmp_path / "none.toml"), *dep], "none.toml", "no such file")
    assert main(["gov", "treasury-deposit", "--amount", "1", *dep]) == 0
    mistake(capsys, ["gov", "vote", "--proposal", "1", "--support", "yes", *dep, "--dev-account", "5"],
            "the chain refused the transaction: governor: unknown proposal")
    # An unknown epoch on a client verb.
    mistake(capsys, ["checkpoint", "pull", "--epoch", "3", "--round", "latest", *dep], "--epoch 3: no such epoch")
    mistake(capsys, ["challenge", "list", "--epoch", "3", *dep, "--rpc-url", CLOSED], "no JSON-RPC node answers")


def test_key_mistakes_are_one_line(served: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dep = ["--deployment", str(served / "deployment.json")]
    init_keys(tmp_path / "keys", "right passphrase", kdf=INTERACTIVE_KDF)
    wrong = tmp_path / "wrong.pass"
    wrong.write_text("wrong passphrase\n")
    os.chmod(wrong, 0o600)
    mistake(capsys, ["keys", "show", "--key-dir", str(tmp_path / "keys"), "--passphrase-file", str(wrong)],
            "passphrase")
    os.chmod(wrong, 0o644)
    mistake(capsys, ["keys", "show", "--key-dir", str(tmp_path / "keys"), "--passphrase-file", str(wrong)],
            "chmod 600")
    # A fresh account's key in a file: it has nothing to send, nor the ETH to pay for sending.
    fresh = tmp_path / "fresh.key"
    fresh.write_text("ab" * 32)
    os.chmod(fresh, 0o600)
    to = "0x" + "11" * 20
    mistake(capsys, ["transfer", "--to", to, "--gnk", "1", "--key-file", str(fresh), *dep], "holds 0 GNK, less than 1 GNK")
    mistake(capsys, ["transfer", "--to", to, "--eth", "1", "--key-file", str(fresh), *dep],
            "too little ETH for gas", "gonka-node transfer --to ADDRESS --eth 1")
    mistake(capsys, ["transfer", "--to", "0x12", "--gnk", "1", *dep], "--to '0x12': not an EVM address")


def test_the_installed_entry_point_prints_one_line_too(served: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gonka_node", "chain", "status", "--deployment", str(served / "deployment.json"),
         "--rpc-url", CLOSED], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line_each(proc.stderr) == [f"gonka-node chain status: error: no JSON-RPC node answers at {CLOSED}"]
    debug = subprocess.run(
        [sys.executable, "-m", "gonka_node", "--debug", "chain", "status", "--deployment",
         str(served / "deployment.json"), "--rpc-url", CLOSED], capture_output=True, text=True, timeout=120,
    )
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr  # --debug: the traceback
