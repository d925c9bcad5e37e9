"""The devnet's links shaped by the kernel (`gonka-node devnet --link DOWN/UP --kernel-link`).

Each host process runs in a network namespace of its own, joined to this machine's namespace by a veth
pair whose outer end sits on a bridge; the chain, the aggregators and the devnet itself listen on the
bridge's address (`hub`). Both directions of a host's link are shaped by the kernel's token-bucket
filter (`tc qdisc ... tbf`): the host's end of the pair sends at the upload rate, the bridge's end of it
at the download rate. So the bytes cross a real TCP stack with real queues, drops and congestion
control, where `--link` alone paces them inside the host's gRPC client (gonka_node/core/link.py) on
loopback. Rates only: the per-transfer latency `@MS` of `--link` has no kernel counterpart here (it
would need the netem qdisc) and is refused.

It needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN (`ip netns` mounts) and iproute2's `ip` and `tc`;
`KernelLinks.create` says in one line what is missing, and checks that a host's namespace reaches the
bridge (a firewall on this machine's input may not let it) before anything else starts. Everything it makes is named after a tag of its own (namespaces `gonka-<tag>-<i>`,
bridge `gk<tag>`, pairs `gk<tag>h<i>` / `gk<tag>p<i>`) and removed by `close`; a devnet killed before
that leaves them, with a marker file naming its pid, and the next `create` removes those whose pid is
gone. The subnet is the first free one of 10.213.0.0/16's /24s (not on any interface or route here),
picked under a lock so that devnets started together get different ones.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gonka_node.core.link import MBIT, LinkSpec
from gonka_node.devnet_procs import DevnetError

STATE_DIR = Path("/run/gonka-devnet-links")  # markers: <tag>.pid holds the pid of the devnet that made <tag>
POOL = ipaddress.IPv4Network("10.213.0.0/16")
MTU = 1500
NEEDS = "--kernel-link needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN, and iproute2's ip and tc (the tbf qdisc)"
PROXIES = ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY")


def _run(args: Sequence[str]) -> str:
    """Run an `ip` / `tc` command; DevnetError with its own message when it fails."""
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise DevnetError(f"--kernel-link: `{' '.join(args)}` failed: {why[-1] if why else f'exit {done.returncode}'} "
                          f"({NEEDS[len('--kernel-link ') :]})")
    return done.stdout


def _tbf(rate_mbps: float) -> list[str]:
    """A token-bucket filter at `rate_mbps`: a burst of 10 ms of traffic (as `TokenBucket`'s) but at least
    two full frames (the kernel cannot send a packet larger than the bucket: below 2.4 Mbit/s the burst
    is longer than 10 ms), and 200 ms of queue."""
    rate = rate_mbps * MBIT  # bytes per second
    burst = max(int(rate / 100), 2 * (MTU + 14))
    return ["tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst), "latency", "200ms"]


@dataclass
class KernelLinks:
    """One devnet's namespaces, bridge and shaped pairs (see the module docstring)."""

    tag: str
    subnet: ipaddress.IPv4Network
    spec: LinkSpec
    hosts: int
    made: list[str] = field(default_factory=list)  # namespaces made so far (closed in reverse)

    @property
    def hub(self) -> str:
        """The bridge's address: where the chain and the aggregators listen, reachable from every host."""
        return str(self.subnet.network_address + 1)

    def namespace(self, i: int) -> str:
        return f"gonka-{self.tag}-{i}"

    def host_address(self, i: int) -> str:
        return str(self.subnet.network_address + 1 + i)

    def command(self, i: int) -> tuple[str, ...]:
        """The prefix that runs a command in host i's namespace (`ip netns exec` execs it: same pid)."""
        return ("ip", "netns", "exec", self.namespace(i))

    @classmethod
    def create(cls, hosts: int, spec: LinkSpec) -> KernelLinks:
        """Make the bridge and one shaped namespace per host (1..hosts); DevnetError in one line, with
        nothing left behind, when this machine cannot."""
        if spec.latency_ms:
            raise DevnetError(f"--kernel-link shapes rates only (tc tbf): --link {spec.text()} asks for "
                              f"{spec.latency_ms:g} ms of latency, which needs the netem qdisc; give --link "
                              f"{spec.down_mbps:g}/{spec.up_mbps:g}")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise DevnetError(f"{NEEDS}: {' and '.join(missing)} not found")
        if os.geteuid() != 0:
            raise DevnetError(f"{NEEDS}: this process is not root")
        with _state_lock():  # held while a subnet is picked and taken
            _sweep()
            tag = secrets.token_hex(3)
            while (STATE_DIR / f"{tag}.pid").exists():
                tag = secrets.token_hex(3)
            links = cls(tag, _free_subnet(), spec, hosts)
            (STATE_DIR / f"{tag}.pid").write_text(str(os.getpid()))
            try:
                links._make()
                links._check_reach()
            except BaseException:
                links.close()
                raise
        return links

    def _make(self) -> None:
        bridge = f"gk{self.tag}"
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.hub}/{self.subnet.prefixlen}", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        for i in range(1, self.hosts + 1):
            ns, outer, inner = self.namespace(i), f"gk{self.tag}h{i}", f"gk{self.tag}p{i}"
            _run(["ip", "netns", "add", ns])
            self.made.append(ns)
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", bridge])
            _run(["ip", "link", "set", outer, "up"])
            _run(["tc", "qdisc", "add", "dev", outer, "root", *_tbf(self.spec.down_mbps)])  # to the host
            inside = ["ip", "netns", "exec", ns]
            _run([*inside, "ip", "addr", "add", f"{self.host_address(i)}/{self.subnet.prefixlen}", "dev", inner])
            _run([*inside, "ip", "link", "set", inner, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
            _run([*inside, "tc", "qdisc", "add", "dev", inner, "root", *_tbf(self.spec.up_mbps)])  # from it

    def _check_reach(self) -> None:
        """A TCP connection from host 1's namespace to the bridge, or DevnetError: else the hosts would
        wait for the chain until the devnet's timeout (an input firewall, a proxy for everything)."""
        proxied = [name for name in PROXIES if os.environ.get(name)]
        bypass = os.environ.get("no_proxy", "") + "," + os.environ.get("NO_PROXY", "")
        if proxied and self.hub not in bypass.split(","):
            raise DevnetError(f"--kernel-link: {proxied[0]} is set, so the hosts' calls to {self.hub} (the links' "
                              f"bridge) would go to the proxy: add {self.hub} to no_proxy or unset it")
        with socket.create_server((self.hub, 0)) as server:
            server.settimeout(0.1)
            port = server.getsockname()[1]
            dial = f"import socket; socket.create_connection(({self.hub!r}, {port}), timeout=10).close()"
            probe = subprocess.Popen([*self.command(1), sys.executable, "-c", dial],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 20
            try:
                while True:
                    try:
                        server.accept()[0].close()
                        return
                    except TimeoutError:  # a probe that connected is in the backlog even once it exited
                        if probe.poll() not in (None, 0) or time.monotonic() > deadline:
                            break
            finally:
                if probe.poll() is None:
                    probe.kill()
                why = probe.communicate()[1].strip().splitlines()
        raise DevnetError(f"--kernel-link: host 1's namespace cannot reach {self.hub}:{port} on the links' bridge "
                          f"({why[-1] if why else 'no connection'}): does a firewall on this machine's input refuse it?")

    def close(self) -> None:
        """Remove the namespaces (their pairs go with them), the bridge and the marker; idempotent."""
        _remove(self.tag, self.made)
        self.made = []


@contextmanager
def _state_lock() -> Iterator[None]:
    """STATE_DIR's lock, held: devnets started together pick their tags and subnets one at a time."""
    try:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(STATE_DIR / "lock", os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError as exc:
        raise DevnetError(f"{NEEDS}: {STATE_DIR}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def unavailable() -> str | None:
    """Why kernel links cannot be made on this machine (one line), or None: it makes one and removes it."""
    try:
        KernelLinks.create(1, LinkSpec(10, 10)).close()
    except DevnetError as exc:
        return str(exc)
    return None


def _remove(tag: str, namespaces: Sequence[str]) -> None:
    for ns in reversed(namespaces):
        # The pair first: a namespace's own devices go when the kernel gets to it, not when `del` returns.
        subprocess.run(["ip", "link", "del", f"gk{tag}h{ns.rpartition('-')[2]}"], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", f"gk{tag}"], capture_output=True)
    (STATE_DIR / f"{tag}.pid").unlink(missing_ok=True)


def _sweep() -> None:
    """Remove what devnets that are gone (killed before `close`) left behind."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for marker in STATE_DIR.glob("*.pid"):
        try:
            os.kill(int(marker.read_text()), 0)
            continue  # its devnet still runs
        except ProcessLookupError:
            pass
        except (ValueError, OSError):  # unreadable, or removed by its own devnet's close meanwhile
            continue
        tag = marker.stem
        _remove(tag, [ns for ns in listed if ns.startswith(f"gonka-{tag}-")])


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of POOL that no interface address or route here overlaps."""
    taken = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).splitlines():
        words = line.split()
        if "inet" in words:
            taken.append(ipaddress.ip_network(words[words.index("inet") + 1], strict=False))
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        first = line.split()[0] if line.split() else ""
        if first[:1].isdigit():
            taken.append(ipaddress.ip_network(first if "/" in first else f"{first}/32", strict=False))
    for subnet in POOL.subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    covering = sorted({str(t) for t in taken if t.overlaps(POOL)})
    raise DevnetError(f"--kernel-link: every /24 of {POOL} is in use on this machine ({', '.join(covering[:3])})")
