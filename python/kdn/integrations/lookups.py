"""Lookups answered where the worker's tiers live: vLLM's server runs its scheduler and its worker
in different processes, and a process' memory tier is its own, so the scheduler asking its own
tiers never sees what the worker holds in memory. The worker serves lookups on a unix socket (in a
folder only its user can open); the scheduler asks it, and falls back to its own tiers when no
worker answers.

One request: ``u32 tokens, u32 limit`` then the token ids (u32 each); the reply: ``i64`` leading
tokens held (``-1``: the worker could not look up).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("kdn")

_REQUEST = struct.Struct("<II")
_REPLY = struct.Struct("<q")


def socket_path(name: str) -> str:
    """The socket of the lookup server called ``name`` (any string both processes derive alike)."""
    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"kdn-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    return str(folder / f"lookup-{hashlib.blake2b(name.encode(), digest_size=12).hexdigest()}.sock")


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("lookup connection closed")
        data += part
    return bytes(data)


class LookupServer:
    """Answers lookups with ``lookup(tokens, limit) -> int`` from a thread per connection."""

    def __init__(self, path: str, lookup: Callable[[np.ndarray, int], int]):
        self.path, self._lookup = path, lookup
        if os.path.exists(path):
            os.unlink(path)  # a socket left by an engine that died: nobody listens on it
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(8)
        self._conns: set = set()
        threading.Thread(target=self._accept, name="kdn-lookups", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kdn-lookup", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self._answer(conn)
        self._conns.discard(conn)

    def _answer(self, conn: socket.socket) -> None:
        while True:
            try:
                n, limit = _REQUEST.unpack(_read_exactly(conn, _REQUEST.size))
                tokens = np.frombuffer(_read_exactly(conn, 4 * n), dtype=np.uint32)
            except (OSError, ConnectionError):
                return
            try:
                hit = int(self._lookup(tokens, limit))
            except Exception as e:  # a failed lookup is a miss for the asker, never a dead server
                log.warning("kdn: a lookup for the scheduler failed (%s: %s)", type(e).__name__, e)
                hit = -1
            try:
                conn.sendall(_REPLY.pack(hit))
            except OSError:
                return

    def close(self) -> None:
        """Stop listening and drop every connection (as the worker's exit would)."""
        self._sock.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LookupClient:
    """Asks the lookup server at ``path``; ``lookup`` is None when none answers (the caller then
    asks its own tiers). One connection, kept; thread-safe."""

    def __init__(self, path: str, timeout: float = 2.0):
        self.path, self.timeout = path, timeout
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False

    def lookup(self, tokens: np.ndarray, limit: int) -> int | None:
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        with self._lock:
            try:
                if self._conn is None:
                    if not os.path.exists(self.path):
                        return None
                    self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._conn.settimeout(self.timeout)
                    self._conn.connect(self.path)
                self._conn.sendall(_REQUEST.pack(len(tokens), max(0, limit)) + tokens.tobytes())
                hit = _REPLY.unpack(_read_exactly(self._conn, _REPLY.size))[0]
            except (OSError, ConnectionError) as e:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                if not self._warned:
                    self._warned = True
                    log.warning("kdn: the worker's lookup server at %s did not answer (%s); the scheduler "
                                "asks its own tiers (a memory tier private to the worker is not seen)", self.path, e)
                return None
        return hit if hit >= 0 else None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
