"""Remote stores as transports: the small protocol the remote tier speaks to a store, and the
registry of URL schemes each transport serves.

The remote tier (:class:`kdn.storage.remote.RemoteTier`) owns everything kdn-specific about a
shared store: names, the split of large values into parts, keyed tags, the write queue, the circuit
breaker and the counters. A transport only moves named values. To add a remote store, write one
module ``kdn/storage/<name>_transport.py`` with a :class:`RemoteTransport` subclass decorated with
:func:`register`: it is found by its file name (a transport outside kdn: an entry point in the
``kdn.transports`` group, or import it before building a ``KDN``). Its settings are a dataclass,
its ``Options``, filled from ``KDNConfig.remote_options`` (vLLM: ``kv_connector_extra_config``).

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
import dataclasses
import importlib
import importlib.metadata
import pkgutil
import types
import typing
import urllib.parse
from collections.abc import Callable, Iterator

from kdn._core import InvalidInputError
from kdn.urls import redact

ENTRY_POINTS = "kdn.transports"  # transports installed by other packages (name = module path)
_BY_SCHEME: dict[str, type] = {}
_found = False


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
    is atomic), ``supports_compare_and_set`` (:meth:`put_if_unchanged` is atomic), ``supports_ttl``
    (values written with ``ttl_ms`` expire, :meth:`expiry` tells: what claims need, so claims are
    off without it), ``supports_scan`` (:meth:`scan` lists names: offline audits), ``cluster``
    (values are spread over nodes by name; names sharing a ``{tag}`` live together).

    Settings: ``Options``, a dataclass (None: the transport takes none); :func:`open_transport`
    builds it from ``KDNConfig.remote_options`` and passes it as the third argument.
    """

    schemes: tuple[str, ...] = ()
    Options: type | None = None
    supports_ranges: bool = False
    supports_put_if_absent: bool = False
    supports_compare_and_set: bool = False
    supports_ttl: bool = False
    supports_scan: bool = True
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

    def scan(self, pattern: str) -> Iterator[str]:
        """Every name matching a glob ``pattern`` (every node of a cluster; for audits). Only when
        ``supports_scan``."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its names")

    def delete_matching(self, pattern: str) -> None:
        """Delete every name matching a glob ``pattern`` (``clear``): :meth:`scan` then :meth:`delete`
        unless the store does it itself."""
        names = list(self.scan(pattern))
        for i in range(0, len(names), 500):
            self.delete(names[i:i + 500])

    def watch_removals(self, removed: Callable[[str], None]):
        """Call ``removed(name)`` from a thread of the transport's for every name the store removes
        from now on, whoever removes it (evicted, expired, deleted), and return the watch (its
        ``sync(timeout)`` waits until what was removed before the call has been told; ``close()``);
        None when the store cannot tell (the default)."""
        return None

    def close(self) -> None:
        """Release the connection (a Mooncake client's segment, a socket); later calls may fail."""
        return None

    def classify(self, error: Exception) -> str:
        """What a raised error means: ``"auth"`` (credentials refused), ``"refused"`` (the server
        answered and refused this command: out of memory, read-only, ...), or ``"down"``."""
        return "down"


def register(cls: type) -> type:
    """Class decorator: ``cls`` serves the URL schemes in ``cls.schemes``."""
    for scheme in cls.schemes:
        _BY_SCHEME[scheme] = cls
    return cls


def _discover() -> None:
    """Import kdn's own transports (``kdn/storage/*_transport.py``) and those other packages name in
    the ``kdn.transports`` entry-point group, once: each registers its schemes on import."""
    global _found
    if _found:
        return
    _found = True
    import kdn.storage

    for module in pkgutil.iter_modules(kdn.storage.__path__):
        if module.name.endswith("_transport"):
            importlib.import_module(f"kdn.storage.{module.name}")
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        importlib.import_module(entry.value.split(":")[0])


def schemes() -> tuple[str, ...]:
    """Every URL scheme some transport serves."""
    _discover()
    return tuple(_BY_SCHEME)


def scheme_of(url: str) -> str:
    return urllib.parse.urlsplit(str(url)).scheme if "://" in str(url) else ""


def check_url(url: str, what: str = "remote_url") -> None:
    """Raise :class:`InvalidInputError` unless some transport serves the scheme of ``url``."""
    known = schemes()
    if scheme_of(url) not in known:
        raise InvalidInputError(f"{what}={redact(str(url))!r}: expected a URL with scheme {', '.join(known)} "
                                "(e.g. redis://127.0.0.1:6379/0)")


def open_transport(url: str, timeout: float, options: dict | None = None) -> RemoteTransport:
    """The transport serving ``url``'s scheme, connected lazily, with its ``Options`` built from
    ``options`` (:func:`build_options`)."""
    check_url(url)
    cls = _BY_SCHEME[scheme_of(url)]
    if cls.Options is None:
        if options:
            raise InvalidInputError(f"KDNConfig.remote_options: the {scheme_of(url)}:// transport takes no options, "
                                    f"got {sorted(options)}")
        return cls(url, timeout)
    return cls(url, timeout, build_options(cls, options or {}))


def build_options(cls: type, options: dict):
    """``cls.Options`` from a mapping of its fields (values may be the text forms of the environment
    and YAML: ``"64MiB"`` for an int field named ``*_bytes``, ``"true"`` for a bool); an unknown
    name or a value of the wrong kind is an :class:`InvalidInputError` naming the fields."""
    from kdn.config_sources import parse_bytes

    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    values = {}
    for name, value in options.items():
        if name not in fields:
            raise InvalidInputError(f"KDNConfig.remote_options: unknown option {name!r} of the {cls.schemes[0]}:// "
                                    f"transport; its options: {', '.join(fields) or 'none'}")
        kind = _kind(typing.get_type_hints(cls.Options)[name])
        try:
            if kind is int and name.endswith("_bytes"):
                value = parse_bytes(value, name)
            elif kind is bool and isinstance(value, str):
                if value.strip().lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError
                value = value.strip().lower() in ("1", "true", "yes", "on")
            elif kind in (int, float) and isinstance(value, str):
                value = kind(value)
            elif kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
                raise ValueError
        except (ValueError, InvalidInputError):
            raise InvalidInputError(f"KDNConfig.remote_options[{name!r}]={value!r}: expected {kind.__name__}") from None
        values[name] = value
    return cls.Options(**values)


def _kind(hint) -> type:
    """The plain type of a field's annotation (``int | None`` -> int)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
