"""A serving engine's cross-process lookup channel: vLLM's server runs its scheduler and its worker
in different processes, and a process' memory tier is its own, so the scheduler asking its own
tiers never sees what the worker holds in memory. The worker serves lookups on a unix socket (in a
folder only its user can open); the scheduler asks it, and falls back to its own tiers when no
worker answers. The messages and their encoding: :mod:`kdn.engine.messages`. Face-free: a face
hands the server its lookup, its ended stores and its blending readiness.

Each answer to a lookup carries the requests whose store has ended (the last ``MAX_ENDED`` the
worker reported, each told once to every connection: two clients of one worker do not take each
other's).

Trust: the socket's folder must be a real directory (not a symlink) owned by this user and closed to
others; one another local user created first is never used (a private folder in this user's home
is used instead, and a warning names the squatted one). Answers are clamped to the limit asked; a
connection that stays silent, or sends a frame that is not this channel's, is dropped, and the
server holds at most ``MAX_CONNECTIONS`` (a new one closes the one idle longest: idle connections
never lock the scheduler out); at most ``MAX_LARGE`` lookups over ``LARGE_TOKENS`` tokens are read at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kdn.engine import messages
from kdn.engine.chunks import Prefix
from kdn.engine.messages import (
    FAILED,
    FOUND,
    MAX_ENDED,
    MAX_PIECES,
    MAX_TOKENS,
    NOT_SERVING,
    SCOPE_BYTES,
    BlendQuery,
    Lookup,
    LookupAnswer,
    ProtocolError,
    Readiness,
    frame,
)
from kdn.engine.requests import request_digest

log = logging.getLogger("kdn")

LARGE_TOKENS, MAX_LARGE = 1 << 16, 2  # lookups this long are read two at a time (bounded memory)
MAX_CONNECTIONS = 64  # a vLLM scheduler keeps one
IDLE_S = 600.0  # a connection silent this long is dropped (its client reconnects)
_warned_squat: set = set()
SOCKET_PATH_MAX = 107  # a Unix socket's path: sun_path's 108 bytes less the closing NUL
_FAILED = object()  # no answer (as opposed to the worker's "could not look up")


def _private_folder(folder: Path) -> bool:
    """Make ``folder`` (mode 0700) or check the one there: a real directory (lstat: a symlink is
    refused) owned by this user; a loose mode of our own folder is tightened. False if it is not ours."""
    try:
        folder.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    except OSError:
        return False
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return True


def socket_path(name: str) -> str:
    """The socket of the lookup server called ``name`` (any string both processes derive alike), in
    ``$XDG_RUNTIME_DIR/kdn-<uid>`` or ``$TMPDIR/kdn-<uid>`` (``/tmp/kdn-<uid>`` where that path would not
    fit a socket's 108 bytes), or where another user holds that name, in ``~/.cache/kdn/run`` (the
    same in every process of this user)."""
    file = f"lookup-{hashlib.blake2b(name.encode(), digest_size=12).hexdigest()}.sock"
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    if len(os.fsencode(base / f"kdn-{os.getuid()}" / file)) > SOCKET_PATH_MAX:
        base = Path("/tmp")
    folder = base / f"kdn-{os.getuid()}"
    if not _private_folder(folder):
        if str(folder) not in _warned_squat:
            _warned_squat.add(str(folder))
            log.warning("kdn: %s is not a private folder of this user (another user made it, or it is a "
                        "symlink); lookup sockets go to ~/.cache/kdn/run instead", folder)
        folder = Path.home() / ".cache" / "kdn" / "run"
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private_folder(folder):
            raise PermissionError(f"kdn: no private folder for lookup sockets ({folder} is not this user's)")
    return str(folder / file)


class WorkerNotServing(RuntimeError):
    """The worker half refused this engine (a KV layout kdn does not read): nothing will be loaded
    or stored, so the scheduler must neither count on a hit nor wait for a store."""


class LookupServer:
    """Answers lookups with ``lookup(tokens, limit, scope) -> Prefix`` from a thread per
    connection, each answer with the requests ``ended()`` says have had their store end (each told
    once to each connection); once ``serving`` is False (its worker refused the engine) every
    answer says so; a blend query is answered with ``readiness(piece keys)``."""

    def __init__(self, path: str, lookup: Callable[[np.ndarray, int, bytes | None], Prefix],
                 ended: Callable[[], list[str]] = list,
                 readiness: Callable[[list[bytes]], Readiness] = lambda keys: Readiness(False, why="no blending")):
        self.path, self._lookup, self._ended, self.serving = path, lookup, ended, True
        self._readiness = readiness
        if os.path.exists(path):
            os.unlink(path)  # a socket left by an engine that died: nobody listens on it
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(8)
        self._conns: dict = {}  # connection -> when it last asked
        self._lock = threading.Lock()
        self._recent: deque = deque(maxlen=MAX_ENDED)  # (sequence number, digest) of ended stores
        self._seq = 0
        self._large = threading.BoundedSemaphore(MAX_LARGE)
        threading.Thread(target=self._accept, name="kdn-lookups", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:  # the one idle longest makes room
                    idle = min(self._conns, key=self._conns.get)
                    self._conns.pop(idle)
                    try:
                        idle.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self._conns[conn] = time.monotonic()
            conn.settimeout(IDLE_S)
            threading.Thread(target=self._serve, args=(conn,), name="kdn-lookup", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            told = 0
            while True:
                try:
                    asked = self._read_request(conn)
                except ProtocolError as e:
                    log.warning("kdn: dropping a lookup connection: %s", e)
                    break
                except (OSError, ConnectionError):
                    break
                with self._lock:
                    if conn in self._conns:
                        self._conns[conn] = time.monotonic()
                if isinstance(asked, BlendQuery):
                    reply = self._blend_reply(list(asked.keys))
                else:
                    digests, told = self._ended_since(told)
                    reply = self._lookup_reply(asked, tuple(digests))
                try:
                    conn.sendall(frame(reply))
                except OSError:
                    break
        with self._lock:
            self._conns.pop(conn, None)

    def _ended_since(self, told: int) -> tuple[list[bytes], int]:
        """The digests of stores ended after sequence number ``told``, and the last number."""
        with self._lock:
            for request_id in self._ended():
                self._seq += 1
                self._recent.append((self._seq, request_digest(request_id)))
            return [d for seq, d in self._recent if seq > told], self._seq

    def _read_request(self, conn: socket.socket) -> Lookup | BlendQuery:
        kind, size = messages.read_head(conn, (Lookup, BlendQuery))
        if kind is Lookup and size > 4 * LARGE_TOKENS:
            with self._large:
                return Lookup.decode(messages.read_body(conn, size))
        return kind.decode(messages.read_body(conn, size))

    def _lookup_reply(self, asked: Lookup, ended: tuple) -> LookupAnswer:
        if not self.serving:
            return LookupAnswer(NOT_SERVING, ended=ended)
        try:
            return LookupAnswer(FOUND, self._lookup(asked.tokens, asked.limit, asked.scope), ended)
        except Exception as e:  # a failed lookup is a miss for the asker, never a dead server
            log.warning("kdn: a lookup for the scheduler failed (%s: %s)", type(e).__name__, e)
            return LookupAnswer(FAILED, ended=ended)

    def _blend_reply(self, keys: list[bytes]) -> Readiness:
        try:
            ready = Readiness(False, why="the worker refused this engine's KV layout") if not self.serving \
                else self._readiness(keys)
        except Exception as e:  # a failed answer is "no blending" for the asker, never a dead server
            ready = Readiness(False, why=f"the worker's answer failed ({type(e).__name__}: {e})")
        return dataclasses.replace(ready, held=min(ready.held, len(keys)))

    def close(self) -> None:
        """Stop listening and drop every connection (as the worker's exit would)."""
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
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
        self._ended: list[bytes] = []  # the stores the worker said have ended, until take_ended

    def take_ended(self) -> list[bytes]:
        """The :func:`request_digest` of each request whose store the worker's answers said has
        ended since the last call."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def lookup(self, tokens: np.ndarray, limit: int, scope: bytes | None = None) -> Prefix | None:
        """What the worker holds of ``tokens`` in ``scope`` (16 bytes, :func:`kdn.keys.request_scope`;
        at most ``limit`` tokens: the keys of the chunks that serve them, which its load reads without
        looking again), or None when no worker answers or it could not look up. Raises
        :class:`WorkerNotServing` when the worker refused the engine."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        limit = max(0, min(int(limit), len(tokens)))
        if len(tokens) > MAX_TOKENS or (scope is not None and len(scope) != SCOPE_BYTES):
            return None
        answer = self._ask(Lookup(tokens, limit, scope), lambda body: LookupAnswer.decode(body, limit))
        if answer is _FAILED:
            return None
        self._ended += answer.ended
        if answer.status == NOT_SERVING:
            raise WorkerNotServing(f"the worker behind {self.path} refused this engine's KV layout")
        return answer.found

    def readiness(self, keys: list[bytes]) -> Readiness | None:
        """Whether the worker blends a prompt of these piece keys, and how many of them, from the first,
        its tiers hold; None when no worker answers."""
        if len(keys) > MAX_PIECES or any(len(k) != 16 for k in keys):
            return Readiness(False, why=f"{len(keys)} pieces, or a key not of 16 bytes")
        ready = self._ask(BlendQuery(tuple(keys)), Readiness.decode, connect_anyway=True)
        return None if ready is _FAILED else dataclasses.replace(ready, held=min(ready.held, len(keys)))

    def _ask(self, message, decode: Callable, connect_anyway: bool = False):
        """``message``'s answer, decoded; :data:`_FAILED` when no server answers (a kept connection
        the server dropped, idle, gets one more try on a new one)."""
        request = frame(message)
        expected = {Lookup: (LookupAnswer,), BlendQuery: (Readiness,)}[type(message)]
        with self._lock:
            for warn in (self._conn is None, True):
                try:
                    if self._conn is None:
                        if not connect_anyway and not os.path.exists(self.path):
                            return _FAILED
                        self._connect()
                    self._conn.sendall(request)
                    kind, size = messages.read_head(self._conn, expected)
                    return decode(messages.read_body(self._conn, size))
                except (OSError, ConnectionError) as e:
                    self._dropped(e, warn)
                if warn:
                    break
        return _FAILED

    def _connect(self) -> None:
        if not os.path.exists(self.path):
            raise FileNotFoundError(self.path)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.settimeout(self.timeout)
        self._conn.connect(self.path)

    def _dropped(self, e: Exception, warn: bool) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if warn and not self._warned:
            self._warned = True
            log.warning("kdn: the worker's lookup server at %s did not answer (%s); the scheduler "
                        "asks its own tiers (a memory tier private to the worker is not seen)", self.path, e)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
