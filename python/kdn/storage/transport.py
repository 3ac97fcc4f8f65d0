"""Remote stores as transports: the small protocol the remote tier speaks to a store, and the
registry of URL schemes each transport serves.

The remote tier (:class:`kdn.storage.remote.RemoteTier`) owns everything kdn-specific about a
shared store: names, the split of large values into parts, keyed tags, the write queue, the circuit
breaker and the counters. A transport only moves named values. To add a remote store, write one
module with a :class:`RemoteTransport` subclass decorated with :func:`register` and name the module
in ``BUILTIN`` (or import it before building a ``KDN``).

Example:
    >>> from kdn.storage import transport
    >>> [s for s in transport.schemes() if "redis" in s or s == "unix"]   # kdn's own; a user's register too
    ['redis', 'rediss', 'redis+cluster', 'rediss+cluster', 'unix']
    >>> store = transport.open_transport("redis://127.0.0.1:6379/0", timeout=1.0)
    >>> store.put([("kdn:example", b"value")], ttl_ms=None)
    >>> [None if v is None else bytes(v) for v in store.get(["kdn:example", "kdn:absent"])]
    [b'value', None]
    >>> store.delete(["kdn:example"])
    1
"""

from __future__ import annotations

import abc
import importlib
import urllib.parse
from collections.abc import Iterator

from kdn._core import InvalidInputError
from kdn.urls import redact

BUILTIN = ("kdn.storage.redis_transport",)  # modules whose transports register themselves on import
_BY_SCHEME: dict[str, type] = {}


class RemoteTransport(abc.ABC):
    """Named byte values in a store shared by processes and machines.

    Contract:

    * Names are ``str``; values written are bytes-like; values read are bytes-like (``bytes``, a
      ``memoryview`` or a :class:`kdn._core.Buffer`), ``None`` where a name holds nothing.
    * Each call is **one round trip** for any number of names (pipelined), bounded by the timeout
      given at construction.
    * Calls raise on failure (any exception); the tier decides what a failure means, asking
      :meth:`classify`. Construction raises :class:`InvalidInputError` for a URL the transport
      cannot use; an unreachable server is not an error until a call is made (:meth:`ping`).
    * Thread-safe: the tier calls from its readers and its writer thread at once.

    * A store may be written by anyone: a transport never trusts a reply's size or count beyond
      what it asked. ``max_value_bytes`` (set by the tier: the largest value it writes) bounds what
      :meth:`get` reads of any one value; a transport that can (Redis: GETRANGE) reads at most one
      byte more, so a planted huge value costs that, and the tier counts it corrupt.

    Capabilities (class or instance attributes): ``supports_ranges`` (:meth:`get_ranges` reads byte
    ranges of values without reading the rest), ``supports_put_if_absent`` (:meth:`put_if_absent`
    is atomic), ``supports_compare_and_set`` (:meth:`put_if_unchanged` is atomic), ``cluster``
    (values are spread over nodes by name; names sharing a ``{tag}`` live together).
    """

    schemes: tuple[str, ...] = ()
    supports_ranges: bool = False
    supports_put_if_absent: bool = False
    supports_compare_and_set: bool = False
    cluster: bool = False
    max_value_bytes: int | None = None

    @abc.abstractmethod
    def ping(self) -> None:
        """Reach the store once (raises when it cannot be used)."""

    @abc.abstractmethod
    def exists(self, names: list[str]) -> list[bool]: ...

    @abc.abstractmethod
    def get(self, names: list[str]) -> list:
        """The value of each name, None where there is none."""

    def get_ranges(self, requests: list[tuple[str, int, int]]) -> list:
        """Bytes ``start..end`` (both inclusive; negative: from the value's end) of each
        ``(name, start, end)``; empty for a missing value. Only when ``supports_ranges``."""
        raise NotImplementedError(f"{type(self).__name__} cannot read byte ranges")

    @abc.abstractmethod
    def put(self, items: list[tuple[str, object]], ttl_ms: int | None) -> None:
        """Write each ``(name, value)`` in order (expiring after ``ttl_ms`` when given)."""

    def put_if_absent(self, name: str, value, ttl_ms: int) -> bool:
        """Write ``value`` under ``name`` (expiring after ``ttl_ms``) only if nothing is there, in
        one atomic step; whether it was written. Only when ``supports_put_if_absent``."""
        raise NotImplementedError(f"{type(self).__name__} cannot write if absent")

    def put_if_unchanged(self, name: str, digest: bytes, value, ttl_ms: int | None) -> bool:
        """Write ``value`` under ``name`` only if the value there now has SHA-256 ``digest``, in one
        atomic step (an honest write in between is never clobbered); whether it was written. Only
        when ``supports_compare_and_set``."""
        raise NotImplementedError(f"{type(self).__name__} cannot compare and set")

    def expiry(self, names: list[str]) -> list:
        """Milliseconds each name has left to live: -1 none (kept until evicted), -2 no such name,
        None where the store cannot tell (the default)."""
        return [None] * len(names)

    @abc.abstractmethod
    def delete(self, names: list[str]) -> int:
        """Delete the names; the number that existed."""

    @abc.abstractmethod
    def scan(self, pattern: str) -> Iterator[str]:
        """Every name matching a glob ``pattern`` (every node of a cluster; for audits and clear)."""

    def classify(self, error: Exception) -> str:
        """What a raised error means: ``"auth"`` (credentials refused), ``"refused"`` (the server
        answered and refused this command: out of memory, read-only, ...), or ``"down"``."""
        return "down"


def register(cls: type) -> type:
    """Class decorator: ``cls`` serves the URL schemes in ``cls.schemes``."""
    for scheme in cls.schemes:
        _BY_SCHEME[scheme] = cls
    return cls


def schemes() -> tuple[str, ...]:
    """Every URL scheme some transport serves."""
    for module in BUILTIN:
        importlib.import_module(module)
    return tuple(_BY_SCHEME)


def scheme_of(url: str) -> str:
    return urllib.parse.urlsplit(str(url)).scheme if "://" in str(url) else ""


def check_url(url: str, what: str = "remote_url") -> None:
    """Raise :class:`InvalidInputError` unless some transport serves the scheme of ``url``."""
    known = schemes()
    if scheme_of(url) not in known:
        raise InvalidInputError(f"{what}={redact(str(url))!r}: expected a URL with scheme {', '.join(known)} "
                                "(e.g. redis://127.0.0.1:6379/0)")


def open_transport(url: str, timeout: float, **options) -> RemoteTransport:
    """The transport serving ``url``'s scheme, connected lazily (``options`` go to it)."""
    check_url(url)
    return _BY_SCHEME[scheme_of(url)](url, timeout, **options)
