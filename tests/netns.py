"""Nodes on a network of the tests' own: each node a Linux network namespace with one veth link to a
bridge, on addresses of the tests' own (10.213.<n>.0/24), so that a node can be cut off, slowed down or
removed while the others go on. Root only (`ip netns`, `tc`). Nothing is routed: traffic stays between
these namespaces (the bridge has no address and no uplink), and everything made is removed on exit.

    with Network(3) as net:
        proc = subprocess.Popen(net.run(0, [sys.executable, "-m", "launch", ...]), ...)
        net.cut(2)          # its link down: a partition
        net.slow(1, "4mbit")  # its bandwidth cut (tbf, both ways)
        net.remove(0)       # its processes SIGKILLed and its namespace deleted
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

IFACE = "rkn0"  # every node's link, inside its own namespace


def available() -> str:
    """'' when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "no ip or tc command (iproute2)"
    return ""


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=20)


class Network:
    """`nodes` namespaces on one bridge; node i is at `address(i)`."""

    def __init__(self, nodes: int) -> None:
        self.tag = f"{os.getpid() % 10000:04d}"
        self.subnet = f"10.213.{os.getpid() % 250}"
        self.nodes = nodes
        self.bridge = f"rkb{self.tag}"
        self.names = [f"rk{self.tag}n{i}" for i in range(nodes)]

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def host_side(self, i: int) -> str:
        return f"rk{self.tag}h{i}"

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("link", "add", self.host_side(i), "type", "veth", "peer", "name", f"rk{self.tag}p{i}")
                _ip("link", "set", f"rk{self.tag}p{i}", "netns", name)
                _ip("-n", name, "link", "set", f"rk{self.tag}p{i}", "name", IFACE)
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
                _ip("-n", name, "link", "set", IFACE, "up")
                _ip("link", "set", self.host_side(i), "master", self.bridge)
                _ip("link", "set", self.host_side(i), "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, i: int, command: list[str]) -> list[str]:
        """`command` run in node i's namespace."""
        return ["ip", "netns", "exec", self.names[i], *command]

    def cut(self, i: int) -> None:
        """Node i's link down: it and the others stop hearing each other (no reset: packets are lost)."""
        _ip("link", "set", self.host_side(i), "down")

    def slow(self, i: int, rate: str = "4mbit") -> None:
        """Node i's bandwidth cut to `rate` both ways (token bucket filters on both ends of its link)."""
        for prefix in ([], ["ip", "netns", "exec", self.names[i]]):
            dev = IFACE if prefix else self.host_side(i)
            subprocess.run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
                            "latency", "400ms"], check=True, capture_output=True, timeout=20)

    def unslow(self, i: int) -> None:
        """Node i's full bandwidth back."""
        for prefix in ([], ["ip", "netns", "exec", self.names[i]]):
            dev = IFACE if prefix else self.host_side(i)
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=20)

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True, timeout=20)
        return [int(p) for p in out.stdout.split()]

    def remove(self, i: int) -> None:
        """Node i gone: every process in its namespace SIGKILLed, then the namespace deleted."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", self.names[i], check=False)

    def close(self) -> None:
        for i in range(self.nodes):
            if os.path.exists(f"/run/netns/{self.names[i]}"):
                self.remove(i)
            _ip("link", "del", self.host_side(i), check=False)
        _ip("link", "del", self.bridge, check=False)
