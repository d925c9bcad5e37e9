"""The devnet once against anvil (`gonka-node devnet --rpc-url URL`): the same processes and checks as
the embedded-chain devnet, on a real external JSON-RPC node (EIP-1559 fees, chain-id checks, its own
clock moved by evm_increaseTime). 2 hosts × 2 rounds of the tiny preset: loss falls, every pulled
checkpoint matches the hash on chain, and claimed GNK equals each host's Merkle reward.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from chain.anvil import AnvilNode
from chain.errors import ChainError
from gonka_node.cli import main
from gonka_node.devnet_chain import start_chain

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def anvil() -> Iterator[str]:
    # Same rule as tests/chain/conftest.py: skipped without anvil locally, a failure in CI.
    binary = "anvil" if AnvilNode.available() else str(REPO / "node_modules" / ".bin" / "anvil")
    if not AnvilNode.available(binary):
        if os.environ.get("CI"):
            pytest.fail("anvil is not installed but CI is set: the devnet must run on anvil in CI")
        pytest.skip("anvil not installed (npm install puts it in node_modules/.bin)")
    with AnvilNode(binary) as node:
        assert node.url is not None
        yield node.url


@pytest.mark.slow
@pytest.mark.multiprocess
def test_devnet_on_anvil_runs_an_epoch_and_pays_by_proof(tmp_path: Path, anvil: str) -> None:
    out = tmp_path / "devnet"
    rc = main(["devnet", "--rpc-url", anvil, "--out", str(out), "--hosts", "2", "--rounds", "2",
               "--inner-steps", "8", "--preset", "tiny", "--timeout", "400"])
    assert rc == 0
    deployment = json.loads((out / "deployment.json").read_text())
    assert deployment["chain_id"] == 31337  # anvil's, not the embedded chain's
    for i in (1, 2):
        assert re.search(rf'rpc_url = "{re.escape(anvil)}"', (out / f"host{i}.toml").read_text())
    report = json.loads((out / "report.json").read_text())
    assert report["rounds"] == 2 and len(set(report["checkpoint_hashes"])) == 3
    assert report["losses"][-1] < report["losses"][0] - 0.1
    assert len(report["rewards"]) == 2
    for r in report["rewards"].values():
        assert r["earned_ngonka"] > 0
        assert r["claimed_ngonka"] == r["earned_ngonka"]


def test_devnet_refuses_an_unreachable_chain_url() -> None:
    with pytest.raises(ChainError, match=re.escape("no JSON-RPC node answers at http://127.0.0.1:9")):
        start_chain("http://127.0.0.1:9")  # the discard port: nothing answers JSON-RPC there
