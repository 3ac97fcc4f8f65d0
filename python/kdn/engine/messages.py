"""The typed messages of a serving engine's cross-process lookup channel (:mod:`kdn.engine.channel`)
and their one encoding. A frame is ``u8 version, u8 kind, u32 body bytes``, then the body; a reader
refuses a frame of another version, a kind it does not expect there, or a body over that kind's
bound before reading a byte of it (:func:`read_frame`). Integers are little-endian; keys 16 bytes.

- :class:`Lookup` (scheduler to worker): ``u32 limit, u8 scope bytes (0 or 16)``, the scope
  (:func:`kdn.keys.request_scope` of the request's salt, adapter and inputs), the token ids (u32 each).
- :class:`LookupAnswer`: ``u8 status`` (:data:`FOUND`, :data:`FAILED`: the worker could not look up,
  :data:`NOT_SERVING`: it refused the engine), ``u32`` leading tokens held, ``u32`` the last chunk's
  tokens, ``u32`` keys, the keys, a byte per key naming the fastest of the worker's tiers holding it
  (an index of :data:`HOLDERS`: a hit's ``CacheHitSource``), ``u32`` requests whose store has ended
  (landed, refused or failed: the scheduler waits no more for them), each its
  :func:`kdn.engine.requests.request_digest`.
- :class:`BlendQuery`: a prompt's piece keys (:mod:`kdn.engine.passages`), ``u32`` count first.
- :class:`Readiness` (its answer): ``u8`` 0 (the worker does not blend), 1 (its layers are not vouched
  for yet) or 2, ``u32`` the leading pieces its tiers hold, ``u32`` bytes of why it does not (UTF-8,
  at most :data:`MAX_WHY`), that text.
"""

from __future__ import annotations

import dataclasses
import socket
import struct

import numpy as np

from kdn.engine.chunks import Prefix
from kdn.engine.requests import ID_DIGEST_BYTES

VERSION = 1
FRAME = struct.Struct("<BBI")
KEY_BYTES = SCOPE_BYTES = 16
MAX_TOKENS = 1 << 22  # a lookup of more tokens is not a prompt's: its connection is dropped unread
MAX_PIECES = 1 << 16  # nor a blend query naming more pieces
MAX_ENDED = 4096  # ended stores a worker remembers for its scheduler, and one answer may carry
MAX_WHY = 1024
HOLDERS = ("", "memory", "node", "disk")  # a key's byte in an answer: "" a remote store's, or nobody's
FOUND, FAILED, NOT_SERVING = 0, 1, 2

_LOOKUP = struct.Struct("<IB")
_ANSWER = struct.Struct("<BIII")
_COUNT = struct.Struct("<I")
_READINESS = struct.Struct("<BII")


class ProtocolError(ConnectionError):
    """A frame that is not one of this channel's: another version, an unexpected kind, a body over
    its bound or not of its kind's shape. The connection it came on is dropped."""


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What the worker's tiers hold of ``tokens`` (at most ``limit`` of them) in ``scope``."""

    KIND = 1
    tokens: np.ndarray
    limit: int
    scope: bytes | None = None

    @staticmethod
    def bound() -> int:
        return _LOOKUP.size + SCOPE_BYTES + 4 * MAX_TOKENS

    def encode(self) -> bytes:
        scope = self.scope or b""
        return _LOOKUP.pack(self.limit, len(scope)) + scope + np.ascontiguousarray(self.tokens, np.uint32).tobytes()

    @classmethod
    def decode(cls, body: bytes) -> Lookup:
        limit, size = _unpack(_LOOKUP, body)
        rest = len(body) - _LOOKUP.size - size
        if size not in (0, SCOPE_BYTES) or rest < 0 or rest % 4:
            raise ProtocolError("a lookup with a scope not of 16 bytes or a partial token id")
        scope = body[_LOOKUP.size:_LOOKUP.size + size] or None
        return cls(np.frombuffer(body, dtype=np.uint32, offset=_LOOKUP.size + size), limit, scope)


@dataclasses.dataclass(frozen=True)
class LookupAnswer:
    """The worker's answer to a :class:`Lookup`: ``found`` (the keys of the chunks that serve the
    hit, which its load reads without looking again; None unless ``status`` is :data:`FOUND`) and
    the digests of the requests whose store ended since this connection was last told."""

    KIND = 2
    status: int
    found: Prefix | None = None
    ended: tuple = ()

    @staticmethod
    def bound() -> int:
        return _ANSWER.size + (KEY_BYTES + 1) * (MAX_TOKENS + 1) + _COUNT.size + ID_DIGEST_BYTES * MAX_ENDED

    def encode(self) -> bytes:
        found = self.found if self.status == FOUND else Prefix([], 0)
        holders = found.holders or ("",) * len(found.keys)
        return (_ANSWER.pack(self.status, found.tokens, found.last_tokens, len(found.keys)) + b"".join(found.keys)
                + bytes(HOLDERS.index(h) if h in HOLDERS else 0 for h in holders)
                + _COUNT.pack(len(self.ended)) + b"".join(self.ended))

    @classmethod
    def decode(cls, body: bytes, limit: int) -> LookupAnswer:
        """The answer in ``body`` to a lookup of at most ``limit`` tokens (its hit clamped to it)."""
        status, tokens, last_tokens, n = _unpack(_ANSWER, body)
        if status > NOT_SERVING or n > limit + 1:  # every key serves at least one token
            raise ProtocolError(f"a lookup answer of status {status} with {n} keys for at most {limit} tokens")
        at = _ANSWER.size + (KEY_BYTES + 1) * n
        if len(body) < at + _COUNT.size:
            raise ProtocolError("a lookup answer shorter than its keys")
        (count,) = _COUNT.unpack_from(body, at)
        if count > MAX_ENDED or len(body) != at + _COUNT.size + ID_DIGEST_BYTES * count:
            raise ProtocolError(f"a lookup answer naming {count} ended stores in {len(body)} bytes")
        keys = [body[_ANSWER.size + KEY_BYTES * i:_ANSWER.size + KEY_BYTES * (i + 1)] for i in range(n)]
        held = body[_ANSWER.size + KEY_BYTES * n:at]
        holders = tuple(HOLDERS[b] if b < len(HOLDERS) else "" for b in held)
        digests = body[at + _COUNT.size:]
        ended = tuple(digests[i:i + ID_DIGEST_BYTES] for i in range(0, len(digests), ID_DIGEST_BYTES))
        found = Prefix(keys, min(tokens, limit), last_tokens, holders) if status == FOUND else None
        return cls(status, found, ended)


@dataclasses.dataclass(frozen=True)
class BlendQuery:
    """Whether the worker blends a prompt of these piece keys, and how many of them, from the first,
    its tiers hold."""

    KIND = 3
    keys: tuple

    @staticmethod
    def bound() -> int:
        return _COUNT.size + KEY_BYTES * MAX_PIECES

    def encode(self) -> bytes:
        return _COUNT.pack(len(self.keys)) + b"".join(self.keys)

    @classmethod
    def decode(cls, body: bytes) -> BlendQuery:
        (n,) = _unpack(_COUNT, body)
        if len(body) != _COUNT.size + KEY_BYTES * n:
            raise ProtocolError(f"a blend query of {n} keys in {len(body)} bytes")
        return cls(tuple(body[_COUNT.size + KEY_BYTES * i:_COUNT.size + KEY_BYTES * (i + 1)] for i in range(n)))


@dataclasses.dataclass(frozen=True)
class Readiness:
    """What the worker holding the engine's layers answers for a prompt's pieces: whether it blends
    at all (``why`` not), whether a prefill has vouched for its layers, and how many of the pieces,
    from the first, its tiers hold."""

    KIND = 4
    blends: bool
    vouched: bool = False
    held: int = 0
    why: str | None = None

    @staticmethod
    def bound() -> int:
        return _READINESS.size + MAX_WHY

    def encode(self) -> bytes:
        why = (self.why or "").encode()[:MAX_WHY]
        return _READINESS.pack(2 if self.blends and self.vouched else int(self.blends), self.held, len(why)) + why

    @classmethod
    def decode(cls, body: bytes) -> Readiness:
        state, held, size = _unpack(_READINESS, body)
        if state > 2 or size > MAX_WHY or len(body) != _READINESS.size + size:
            raise ProtocolError("not a blend answer of kdn's channel")
        return cls(state > 0, state == 2, held, body[_READINESS.size:].decode(errors="replace") or None)


MESSAGES = {m.KIND: m for m in (Lookup, LookupAnswer, BlendQuery, Readiness)}


def _unpack(head: struct.Struct, body: bytes) -> tuple:
    if len(body) < head.size:
        raise ProtocolError(f"a body of {len(body)} bytes, shorter than its {head.size}-byte head")
    return head.unpack_from(body)


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = conn.recv(min(n - len(data), 1 << 20))
        if not part:
            raise ConnectionError("lookup connection closed")
        data += part
    return bytes(data)


def frame(message) -> bytes:
    """``message`` as it travels: its frame head, then its body."""
    body = message.encode()
    return FRAME.pack(VERSION, message.KIND, len(body)) + body


def read_head(conn: socket.socket, expected: tuple) -> tuple[type, int]:
    """The message class and body size of the next frame on ``conn``, one of ``expected``; raises
    :class:`ProtocolError` (nothing of the body read) for another version or kind or an oversized
    body, ConnectionError when the peer closed."""
    version, kind, size = FRAME.unpack(_read_exactly(conn, FRAME.size))
    if version != VERSION:
        raise ProtocolError(f"a frame of channel version {version}, this kdn speaks {VERSION} (two kdn "
                            "versions in one serving engine's processes?)")
    message = MESSAGES.get(kind)
    if message not in expected:
        raise ProtocolError(f"a frame of kind {kind} where {[m.__name__ for m in expected]} was expected")
    if size > message.bound():
        raise ProtocolError(f"a {message.__name__} of {size} bytes (at most {message.bound()})")
    return message, size


def read_body(conn: socket.socket, size: int) -> bytes:
    """The ``size`` bytes of a frame's body (after :func:`read_head`)."""
    return _read_exactly(conn, size)
