"""Blobs with content derived from their key, and a runner for helper Python processes (disk-tier tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

from kdn import _core

FINGERPRINT = b"F" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def blob_for(i: int, tokens: int = 16) -> _core.Buffer:
    """A valid blob whose KV values are a function of ``i`` (so any reader can check them)."""
    rng = np.random.default_rng(i)
    kv = [rng.standard_normal((1, 2, tokens, 8), dtype=np.float32) for _ in range(4)]
    return _core.pack_chunk(kv, 0, tokens, FINGERPRINT, key(i))


def python_process(code: str, *args: str, **popen) -> subprocess.Popen:
    """Start ``python -c code args...`` with this test directory importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, **popen)
