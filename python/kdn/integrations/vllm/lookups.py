"""Lookups answered where the worker's tiers live: vLLM's server runs its scheduler and its worker
in different processes, and a process' memory tier is its own, so the scheduler asking its own
tiers never sees what the worker holds in memory. The worker serves lookups on a unix socket (in a
folder only its user can open); the scheduler asks it, and falls back to its own tiers when no
worker answers.

One request: ``u32 tokens, u32 limit, u32 scope bytes`` (``0xFFFFFFFF``: none, else 16), the scope
(:func:`kdn.keys.request_scope` of the request's salt, adapter and inputs), then the token ids (u32
each); the reply: ``i64`` leading tokens held (``-1``: the worker could not look up), ``u32`` the last
chunk's tokens, ``u32`` keys, the keys (16 bytes each), a byte per key naming the fastest of the
worker's tiers holding it (an index of ``HOLDERS``: a hit's ``CacheHitSource``), then ``u32``
requests whose store has ended
(landed, refused or failed: the scheduler waits no more for them), each the 16-byte
:func:`request_digest` of its id: the last ``MAX_ENDED`` the worker reported, each told once to
every connection (two clients of one worker do not take each other's).

A blend query (the scope's size ``0xFFFFFFFE``) asks instead, for a prompt's pieces (``tokens``: how
many 16-byte piece keys follow, :mod:`kdn.engine.passages`), whether the worker blends: the reply is
``u8`` 0 (it does not), 1 (its layers are not vouched for yet) or 2, ``u32`` the leading pieces its
tiers hold, ``u32`` bytes of why it does not (UTF-8, at most ``MAX_WHY``), then that text.

Trust: the socket's folder must be a real directory (not a symlink) owned by this user and closed to
others; one another local user created first is never used (a private folder in this user's home
is used instead, and a warning names the squatted one). Answers are clamped to the limit asked; a
connection that stays silent is dropped, and the server holds at most ``MAX_CONNECTIONS`` (a new
one closes the one idle longest: idle connections never lock the scheduler out); at most
``MAX_LARGE`` requests over ``LARGE_TOKENS`` tokens are read at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kdn.engine import Prefix
from kdn.engine.requests import ID_DIGEST_BYTES, request_digest
from kdn.integrations.vllm.blend import Readiness

log = logging.getLogger("kdn")

_REQUEST = struct.Struct("<III")
_NO_SCOPE = 0xFFFFFFFF
_BLEND_QUERY = 0xFFFFFFFE  # in the scope's place: a blend query (Readiness), its piece keys follow
_BLEND_REPLY = struct.Struct("<BII")  # 0 no / 1 unvouched / 2 vouched, leading pieces held, bytes of why
MAX_WHY = 1024
MAX_PIECES = 1 << 16  # a blend query naming more pieces is not a prompt's: the connection is dropped
SCOPE_BYTES = 16
_REPLY = struct.Struct("<qII")  # hit (-1: could not look up; _NOT_SERVING), the last chunk's tokens, keys that follow
_NOT_SERVING = -2  # the hit a worker that refused vLLM's KV layout answers: it will load and store nothing
MAX_TOKENS = 1 << 22  # a request asking about more tokens is not a prompt: the connection is dropped
LARGE_TOKENS, MAX_LARGE = 1 << 16, 2  # requests this long are read two at a time (bounded memory)
MAX_CONNECTIONS = 64  # a vLLM scheduler keeps one
MAX_ENDED = 4096  # ended stores a worker remembers for its scheduler, and one reply may carry
_COUNT = struct.Struct("<I")
IDLE_S = 600.0  # a connection silent this long is dropped (its client reconnects)
_warned_squat: set = set()
SOCKET_PATH_MAX = 107  # a Unix socket's path: sun_path's 108 bytes less the closing NUL
_FAILED = object()  # no answer (as opposed to the worker's "could not look up")
HOLDERS = ("", "memory", "node", "disk")  # a key's byte in a reply: "" a remote store's, or nobody's


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


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("lookup connection closed")
        data += part
    return bytes(data)


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
            self._answer(conn)
        with self._lock:
            self._conns.pop(conn, None)

    def _ended_since(self, told: int) -> tuple[list[bytes], int]:
        """The digests of stores ended after sequence number ``told``, and the last number."""
        with self._lock:
            for request_id in self._ended():
                self._seq += 1
                self._recent.append((self._seq, request_digest(request_id)))
            return [d for seq, d in self._recent if seq > told], self._seq

    def _read_request(self, conn: socket.socket):
        n, limit, size = _REQUEST.unpack(_read_exactly(conn, _REQUEST.size))
        if size == _BLEND_QUERY and n <= MAX_PIECES:
            keys = _read_exactly(conn, 16 * n)
            return [keys[16 * i:16 * i + 16] for i in range(n)], None, _BLEND_QUERY
        if n > MAX_TOKENS or size not in (_NO_SCOPE, SCOPE_BYTES):
            return None
        scope = None if size == _NO_SCOPE else _read_exactly(conn, size)
        if n <= LARGE_TOKENS:
            return np.frombuffer(_read_exactly(conn, 4 * n), dtype=np.uint32), limit, scope
        with self._large:
            return np.frombuffer(_read_exactly(conn, 4 * n), dtype=np.uint32), limit, scope

    def _answer(self, conn: socket.socket) -> None:
        told = 0
        while True:
            try:
                asked = self._read_request(conn)
            except (OSError, ConnectionError):
                return
            if asked is None:
                return
            tokens, limit, scope = asked
            with self._lock:
                if conn in self._conns:
                    self._conns[conn] = time.monotonic()
            if scope == _BLEND_QUERY:
                try:
                    conn.sendall(self._blend_reply(tokens))
                except OSError:
                    return
                continue
            try:
                if not self.serving:
                    raise WorkerNotServing
                found = self._lookup(tokens, limit, scope)
                reply = _REPLY.pack(found.tokens, found.last_tokens, len(found.keys)) + b"".join(found.keys)
                holders = found.holders or ("",) * len(found.keys)
                reply += bytes(HOLDERS.index(h) if h in HOLDERS else 0 for h in holders)
            except WorkerNotServing:
                reply = _REPLY.pack(_NOT_SERVING, 0, 0)
            except Exception as e:  # a failed lookup is a miss for the asker, never a dead server
                log.warning("kdn: a lookup for the scheduler failed (%s: %s)", type(e).__name__, e)
                reply = _REPLY.pack(-1, 0, 0)
            digests, told = self._ended_since(told)
            reply += _COUNT.pack(len(digests)) + b"".join(digests)
            try:
                conn.sendall(reply)
            except OSError:
                return

    def _blend_reply(self, keys: list[bytes]) -> bytes:
        try:
            ready = Readiness(False, why="the worker refused this engine's KV layout") if not self.serving \
                else self._readiness(keys)
        except Exception as e:  # a failed answer is "no blending" for the asker, never a dead server
            ready = Readiness(False, why=f"the worker's answer failed ({type(e).__name__}: {e})")
        why = (ready.why or "").encode()[:MAX_WHY]
        state = 2 if ready.blends and ready.vouched else int(ready.blends)
        return _BLEND_REPLY.pack(state, min(ready.held, len(keys)), len(why)) + why

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
        at most ``limit`` tokens: the keys
        of the chunks that serve them, which its load reads without looking again), or None when no
        worker answers or it could not look up. Raises :class:`WorkerNotServing` when the worker
        refused the engine."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        limit = max(0, min(int(limit), len(tokens)))
        if len(tokens) > MAX_TOKENS or (scope is not None and len(scope) != SCOPE_BYTES):
            return None
        scope = scope or b""
        request = _REQUEST.pack(len(tokens), limit, len(scope) if scope else _NO_SCOPE) + scope
        request += tokens.tobytes()
        with self._lock:
            if self._conn is not None:  # a kept connection the server dropped (idle): one more try
                hit = self._ask(request, limit, warn=False)
                if hit is not _FAILED:
                    return hit
            hit = self._ask(request, limit, warn=True)
            return None if hit is _FAILED else hit

    def readiness(self, keys: list[bytes]) -> Readiness | None:
        """Whether the worker blends a prompt of these piece keys, and how many of them, from the first,
        its tiers hold; None when no worker answers."""
        if len(keys) > MAX_PIECES or any(len(k) != 16 for k in keys):
            return Readiness(False, why=f"{len(keys)} pieces, or a key not of 16 bytes")
        request = _REQUEST.pack(len(keys), 0, _BLEND_QUERY) + b"".join(keys)
        with self._lock:
            for warn in (False, True):  # a kept connection the server dropped (idle): one more try
                try:
                    if self._conn is None:
                        self._connect()
                    self._conn.sendall(request)
                    state, held, size = _BLEND_REPLY.unpack(_read_exactly(self._conn, _BLEND_REPLY.size))
                    if size > MAX_WHY or state > 2:
                        raise ConnectionError("not a blend reply of kdn's server")
                    why = _read_exactly(self._conn, size).decode(errors="replace") or None
                    return Readiness(state > 0, state == 2, min(held, len(keys)), why)
                except (OSError, ConnectionError) as e:
                    self._dropped(e, warn)
        return None

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

    def _ask(self, request: bytes, limit: int, warn: bool):
        try:
            if self._conn is None:
                if not os.path.exists(self.path):
                    return _FAILED
                self._connect()
            self._conn.sendall(request)
            hit, last_tokens, n = _REPLY.unpack(_read_exactly(self._conn, _REPLY.size))
            if n > limit + 1:  # every key serves at least one token: not a reply of kdn's server
                raise ConnectionError(f"a lookup reply of {n} keys for at most {limit} tokens")
            keys = _read_exactly(self._conn, 16 * n)
            holders = tuple(HOLDERS[b] if b < len(HOLDERS) else "" for b in _read_exactly(self._conn, n))
            (count,) = _COUNT.unpack(_read_exactly(self._conn, _COUNT.size))
            if count > MAX_ENDED:
                raise ConnectionError(f"a lookup reply naming {count} ended stores")
            ended = _read_exactly(self._conn, ID_DIGEST_BYTES * count)
            self._ended += [ended[i:i + ID_DIGEST_BYTES] for i in range(0, len(ended), ID_DIGEST_BYTES)]
        except (OSError, ConnectionError) as e:
            self._dropped(e, warn)
            return _FAILED
        if hit == _NOT_SERVING:
            raise WorkerNotServing(f"the worker behind {self.path} refused this engine's KV layout")
        if hit < 0:
            return None
        return Prefix([keys[16 * i:16 * i + 16] for i in range(n)], min(hit, limit), last_tokens, holders)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
