"""Kernel-shaped devnet links (gonka_node/devnet_links.py): real namespaces, veth pairs and tbf qdiscs.

The tests that make namespaces run only where this process may (root with CAP_NET_ADMIN, iproute2, the
tbf qdisc), which the probe below tries for real; elsewhere they are skipped, saying why. The refusals
run everywhere.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gonka_node import devnet_links
from gonka_node.cli import main
from gonka_node.core.link import MBIT, LinkSpec
from gonka_node.devnet import DevnetOptions, kernel_links
from gonka_node.devnet_links import KernelLinks
from gonka_node.devnet_procs import DevnetError

WHY_NOT = devnet_links.unavailable()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"kernel links cannot be made here: {WHY_NOT}")


@pytest.fixture
def links() -> Iterator[KernelLinks]:
    made = KernelLinks.create(2, LinkSpec(8, 2))
    try:
        yield made
    finally:
        made.close()


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def _rate_bits(qdiscs: str) -> float:
    """The rate of the one tbf qdisc in `tc qdisc show` output, in bit/s."""
    words = qdiscs.split()
    assert "tbf" in words, qdiscs
    rate = words[words.index("rate") + 1]
    scale = {"Kbit": 1e3, "Mbit": 1e6, "Gbit": 1e9, "bit": 1.0}
    unit = next(u for u in scale if rate.endswith(u))
    return float(rate[: -len(unit)]) * scale[unit]


@needs_netns
def test_each_host_gets_a_namespace_on_the_bridge_with_both_directions_shaped(links: KernelLinks) -> None:
    assert {links.namespace(1), links.namespace(2)} <= set(_namespaces())
    for i in (1, 2):
        down = subprocess.run(["tc", "qdisc", "show", "dev", f"gk{links.tag}h{i}"], capture_output=True, text=True)
        up = subprocess.run([*links.command(i), "tc", "qdisc", "show", "dev", f"gk{links.tag}p{i}"],
                            capture_output=True, text=True)
        assert _rate_bits(down.stdout) == 8e6 and _rate_bits(up.stdout) == 2e6
        inside = subprocess.run([*links.command(i), "ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        assert f"{links.host_address(i)}/24" in inside
    assert links.hub == str(links.subnet.network_address + 1) and links.host_address(2) != links.hub
    links.close()
    assert not any(ns.startswith(f"gonka-{links.tag}-") for ns in _namespaces())
    assert f"gk{links.tag}" not in _links()
    links.close()  # again: nothing to do


@needs_netns
def test_a_host_s_upload_and_download_pass_at_the_shaped_rates_not_faster(links: KernelLinks) -> None:
    """Loopback moves these bytes in milliseconds; through the pair they take at least bytes / rate."""
    server = socket.create_server((links.hub, 0))
    server.settimeout(60)
    port = server.getsockname()[1]
    received: list[tuple[int, float]] = []

    def take_upload() -> None:
        conn, _ = server.accept()
        started = time.monotonic()
        with conn:
            received.append((sum(iter(lambda: len(conn.recv(1 << 16)), 0)), time.monotonic() - started))

    def serve_download() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"y" * down_bytes)

    up_bytes, down_bytes = 400_000, 1_200_000  # 1.6 s at 2 Mbit/s up, 1.2 s at 8 Mbit/s down
    send = f"import socket; s = socket.create_connection(({links.hub!r}, {port})); s.sendall(b'x' * {up_bytes}); s.close()"
    fetch = (f"import socket, time; s = socket.create_connection(({links.hub!r}, {port})); t = time.monotonic()\n"
             "n = sum(iter(lambda: len(s.recv(1 << 16)), 0)); print(n, time.monotonic() - t)")
    try:
        thread = threading.Thread(target=take_upload, daemon=True)
        thread.start()
        subprocess.run([*links.command(1), sys.executable, "-c", send], check=True, timeout=60)
        thread.join(60)
        thread = threading.Thread(target=serve_download, daemon=True)
        thread.start()
        out = subprocess.run([*links.command(2), sys.executable, "-c", fetch], check=True, timeout=60,
                             capture_output=True, text=True).stdout.split()
        thread.join(60)
    finally:
        server.close()
    [(got, upload_s)] = received
    assert got == up_bytes and upload_s >= 0.9 * up_bytes / (2 * MBIT)
    download_s = float(out[1])
    assert int(out[0]) == down_bytes and download_s >= 0.9 * down_bytes / (8 * MBIT)
    assert download_s < 0.75 * down_bytes / (2 * MBIT)  # at the download rate, not the upload's


@needs_netns
def test_two_devnets_take_different_subnets_and_one_killed_is_swept(links: KernelLinks) -> None:
    second = KernelLinks.create(1, LinkSpec(10, 10))
    try:
        assert not second.subnet.overlaps(links.subnet) and second.tag != links.tag
        # As if its devnet were killed before close: a marker naming a pid that is gone.
        dead = subprocess.Popen(["true"])
        dead.wait()
        (devnet_links.STATE_DIR / f"{second.tag}.pid").write_text(str(dead.pid))
        KernelLinks.create(1, LinkSpec(10, 10)).close()  # sweeps on the way in
        assert not any(ns.startswith(f"gonka-{second.tag}-") for ns in _namespaces())
        assert f"gk{second.tag}" not in _links()
        assert set(_namespaces()) >= {links.namespace(1), links.namespace(2)}  # its own devnet still runs
    finally:
        second.close()


def test_kernel_links_refuse_latency_and_a_machine_without_the_tools_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def made(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a refused link ran {args}")

    monkeypatch.setattr(devnet_links, "_run", made)  # refusals come before anything is made
    with pytest.raises(DevnetError, match=r"rates only \(tc tbf\): --link 100/10@20 asks for 20 ms .*--link 100/10$"):
        KernelLinks.create(2, LinkSpec.parse("100/10@20"))
    monkeypatch.setattr(devnet_links.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(DevnetError, match=r"needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN, and iproute2's ip and tc .*: tc not found$"):
        KernelLinks.create(2, LinkSpec(8, 2))
    monkeypatch.setattr(devnet_links.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(devnet_links.os, "geteuid", lambda: 1000)
    with pytest.raises(DevnetError, match=r": this process is not root$"):
        KernelLinks.create(2, LinkSpec(8, 2))


def test_the_devnet_asks_for_rates_and_the_embedded_chain_before_it_makes_anything(tmp_path: Path) -> None:
    with pytest.raises(DevnetError, match="give the rates with --link DOWN/UP"):
        kernel_links(DevnetOptions(out=tmp_path, kernel_link=True))
    with pytest.raises(DevnetError, match="--kernel-link with --rpc-url"):
        kernel_links(DevnetOptions(out=tmp_path, kernel_link=True, link="100/10", chain_url="http://127.0.0.1:8545"))
    with pytest.raises(DevnetError, match="--kernel-link with an object-store --dataset"):
        kernel_links(DevnetOptions(out=tmp_path, kernel_link=True, link="100/10", dataset="s3://bucket/data"))
    assert kernel_links(DevnetOptions(out=tmp_path, link="100/10")) is None


def test_the_cli_says_what_a_kernel_link_needs_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["devnet", "--out", str(tmp_path / "d"), "--kernel-link"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and "give the rates with --link DOWN/UP" in err
    assert not (tmp_path / "d" / "deployment.json").exists()


def test_sweep_leaves_a_marker_whose_devnet_still_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only markers whose pid is gone are swept (no `ip` call is needed to see that)."""
    monkeypatch.setattr(devnet_links, "STATE_DIR", tmp_path)
    removed: list[str] = []
    monkeypatch.setattr(devnet_links, "_remove", lambda tag, namespaces: removed.append(tag))
    monkeypatch.setattr(devnet_links.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="gonka-aaaaaa-1 gonka-bbbbbb-1\n"))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "aaaaaa.pid").write_text(str(os.getpid()))
    (tmp_path / "bbbbbb.pid").write_text(str(dead.pid))
    devnet_links._sweep()
    assert removed == ["bbbbbb"]


class _Links:
    """Stands in for KernelLinks: records that the devnet closed it."""

    hub, subnet = "127.0.0.1", "127.0.0.0/8"
    closed = 0

    def command(self, i: int) -> tuple[str, ...]:
        return ()

    def namespace(self, i: int) -> str:
        return f"fake-{i}"

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("fails", ["start_chain", "deploy_and_schedule"])
def test_the_devnet_removes_its_links_whatever_fails_after_they_were_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    import gonka_node.devnet as devnet

    links = _Links()
    monkeypatch.setattr(devnet.KernelLinks, "create", classmethod(lambda cls, hosts, spec: links))

    def broken(*args: object, **kwargs: object) -> None:
        raise DevnetError(f"{fails} broke")

    monkeypatch.setattr(devnet, fails, broken)
    with pytest.raises(DevnetError, match=f"{fails} broke"):
        devnet.run_devnet(DevnetOptions(out=tmp_path / "d", link="8/1", kernel_link=True), say=lambda line: None)
    assert links.closed == 1


@needs_netns
def test_a_namespace_that_cannot_reach_the_bridge_or_a_proxy_for_it_is_refused_and_nothing_is_left(
    links: KernelLinks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Host 1's end of its pair down: as unreachable as behind a firewall that drops the hosts' input.
    subprocess.run([*links.command(1), "ip", "link", "set", f"gk{links.tag}p1", "down"], check=True)
    with pytest.raises(DevnetError, match=rf"host 1's namespace cannot reach {links.hub}:\d+ on the links' bridge"):
        links._check_reach()
    monkeypatch.setenv("https_proxy", "http://proxy.example:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    before = {ns for ns in _namespaces() if ns.startswith("gonka-")}
    with pytest.raises(DevnetError, match=r"https_proxy is set, so the hosts' calls to 10\.213\.\d+\.1 .* no_proxy"):
        KernelLinks.create(1, LinkSpec(8, 2))
    made_since = {ns for ns in _namespaces() if ns.startswith("gonka-")} - before
    assert not {ns for ns in made_since if not ns.startswith(f"gonka-{links.tag}-")}  # the refused one is gone
