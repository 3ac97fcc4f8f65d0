"""A Redis server behind a real shaped link: redis-server in its own network namespace, joined to
this one by a veth pair whose bandwidth (tc tbf) can change while it serves. (netem, for delay, is
not in this machine's kernel; the link's round trip is the veth's, ~0.1 ms.)"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from redis_servers import wait_until

_names = itertools.count()


def link_unavailable() -> str | None:
    """Why a shaped link cannot be built here (not root, no ip/tc, no namespaces), or None."""
    if os.geteuid() != 0:
        return "shaped links need root (network namespaces and tc)"
    for tool in ("ip", "tc", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install iproute2 redis-server)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"network namespaces unavailable: {probe.stderr.strip()}"


def require_link() -> None:
    """Skip without the means to shape a link, unless KDN_REQUIRE_SERVERS=1 (CI): then fail."""
    why = link_unavailable()
    if why is None:
        return
    if os.environ.get("KDN_REQUIRE_SERVERS") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class ShapedRedis:
    """redis-server inside namespace ``kdn<pid>-<n>`` at 10.213.x.2, reached from here at that
    address through a veth pair. ``set_rate(gbps)`` shapes what the server sends (egress of its
    end, tbf); ``cut()`` takes the link down (packets
    are lost, clients time out), ``restore()`` brings it back; ``stop()`` removes everything.

    Example:
        >>> link = ShapedRedis(tmp_path, gbps=1.0)
        >>> KDN(KDNConfig(remote_url=link.url)); link.set_rate(0.1); link.stop()
    """

    def __init__(self, directory: Path, gbps: float = 10.0, port: int = 6399):
        n = next(_names)
        self.ns = f"kdn{os.getpid()}-{n}"
        self.host_dev, self.ns_dev = f"kh{os.getpid() % 100000}{n}"[:15], f"kn{os.getpid() % 100000}{n}"[:15]
        self.subnet = random.Random().randrange(0, 250)
        self.ip = f"10.213.{self.subnet}.2"
        self.port, self.proc = port, None
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            _run("ip", "netns", "add", self.ns)
            _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
            _run("ip", "link", "set", self.ns_dev, "netns", self.ns)
            _run("ip", "addr", "add", f"10.213.{self.subnet}.1/24", "dev", self.host_dev)
            _run("ip", "link", "set", self.host_dev, "up")
            self._in_ns("ip", "addr", "add", f"{self.ip}/24", "dev", self.ns_dev)
            self._in_ns("ip", "link", "set", self.ns_dev, "up")
            self._in_ns("ip", "link", "set", "lo", "up")
            self._shape("add", gbps)
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "redis-server", "--port", str(port), "--bind", self.ip,
                 "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.directory)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_until(lambda: self.cli("PING").returncode == 0, 10, "redis-server in the namespace did not start")
        except BaseException:
            self.stop()
            raise

    def _in_ns(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns, *args)

    def _shape(self, verb: str, gbps: float) -> None:
        """A token bucket on the server's end: what it sends is shaped to ``gbps``."""
        rate = f"{max(1, int(gbps * 1e6))}kbit"
        burst = max(64 * 1024, int(gbps * 1e9 / 8 / 250))  # ~4 ms of traffic, at least 64 KiB
        self._in_ns("tc", "qdisc", verb, "dev", self.ns_dev, "root", "tbf", "rate", rate, "burst", str(burst),
                    "latency", "200ms")
        self.gbps = gbps

    def set_rate(self, gbps: float) -> None:
        """Change the link's bandwidth now (in Gbit/s), while requests run."""
        self._shape("change", gbps)

    def cut(self) -> None:
        """The link dies: every packet is dropped until :meth:`restore`."""
        _run("ip", "link", "set", self.host_dev, "down")

    def restore(self) -> None:
        _run("ip", "link", "set", self.host_dev, "up")

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["redis-cli", "-h", self.ip, "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=30)

    @property
    def url(self) -> str:
        return f"redis://{self.ip}:{self.port}/0"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)


def replay(link: ShapedRedis, trace: list[float], interval: float, stop) -> None:
    """Set the link's rate to each value of ``trace`` (Gbit/s) for ``interval`` seconds, in a loop,
    until ``stop`` (a threading.Event) is set: run it in a thread beside the requests."""
    for gbps in itertools.cycle(trace):
        link.set_rate(gbps)
        if stop.wait(interval):
            return
