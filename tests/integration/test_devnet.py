"""The README's first command, shrunk: `gonka-node devnet` with real processes end to end.

Embedded chain served on loopback, epoch scheduled by a Governor vote, one aggregator and two host
processes, two rounds: loss falls, every pulled checkpoint matches the hash on chain (the devnet checks
this itself and fails otherwise), and each host's claimed GNK equals its reward in the Merkle tree.
With `--replay-fraction 1` the rounds start fresh and the aggregator recomputes every host's round:
host processes must reproduce it exactly to be paid.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

import pytest

from gonka_node.aggregator.store import Store
from gonka_node.cli import main
from gonka_node.core.link import MBIT
from gonka_node.core.recipe import Recipe
from gonka_node.core.tls import load_identity
from gonka_node.devnet_links import unavailable
from gonka_node.host.store import HostStore
from training.codecs import get_codec, spec_of
from training.model import build_model
from training.streaming import StreamSchedule


@pytest.mark.slow
@pytest.mark.multiprocess
def test_devnet_runs_an_epoch_and_pays_by_proof(tmp_path: Path) -> None:
    out = tmp_path / "devnet"
    rc = main(["devnet", "--out", str(out), "--hosts", "2", "--rounds", "2", "--inner-steps", "8",
               "--preset", "tiny", "--timeout", "400", "--replay-fraction", "1"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rounds"] == 2 and len(report["checkpoint_hashes"]) == 3
    assert len(set(report["checkpoint_hashes"])) == 3  # each round moved the model
    assert report["losses"][-1] < report["losses"][0] - 0.1
    assert len(report["rewards"]) == 2
    for host, r in report["rewards"].items():
        assert r["earned_ngonka"] > 0
        assert r["claimed_ngonka"] == r["earned_ngonka"]  # claimed by Merkle proof, read back on chain
        assert report["bytes_per_host"][host] > 0
    assert report["allreduce_bytes_per_host"] > 10 * max(report["bytes_per_host"].values())
    assert (out / "loss.png").stat().st_size > 1000
    assert json.loads((out / "recipe.json").read_text())["round_state"] == "fresh"
    store = Store(out / "aggregator").open()
    try:
        for round_ in (1, 2):
            for c in store.contributions(report["epoch"], round_):
                # int8 rounding and error feedback are all that separate a host's upload from the replay
                why = c.reasons[0]
                assert why.startswith("replay: cosine") and "with the replay of slot" in why, c.reasons
                cos, ratio = float(why.split("cosine ")[1].split(",")[0]), float(why.split("ratio ")[1].split()[0])
                assert cos >= 0.9999 and abs(ratio - 1.0) <= 0.0002, why
    finally:
        store.close()
    # Nothing left running: the devnet stopped its children (their logs are complete).
    agg_log = (out / "logs" / "aggregator.log").read_text()
    assert "aggregator serving epoch" in agg_log
    # Served over TLS with the identity it made: the log names the certificate, never the key.
    tls = out / "aggregator" / "tls"
    assert f"TLS certificate sha256 {load_identity(tls).sha256.hex()} ({tls / 'cert.pem'})" in agg_log
    # ... and announced it on chain, with its endpoint, and published the recipe there.
    assert "announced 127.0.0.1:" in agg_log and "published epoch 1's recipe on chain" in agg_log
    assert stat.S_IMODE((tls / "key.pem").stat().st_mode) == 0o600 and "PRIVATE KEY" not in agg_log
    assert 'tls_cert = "aggregator/tls/cert.pem"' in (out / "host1.toml").read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_devnet_with_shaped_links_eager_overlap_and_compressed_download_reports_utilisation(tmp_path: Path) -> None:
    out = tmp_path / "devnet"
    rc = main(["devnet", "--out", str(out), "--hosts", "2", "--rounds", "3", "--inner-steps", "8",
               "--preset", "tiny", "--timeout", "400", "--replay-fraction", "1", "--link", "100/10",
               "--overlap", "eager", "--broadcast", "codec"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert json.loads((out / "recipe.json").read_text())["overlap"] == "eager"
    assert report["link"] == "100/10" and report["overlap"] == "eager" and report["broadcast"] == "codec"
    assert len(set(report["checkpoint_hashes"])) == 4  # the devnet pulled and checked each against the chain
    for host, r in report["rewards"].items():
        assert r["claimed_ngonka"] == r["earned_ngonka"] > 0
        # int8 downloads: each round's update is about as large as an upload, not 4 bytes a parameter
        assert 0 < report["download_bytes_per_host"][host] <= report["bytes_per_host"][host] * 1.01
        per_round = report["utilisation"][host]
        assert set(per_round) == {"1", "2", "3", "all"} and all(0 < u <= 1 for u in per_round.values())
    store = Store(out / "aggregator").open()
    try:
        for round_ in (1, 2, 3):
            reasons = [c.reasons[0] for c in store.contributions(report["epoch"], round_)]
            assert len(reasons) == 2 and all(why.startswith("replay: cosine") for why in reasons), reasons
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_devnet_streams_fragments_and_every_host_follows_each_round_by_its_fragment_s_update(tmp_path: Path) -> None:
    """A streamed epoch (two fragments, delayed, a compressed download) end to end: each round's payloads
    and download hold one fragment, and the hosts keep the chain's model by those updates alone."""
    out = tmp_path / "devnet"
    rc = main(["devnet", "--out", str(out), "--hosts", "2", "--rounds", "4", "--inner-steps", "8",
               "--preset", "tiny", "--timeout", "400", "--replay-fraction", "0", "--stream-fragments", "2",
               "--stream-mix", "0.5", "--overlap", "delayed", "--broadcast", "codec", "--link", "100/10"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    recipe = Recipe.load(out / "recipe.json")
    assert (recipe.stream_fragments, recipe.stream_mix, recipe.round_state) == (2, 0.5, "carry")
    assert (report["stream_fragments"], report["stream_mix"]) == (2, 0.5)
    assert len(set(report["checkpoint_hashes"])) == 5  # the devnet pulled and checked each against the chain
    assert report["losses"][-1] < report["losses"][0]
    model = build_model(recipe.model, recipe.init_seed)
    spec = spec_of(dict(model.named_parameters()))
    stream = StreamSchedule.plan(spec, 2, 0.5, first_round=1)
    codec = get_codec(recipe.codec)
    sent = sum(codec.encoded_size(stream.fragment_of(r).spec(spec)) for r in range(1, 5))
    for i, host in enumerate(report["bytes_per_host"], start=1):
        assert report["bytes_per_host"][host] == sent < 4 * codec.encoded_size(spec) * 0.75
        assert report["download_bytes_per_host"][host] > 0
        log = (out / "logs" / f"host{i}.log").read_text()
        followed = re.findall(r"round (\d+): global model [0-9a-f]+… \((\w+)\)", log)
        assert followed and {how for _, how in followed} <= {"updates", "ahead"}, followed
        snap = HostStore(out / f"host{i}", report["epoch"]).load()
        assert snap is not None and snap.progress.outer_steps == 4  # no checkpoint pulled to follow, ever


WHY_NO_KERNEL_LINKS = unavailable()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(WHY_NO_KERNEL_LINKS is not None, reason=f"kernel links cannot be made here: {WHY_NO_KERNEL_LINKS}")
def test_devnet_over_kernel_shaped_links_replays_pays_and_uploads_no_faster_than_the_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each host in a network namespace of its own, its veth pair shaped by tc tbf at 8/1 Mbit/s (the host's
    own pacing off), the chain and the aggregator on the pairs' bridge: every round replayed and paid, and each upload took at least payload bytes / 1 Mbit/s
    (on loopback it takes milliseconds)."""
    out = tmp_path / "devnet"
    rc = main(["devnet", "--out", str(out), "--hosts", "2", "--rounds", "2", "--inner-steps", "8",
               "--preset", "tiny", "--timeout", "400", "--replay-fraction", "1", "--link", "8/1", "--kernel-link"])
    assert rc == 0
    said = " ".join(capsys.readouterr().out.split())  # rich folds long lines
    tag = re.search(r"network namespace gonka-(\w+)-1\.\.2", said)
    assert tag is not None, said
    left = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"gonka-{tag[1]}-" not in left and f"gk{tag[1]}" not in left  # removed when the devnet ended
    report = json.loads((out / "report.json").read_text())
    assert report["link"] == "8/1" and report["link_shaping"] == "kernel"
    assert len(set(report["checkpoint_hashes"])) == 3  # pulled and checked against the chain
    for i, (host, r) in enumerate(report["rewards"].items(), start=1):
        assert r["claimed_ngonka"] == r["earned_ngonka"] > 0
        log = (out / "logs" / f"host{i}.log").read_text()
        uploads = [float(line.split("(")[1].split(" s upload")[0]) for line in log.splitlines()
                   if "submission accepted (" in line]
        assert len(uploads) == 2
        per_round = report["bytes_per_host"][host] / 2
        assert all(s >= 0.9 * per_round / (1 * MBIT) for s in uploads), (uploads, per_round)
    agg_log = (out / "logs" / "aggregator.log").read_text()
    assert "announced 10.213." in agg_log  # on the links' bridge, which the hosts reach through their pairs
    store = Store(out / "aggregator").open()
    try:
        for round_ in (1, 2):
            reasons = [c.reasons[0] for c in store.contributions(report["epoch"], round_)]
            assert len(reasons) == 2 and all(why.startswith("replay: cosine") for why in reasons), reasons
    finally:
        store.close()
