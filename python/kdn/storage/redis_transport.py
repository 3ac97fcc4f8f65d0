"""The Redis-protocol transport: Redis, Valkey or a Redis Cluster over TCP, TLS or a unix socket
(redis-py), with plain connections read into pooled Buffers and written from the values' own memory by
kdn's RESP client."""

from __future__ import annotations

import dataclasses
import logging
import threading
import urllib.parse
import uuid

from kdn import _core
from kdn._core import InvalidInputError
from kdn.storage.transport import RemoteTransport, register

log = logging.getLogger("kdn")


@register
class RedisTransport(RemoteTransport):
    """``redis://[user:password@]host:port[/db]``, ``rediss://`` for TLS, ``redis+cluster://host:port``
    (any node of the cluster; ``rediss+cluster://`` with TLS), ``unix:///path/to/socket``.

    Plain ``redis://`` and ``unix://`` URLs go through :class:`kdn._core.RespConnection` (each call
    under one deadline, replies bounded, a stream out of step refused): reads, writes, lookups,
    claims, expiries, deletes and pings; scans and compare-and-set repairs through redis-py
    (pooled connections, the hiredis parser when installed). ``Options(direct=False)``: everything
    through redis-py (its timeout bounds each receive); TLS and cluster URLs always are.
    """

    @dataclasses.dataclass(frozen=True)
    class Options:
        direct: bool = True  # plain redis:// and unix:// through kdn's RESP client (False: redis-py)
        # KV events: True lets kdn add the flags its removal watch needs to the server's
        # notify-keyspace-events (CONFIG SET: for a server this deployment owns); False (default)
        # only reads them, and without them announces just this process's own deletes, with a warning
        configure_events: bool = False

    schemes = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")
    supports_ranges = True
    supports_put_if_absent = True
    supports_compare_and_set = True
    supports_ttl = True

    def __init__(self, url: str, timeout: float, options: Options | None = None):
        options = options or self.Options()
        direct, self.configure_events = options.direct, options.configure_events
        try:
            import redis
            from redis.cluster import RedisCluster
        except ImportError:
            raise InvalidInputError("the remote tier needs redis-py: pip install 'kdn[redis]'") from None
        scheme = _check_url(url)
        self.cluster = scheme.endswith("+cluster")
        connect = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        if self.cluster:
            self.client = RedisCluster.from_url(url.replace("+cluster://", "://", 1), **connect)
        else:
            self.client = redis.Redis.from_url(url, retry_on_timeout=False, **connect)
        self._direct = _Direct(url, timeout) if direct and scheme in ("redis", "unix") else None

    @property
    def direct(self) -> bool:
        """Whether reads land straight in Buffers and writes leave from the values' memory (kdn's RESP
        client) rather than through redis-py."""
        return self._direct is not None

    def _pipeline(self, command: str, args: list) -> list:
        pipe = self.client.pipeline(transaction=False)
        for a in args:
            getattr(pipe, command)(*a)
        return pipe.execute()

    def ping(self) -> None:
        if self._direct is not None:
            self._direct.call("commands", [["PING"]])
            return
        self.client.ping()

    def exists(self, names: list[str]) -> list[bool]:
        if self._direct is not None:
            return [bool(x) for x in self._direct.call("commands", [["EXISTS", n] for n in names])]
        return [bool(x) for x in self._pipeline("exists", [(n,) for n in names])]

    def get(self, names: list[str]) -> list:
        # bounded: GETRANGE 0..max reads at most one byte more than the tier writes (an empty
        # reply is a missing name: kdn writes no empty values)
        limit = self.max_value_bytes
        if self._direct is not None:
            return self._direct.call("get_many", names, limit or 0)
        if limit is None:
            return self._pipeline("get", [(n,) for n in names])
        return [v or None for v in self._pipeline("getrange", [(n, 0, limit) for n in names])]

    def get_ranges(self, requests: list[tuple[str, int, int]]) -> list:
        if self._direct is not None:
            return [memoryview(v) for v in self._direct.call("get_ranges", requests)]
        return self._pipeline("getrange", requests)

    def put(self, items: list[tuple[str, object]], ttl_ms: int | None) -> None:
        if self._direct is not None:
            self._direct.call("set_many", items, ttl_ms or 0)
            return
        pipe = self.client.pipeline(transaction=False)
        for name, value in items:
            pipe.set(name, value, px=ttl_ms)
        pipe.execute()

    def put_if_absent(self, name: str, value, ttl_ms: int) -> bool:
        if self._direct is not None:
            reply = self._direct.call("commands", [["SET", name, bytes(value), "NX", "PX", str(ttl_ms)]])
            return reply[0] == "OK"
        return bool(self.client.set(name, value, nx=True, px=ttl_ms))

    def put_if_unchanged(self, name: str, digest: bytes, value, ttl_ms: int | None) -> bool:
        import hashlib

        from redis.exceptions import WatchError

        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(name)  # EXEC fails if anyone writes the name after this
                current = pipe.getrange(name, 0, self.max_value_bytes) if self.max_value_bytes else pipe.get(name)
                if current is None or hashlib.sha256(current).digest() != digest:
                    return False
                pipe.multi()
                pipe.set(name, value, px=ttl_ms)
                pipe.execute()
                return True
            except WatchError:
                return False

    def expiry(self, names: list[str]) -> list:
        if self._direct is not None:
            return [int(x) for x in self._direct.call("commands", [["PTTL", n] for n in names])]
        return [int(x) for x in self._pipeline("pttl", [(n,) for n in names])]

    def delete(self, names: list[str]) -> int:
        if not names:
            return 0
        if self._direct is not None:
            return sum(self._direct.call("commands", [["DEL", n] for n in names]))
        return sum(self._pipeline("delete", [(n,) for n in names]))

    def scan(self, pattern: str):
        for name in self.client.scan_iter(match=pattern, count=1000):
            yield name.decode() if isinstance(name, bytes) else name

    def classify(self, error: Exception) -> str:
        from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError

        if isinstance(error, (AuthenticationError, AuthorizationError)):
            return "auth"
        if isinstance(error, (ResponseError, _core.RespError)):  # the server answered: it refused this command
            text = str(error)
            return "auth" if "WRONGPASS" in text or "NOAUTH" in text or "invalid password" in text else "refused"
        return "down"

    def watch_removals(self, removed):
        """Redis keyspace notifications of evicted, expired and deleted names (one node's: None for a
        cluster). They need the server's ``notify-keyspace-events`` to hold ``Egex`` (or ``EA``):
        an operator's setting, which kdn changes only with ``Options(configure_events=True)``;
        without the flags (or when the server refuses CONFIG) None is returned, with a warning."""
        if self.cluster:
            log.warning("kdn remote tier: a Redis Cluster's evictions are not watched (one node's "
                        "notifications would miss the others'); removals there are not announced")
            return None
        try:
            flags = self.client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            wanted = set("Egex") - set(flags) - (set("gex") if "A" in flags else set())
            if wanted and not self.configure_events:
                log.warning("kdn remote tier: the server's notify-keyspace-events is %r, without %r: the store's "
                            "own evictions and expiries are not announced (set it on the server, or pass "
                            "remote_options={'configure_events': true} to let kdn set it)", flags,
                            "".join(sorted(wanted)))
                return None
            if wanted:
                self.client.config_set("notify-keyspace-events", flags + "".join(sorted(wanted)))
        except Exception as e:  # noqa: BLE001 - a managed server refusing CONFIG, a down one
            log.warning("kdn remote tier: the store's evictions cannot be watched (notify-keyspace-events "
                        "needs 'Egex': %s); removals there are not announced", e)
            return None
        return _RemovalWatch(self.client, removed)

    def close(self) -> None:
        """Close the pooled connections (a later call connects again)."""
        if self._direct is not None:
            self._direct.close()
        self.client.close()


def _check_url(url: str) -> str:
    """The scheme of a Redis URL whose port and database are usable; else one InvalidInputError."""
    from kdn.urls import redact

    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port outside [0, 65535] or not a number
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
        db = query.get("db", "0" if parts.scheme == "unix" else parts.path.strip("/") or "0")
        if not db.isdigit():
            raise ValueError(f"database {db!r} is not a number")
    except ValueError as e:
        raise InvalidInputError(f"remote_url {redact(url)!r}: {e}") from None
    return parts.scheme


class _Direct:
    """A pool of :class:`kdn._core.RespConnection` s for one plain URL (one per concurrent caller)."""

    def __init__(self, url: str, timeout: float):
        parts = urllib.parse.urlsplit(url)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parts.query).items()}
        if parts.scheme == "unix":
            self.where = (parts.path, -1)
            self.db = int(query.get("db", 0))
        else:
            self.where = (parts.hostname or "127.0.0.1", parts.port or 6379)
            self.db = int(query.get("db", parts.path.strip("/") or 0))
        self.user = urllib.parse.unquote(parts.username or "")
        self.password = urllib.parse.unquote(parts.password or "") or query.get("password", "")
        self.timeout = timeout
        self._idle: list = []
        self._lock = threading.Lock()

    def call(self, method: str, *args):
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None and not conn.in_step:  # unread bytes: a reply nobody asked for (dropped)
            conn = None
        if conn is None:
            conn = _core.RespConnection(*self.where, timeout=self.timeout, user=self.user, password=self.password,
                                        db=self.db)
        values = getattr(conn, method)(*args)  # an exception drops the connection with it
        with self._lock:
            self._idle.append(conn)
        return values

    def close(self) -> None:
        with self._lock:
            self._idle.clear()  # the connections close as they are freed


class _RemovalWatch:
    """A thread on a subscribed connection telling each name removed from one Redis database
    (``__keyevent@<db>__:evicted``, ``:expired``, ``:del``); it reconnects after a failure (what was
    removed meanwhile is not told). :meth:`sync` publishes a marker on a channel of its own and waits
    for it: Redis delivers one subscriber's messages in order, so every earlier removal is told."""

    def __init__(self, client, removed):
        db = client.connection_pool.connection_kwargs.get("db", 0)
        self._channels = [f"__keyevent@{db}__:{what}" for what in ("evicted", "expired", "del")]
        self._marker_channel = f"kdn:events:{uuid.uuid4().hex}"
        self._client, self._removed = client, removed
        self._marks: dict[str, threading.Event] = {}
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kdn-remote-removals", daemon=True)
        self._thread.start()
        self._subscribed.wait(5)

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(*self._channels, self._marker_channel)
                self._subscribed.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None or message.get("type") != "message":
                        continue
                    channel, data = (x.decode() if isinstance(x, bytes) else x
                                     for x in (message["channel"], message["data"]))
                    if channel == self._marker_channel:
                        if (mark := self._marks.pop(data, None)) is not None:
                            mark.set()
                    else:
                        self._removed(data)
            except Exception as e:  # noqa: BLE001 - a dropped connection: subscribe again
                self._subscribed.clear()
                if not warned and not self._stop.is_set():
                    warned = True
                    log.warning("kdn remote tier: the removals watch lost its connection (%s); reconnecting", e)
                self._stop.wait(1.0)
            finally:
                pubsub.close()

    def sync(self, timeout: float = 1.0) -> bool:
        """Wait until every removal the store made before this call has been told; whether it was
        (False at once while the watch is reconnecting)."""
        if not self._subscribed.is_set():
            return False
        token = uuid.uuid4().hex
        mark = self._marks.setdefault(token, threading.Event())
        try:
            self._client.publish(self._marker_channel, token)
        except Exception:  # noqa: BLE001 - a down store: nothing more will be told now
            self._marks.pop(token, None)
            return False
        return mark.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
