"""Separate hosts for multi-node tests: Linux network namespaces on one bridge.

    lab = NetLab(["head", "a", "b"])      # three "machines", 10.231.K.1, .2, .3 on one LAN
    p = lab.popen("a", [sys.executable, "-m", "strata_dist.rank.main", ...])
    lab.link("b", up=False)               # pull b's cable
    lab.close()

Each host is a namespace with its own loopback and one veth (eth0) whose peer sits on a bridge in
a namespace of its own, so nothing touches the machine's real network. Needs root (CAP_NET_ADMIN)
and iproute2; `unavailable()` says why not, and tests skip with that reason."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str | None:
    """None when namespaces can be made here, else the reason."""
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"sdprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"network namespaces are not permitted here: {r.stderr.strip()}"
        r = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"bridges are not permitted here: {r.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


class NetLab:
    def __init__(self, hosts: list[str]):
        self.tag = f"sd{os.getpid() % 100000}"
        self.subnet = f"10.231.{os.getpid() % 200 + 20}"
        self.hosts = list(hosts)
        self.bridge_ns = f"{self.tag}-br"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 1}"

    def _make(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        self._made.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns, a, b = self.ns(host), f"{self.tag}{i}a", f"{self.tag}{i}b"
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", br)
            _ip("-n", ns, "link", "set", a, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", br, "link", "set", b, "master", "br0")
            _ip("-n", br, "link", "set", b, "up")

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """A process on `host` (its network namespace); killed by close() if still running."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **kw)
        self.procs.append(p)
        return p

    def link(self, host: str, up: bool) -> None:
        """Plug or pull `host`'s cable (its eth0 goes down: packets are dropped, no reset sent)."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "up" if up else "down")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()


def python() -> str:
    return sys.executable
