"""Real Redis servers for the tests: single instances and a 3-master cluster on 127.0.0.1, free ports."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free port on 127.0.0.1; for a cluster node also its bus port (+10000, so at most 55535)."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55535)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis cluster node")


def wait_until(ready, seconds: float, failure: str) -> None:
    """Poll ``ready()`` until it is true; RuntimeError(``failure``) after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.05)


def require_redis() -> None:
    """Skip without redis-server, unless KDN_REQUIRE_SERVERS=1 (.ci/run sets it): then fail."""
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return
    message = "redis-server/redis-cli not installed (apt-get install redis-server)"
    if os.environ.get("KDN_REQUIRE_SERVERS") == "1":
        pytest.fail(message)
    pytest.skip(message)


class RedisServer:
    """One redis-server process on 127.0.0.1 (no persistence), stopped by ``stop()``."""

    def __init__(self, directory: Path, port: int | None = None, *args: str):
        self.port = port or free_port()
        self.directory, self.args = Path(directory), args
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: self.cli("PING", check=False).returncode == 0, 10,
                       f"redis-server on port {self.port} did not start")
        except RuntimeError:
            self.stop()
            raise

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        password = [a for a in self.args if a != "--requirepass"]
        auth = ["-a", password[0], "--no-auth-warning"] if "--requirepass" in self.args else []
        return subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *auth, *args],
                              capture_output=True, text=True, check=check, timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class RedisCluster:
    """Three cluster-enabled masters joined with ``redis-cli --cluster create``."""

    def __init__(self, directory: Path):
        self.nodes = []
        try:
            for i in range(3):
                port = free_port(cluster=True)
                self.nodes.append(RedisServer(Path(directory) / f"node{i}", port, "--cluster-enabled", "yes",
                                              "--cluster-config-file", f"nodes-{port}.conf"))
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
                            "--cluster-yes"], capture_output=True, text=True, check=True, timeout=60)
            wait_until(lambda: "cluster_state:ok" in self.nodes[0].cli("CLUSTER", "INFO").stdout, 20,
                       "the Redis cluster did not reach cluster_state:ok")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"
