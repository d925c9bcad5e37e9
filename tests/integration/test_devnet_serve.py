"""`gonka-node devnet --serve`: after the epoch the chain (now following the wall clock), the aggregator
and the extra services (the `SERVICES` hook: the explorer, and here a second `gonka-node chain serve`
added as any other service would be) keep running, their addresses printed, so a client lists and
pulls against them; everything stops when asked."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from chain.backends import RpcBackend
from chain.client import ChainClient
from chain.types import Deployment
from gonka_node.cli import main
from gonka_node.devnet import DevnetOptions, run_devnet
from gonka_node.devnet_serve import SERVICES, ExtraService, ServeContext
from training.checkpoint import load_checkpoint


def second_chain(ctx: ServeContext) -> list[str]:
    return ["chain", "serve", "--port", "0", "--url-file", str(ctx.out / "second.url")]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("shards", [1, 2])
def test_devnet_serve_keeps_the_network_up_until_stopped(
    shards: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With 2 shards the served model, the explorer's download and `checkpoint pull` each merge both
    shards' fragments and check them against the chain's Merkle root."""
    out = tmp_path / "devnet"
    extra = ExtraService("second-chain", second_chain, lambda ctx: (ctx.out / "second.url").read_text().strip(),
                         ready=lambda ctx: (ctx.out / "second.url").exists())
    opts = DevnetOptions(out=out, hosts=1, rounds=1, inner_steps=4, preset="tiny", timeout_s=400, serve=True,
                         services=(*SERVICES, extra), shards=shards)
    said: list[str] = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def devnet() -> None:
        try:
            run_devnet(opts, say=said.append, stop=stop)
        except BaseException as exc:  # reported by the test thread below
            failure.append(exc)

    thread = threading.Thread(target=devnet)
    thread.start()
    try:
        deadline = time.monotonic() + 420
        while not any(line.startswith("serving until Ctrl-C") for line in said):
            assert not failure, failure
            assert thread.is_alive() and time.monotonic() < deadline, said
            time.sleep(0.5)
        deployment = Deployment.load(out / "deployment.json")
        url = deployment.extra["rpc_url"]
        assert f"serving until Ctrl-C: chain {url} (deployment {out / 'deployment.json'}, epoch 1)" in said
        aggregator_line = next(line for line in said if line.startswith("aggregator: "))
        second = (out / "second.url").read_text().strip()
        assert f"second-chain: {second}" in said and RpcBackend(second).client_version()
        explorer = next(line for line in said if line.startswith("explorer: ")).split()[1]
        with urllib.request.urlopen(explorer, timeout=30) as page:  # the explorer's front page answers
            assert page.status == 200 and "epoch" in page.read().decode().lower()
        with urllib.request.urlopen(f"{explorer.rstrip('/')}/epochs/1/rounds/1/checkpoint.safetensors", timeout=60) as download:
            streamed = load(download.read())  # the round's whole model, whatever the shards
        model = next(line for line in said if line.startswith("model: ")).split()[1]
        assert model.startswith("http://127.0.0.1:") and model.endswith("/v1")
        with urllib.request.urlopen(f"{model}/models", timeout=30) as models:  # the served, verified model
            assert json.loads(models.read())["data"][0]["id"] == "gonka-epoch-1-round-1"

        # A client after the epoch: list (with where to pull) and pull, the aggregator found on chain.
        capsys.readouterr()
        assert main(["checkpoint", "list", "--deployment", str(out / "deployment.json")]) == 0
        listing = capsys.readouterr().out
        target = aggregator_line.split()[1]
        assert target in listing
        assert main(["checkpoint", "pull", "--deployment", str(out / "deployment.json"), "--epoch", "1",
                     "--round", "latest", "--out", str(tmp_path / "latest.safetensors")]) == 0
        source = f"the epoch's {shards} shards" if shards > 1 else target
        assert f"pulled epoch 1 round 1 from {source}" in capsys.readouterr().out
        pulled = load_checkpoint(tmp_path / "latest.safetensors").tensors
        assert set(streamed) == set(pulled) and all(torch.equal(streamed[n], pulled[n]) for n in pulled)
        # The chain's clock moves on its own now (deadlines pass without transactions).
        reader = ChainClient(RpcBackend(url), RpcBackend(url).dev_accounts()[0], deployment).connect()
        before = reader.chain_time()
        time.sleep(2.2)
        assert reader.chain_time() >= before + 2
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not failure, failure
    assert said[-1] == "stopping the devnet"
    with pytest.raises(Exception):  # noqa: B017 (any connection error: the extra service is gone too)
        RpcBackend(second, timeout_s=2).client_version()
