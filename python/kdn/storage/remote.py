"""Remote tier: KV blobs in a store shared by every process and machine (Redis, Valkey, a Redis
Cluster, or any :class:`~kdn.storage.transport.RemoteTransport`)."""

from __future__ import annotations

import collections
import hashlib
import logging
import threading

from kdn import _core, codecs
from kdn._core import BlobError, InvalidInputError
from kdn.storage.base import Tier, at_exit
from kdn.storage.breaker import Breaker
from kdn.storage.claims import Claims
from kdn.storage.remote_events import RemoteEvents
from kdn.storage.remote_queue import SendQueue
from kdn.storage.sealing import Sealer
from kdn.storage.transport import RemoteTransport, open_transport
from kdn.storage.values import MANIFEST_MAGIC, Values, part_names
from kdn.urls import redact

log = logging.getLogger("kdn")

FORMAT = 2  # bump when the key or value layout changes: old values become invisible, not misread
# (2: names carry the chunk key alone; it derives from the model fingerprint, and blobs name both)
_BAD_NAMES = 4096  # unverifiable values remembered for repair (their names and a digest)


class RemoteTier(Tier):
    """KV blobs in a shared store under ``kdn:<format>:{<chunk key>}``, through the transport that
    serves ``url``'s scheme (:mod:`kdn.storage.transport`; ``transport=`` gives one ready-made).

    Contract:

    * Thread-safe. Lookups (``count_prefix``, ``get_many``) are one pipelined round trip for any
      number of chunks (two when some value is split into parts), bounded by ``timeout``.
    * ``put`` never waits on the network: blobs go to a bounded queue (``queue_bytes``) that a
      background thread sends in pipelined batches, skipping keys already present; a full queue
      drops the blob and counts it.
    * Never raises after start-up: a down or slow store makes lookups miss and stores drop, counted
      in ``stats()``; a circuit breaker then skips the store (no caller waits on it) while a background
      thread probes it every ``retry_seconds``, and one warning is
      logged; calls resume by themselves when it is back. At start-up a bad URL or a refused
      password is an :class:`InvalidInputError` (an unreachable server is only a warning).
    * Values above ``part_bytes`` are split into parts stored under the same hash tag (one cluster
      slot) behind a manifest with the total size and checksum. Every value read is checked (blob
      checksum, key, format); one that fails is a miss, counted as ``corrupt`` (readers check the
      model fingerprint too).
    * ``ttl`` (seconds) expires values in the store; ``None`` keeps them until the store evicts.
    * ``levels``: lossy codec specs each stored chunk is also sent in, under its lossy address
      (:func:`kdn.codecs.address`), for bandwidth-adaptive delivery (:mod:`kdn.delivery`), which
      reads byte ranges of them (:meth:`read_ranges`) layer group by layer group, when the
      transport ``supports_ranges``.

    Example:
        >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
        >>> stored = cache.store(model, ids, model(ids, use_cache=True).past_key_values)
        >>> key = cache.chunk_keys(model, ids)[0]; blob = cache.memory.get(key)   # a stored chunk
        >>> tier = RemoteTier("redis://127.0.0.1:6379/0")
        >>> tier.put(key, blob), tier.flush()
        (True, True)
        >>> tier.count_prefix([key])
        1
    """

    name = "remote"
    local = False

    def __init__(self, url: str, timeout: float = 1.0, ttl: float | None = None, part_bytes: int = 16 << 20,
                 queue_bytes: int = 256 << 20, retry_seconds: float = 5.0, codec: str = "raw", mac_key: bytes = b"",
                 levels: tuple = (), transport: RemoteTransport | None = None, encrypt: bool = False,
                 options: dict | None = None):
        self.codec = codecs.parse(codec).spec
        self.levels = tuple(s for s in dict.fromkeys(codecs.parse(c).spec for c in levels) if s != self.codec)
        if mac_key and len(mac_key) != 32:
            raise InvalidInputError("remote tier: mac_key must be 32 bytes")
        self._mac_key = bytes(mac_key)
        self._values = Values(FORMAT, part_bytes, self._mac_key, Sealer(self._mac_key) if encrypt else None)
        self.url, self.ttl, self.part_bytes, self.queue_bytes = url, ttl, part_bytes, queue_bytes
        self.transport = transport if transport is not None else open_transport(url, timeout, options)
        if ttl is not None and not self.transport.supports_ttl:
            raise InvalidInputError(f"remote_ttl={ttl!r}: the {redact(url).split('://')[0]}:// store does not expire "
                                    "values (it evicts them itself); leave remote_ttl None")
        self.cluster = self.transport.cluster
        self.transport.max_value_bytes = part_bytes  # no value this tier writes is larger (part of the protocol)
        self._breaker = Breaker(url, retry_seconds, self._probe)
        self._stats = collections.Counter()
        self._bad_lock = threading.Lock()
        self._bad: dict[str, bytes] = {}  # name -> digest of an unverifiable value read there (to repair)
        self.claims = Claims(self.transport, f"kdn:{FORMAT}:", self._call, self._mac_key)  # who computes a chunk
        self._events: RemoteEvents | None = None  # what this process filed and the store removed (KV events)
        self._check_connection()
        self._queue = SendQueue(self._send, queue_bytes, self._breaker.allow)
        at_exit(self, "flush")

    # -- keys and values ------------------------------------------------------------------------
    def keys(self):
        """Every key this format files in the store (SCAN, for offline audits; raises on a failure,
        and InvalidInputError for a store that cannot list its names)."""
        if not self.transport.supports_scan:
            raise InvalidInputError(f"the {redact(self.url).split('://')[0]}:// store cannot list its keys "
                                    "(audit a disk tier, or a Redis store)")
        for name in self.transport.scan(f"kdn:{FORMAT}:{{*}}"):
            inner = name[name.index("{") + 1:name.index("}")]
            if len(inner) == 32:
                yield bytes.fromhex(inner)

    @staticmethod
    def redis_key(key: bytes) -> str:
        return f"kdn:{FORMAT}:{{{key.hex()}}}"

    def _decode(self, key: bytes, value):
        """A verified Buffer from a stored value (bytes, or the list of its parts), or None (counted as corrupt)."""
        try:
            return self._values.open(key, self.redis_key(key), value)
        except BlobError as e:
            return self._corrupt(key, str(e))

    def _corrupt(self, key: bytes, why: str):
        self._stats["corrupt"] += 1
        if self._stats["corrupt"] == 1:
            log.warning("kdn remote tier: unusable value for chunk %s (a miss): %s", key.hex(), why)
        return None

    def _probe(self) -> None:
        """The breaker's probe: a ping and a small read, through the path values take (a store that
        answers PING but drips its values stays skipped)."""
        self.transport.ping()
        self.transport.get([f"kdn:{FORMAT}:probe"])

    # -- guarded calls --------------------------------------------------------------------------
    def _call(self, fn, default):
        if not self._breaker.allow():
            self._stats["skipped"] += 1
            return default
        try:
            result = fn()
        except Exception as e:  # the transport's errors, socket errors: the store is unusable now
            self._stats["errors"] += 1
            kind = self.transport.classify(e)
            if kind == "auth":
                log.error("kdn remote tier %s: %s", redact(self.url), e)
            elif kind == "refused":  # the server answered: reachable, it refused this command (OOM, ACL, ...)
                self._stats["refused"] += 1
                if self._stats["refused"] == 1:
                    log.warning("kdn remote tier %s refused a command (%s); that store or read is skipped",
                                redact(self.url), e)
                return default
            self._breaker.failure(e)
            return default
        self._breaker.success()
        return result

    def _check_connection(self) -> None:
        try:
            self.transport.ping()
        except Exception as e:
            if self.transport.classify(e) == "auth":
                raise InvalidInputError(f"remote tier {redact(self.url)}: authentication failed ({e}); "
                                        "check the user and password in remote_url") from None
            self._stats["errors"] += 1
            self._breaker.failure(e)

    # -- tier interface -------------------------------------------------------------------------
    def present(self, keys: list[bytes]) -> list[bool]:
        """Whether each of ``keys`` is stored, in one pipelined round trip (all False when down)."""
        if not keys:
            return []
        return self._call(lambda: self.transport.exists([self.redis_key(k) for k in keys]), [False] * len(keys))

    def contains(self, key: bytes) -> bool:
        return self.present([key]) == [True]

    def get_many(self, keys: list[bytes]) -> list:
        """Verified blobs of ``keys`` (None for a miss), in one round trip (two if some are split).
        A value that is not one this tier wrote (too short, too large, a manifest out of bounds, a
        bad checksum or tag) is a miss of that chunk alone, counted as ``corrupt``."""
        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]

        def run():
            values = self.transport.get(names)
            raw = list(values)  # as stored under each name: what a repair compares against
            split = {}
            for i, v in enumerate(values):
                if v is not None and bytes(memoryview(v)[:4]) == MANIFEST_MAGIC:
                    parts = self._values.manifest(v)
                    if parts is None:
                        values[i] = b""  # not a manifest this tier writes: a corrupt miss, nothing more is read
                    else:
                        split[i] = parts
            if split:  # every part of every split value in one more round trip
                parts_of = {i: part_names(names[i], n) for i, (n, _) in split.items()}
                parts = iter(self.transport.get([p for ps in parts_of.values() for p in ps]))
                broken = []
                for i, ps in parts_of.items():
                    values[i] = self._values.join(split[i][1], [next(parts) for _ in ps])
                    if values[i] is None:  # a part was evicted: drop the value so the next store rewrites it
                        broken += [names[i], *ps]
                if broken:
                    self.transport.delete(broken)
                    self._stats["repaired"] += sum(values[i] is None for i in split)
            return values, raw

        values, raw = self._call(run, ([None] * len(keys),) * 2)
        blobs = []
        for key, name, value, stored in zip(keys, names, values, raw):
            blob = None
            if value is not None:
                blob = self._decode(key, value)
                if blob is None:
                    self._remember_bad(name, stored)
            self._stats["hits" if blob is not None else "misses"] += 1
            blobs.append(blob)
        return blobs

    def _remember_bad(self, name: str, value) -> None:
        """Remember an unverifiable value under ``name`` (a digest of it), so that this process'
        next store of that chunk replaces it if it is still there (:meth:`_send`)."""
        data = bytes(memoryview(value))
        with self._bad_lock:
            self._bad[name] = hashlib.sha256(data).digest()
            while len(self._bad) > _BAD_NAMES:
                self._bad.pop(next(iter(self._bad)))

    def put(self, key: bytes, blob, wait: bool = False) -> bool:
        """Queue ``blob`` for the store (``wait=True``: send it now); False if dropped."""
        del key  # the Redis key is the blob's key in this tier's codec (a lossy codec re-addresses it)
        if wait:
            return self._send([blob])
        if not self._queue.put(blob):  # a full queue, or the store skipped now
            self._stats["dropped"] += 1
            return False
        return True

    def _send(self, blobs: list) -> bool:
        # each blob in this tier's codec, then in each delivery level: (name, key, blob, codec) to send,
        # the first blob filed under each name (a pointer has one name in every codec)
        named: dict = {}
        for b in blobs:
            for c in (self.codec, *self.levels):
                k = codecs.stored_key(b, c)
                named.setdefault(self.redis_key(k), (k, b, c))
        todo = [(name, *item) for name, item in named.items()]

        def run():
            present = self.transport.exists([name for name, _, _, _ in todo])
            with self._bad_lock:
                bad = {name: self._bad.pop(name) for name, _, _, _ in todo if name in self._bad}
            items, repairs, filed = [], [], []
            for (name, key, blob, codec), there in zip(todo, present):
                repair = there and name in bad and self.transport.supports_compare_and_set
                coded = None if there and not repair else self._coded(blob, codec)  # only what the store lacks
                if coded is None:
                    continue
                values = self._values.seal(coded, key, name)
                items += list(zip(part_names(name, len(values) - 1), values[1:]))  # parts before their manifest
                if repair:  # replaces the unverifiable value only if it is still the one read
                    repairs.append((name, bad[name], values[0]))
                else:
                    items.append((name, values[0]))
                filed += [key] if codec == self.codec else []
            if items:
                self.transport.put(items, self._ttl_ms())
            for name, digest, value in repairs:
                self._stats["replaced"] += self.transport.put_if_unchanged(name, digest, value, self._ttl_ms())
            if self._events is not None:
                self._events.filed(filed)
            return len(filed)

        sent = self._call(run, None)
        if sent is None:
            self._stats["dropped"] += len(blobs)
            return False
        self._stats["puts"] += sent
        return True

    @property
    def range_readable(self) -> bool:
        """Whether values can be read in byte ranges (the transport can, and not in keyed mode: a
        tag covers a whole value)."""
        return self.transport.supports_ranges and not self._values.keyed

    def read_ranges(self, requests: list) -> list | None:
        """Byte ranges of stored values in one pipelined round trip: ``(key, start, end)`` per range,
        both inclusive as in GETRANGE (negative: from the value's end). Returns the bytes of each
        (``b""`` for a missing value), or None when the store cannot be used now (counted like any
        failed call). A value split into parts reads as its manifest (``KDNM``): callers fall back
        to :meth:`get_many` for it. Nothing is verified here: readers check the section sums."""
        if not requests:
            return []
        return self._call(lambda: self.transport.get_ranges([(self.redis_key(k), s, e) for k, s, e in requests]), None)

    @staticmethod
    def whole_value(prefix: bytes) -> bool:
        """Whether a value whose first bytes :meth:`read_ranges` returned as ``prefix`` is one blob
        (ranges of it are ranges of the blob), not the manifest of a value split into parts."""
        return prefix[:4] != MANIFEST_MAGIC

    def count_streamed(self, hits: int) -> None:
        """Counts chunks a delivery stream read in ranges (:meth:`read_ranges`) as hits."""
        self._stats["hits"] += hits

    def _coded(self, blob, codec: str):
        """``blob`` in ``codec`` (encoding releases the GIL), or None (counted) if it cannot be."""
        try:
            return codecs.encode(blob, codec)
        except _core.KDNError as e:
            self._stats["dropped"] += 1
            self._stats["encode_errors"] += 1
            if self._stats["encode_errors"] == 1:
                log.warning("kdn remote tier cannot encode a chunk with %s (not sent): %s", codec, e)
            return None

    def _ttl_ms(self):
        return max(1, round(self.ttl * 1000)) if self.ttl else None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued blobs have been sent (or dropped) and the store's removals logged (events
        on); True if the queue drained."""
        drained = self._queue.wait_sent(timeout)
        if self._events is not None:
            self._events.sync()
        return drained

    def record_events(self, on: bool) -> None:
        """Log the blobs this process files here and their removal by anyone (:mod:`.remote_events`)."""
        if self._events is not None:
            self._events.close()
        self._events = RemoteEvents(self.transport) if on else None

    def take_events(self) -> list:
        return self._events.take() if self._events is not None else []

    def close(self) -> None:
        self.flush()
        self.record_events(False)
        self.transport.close()

    def remove(self, key: bytes) -> bool:
        name = self.redis_key(key)

        def run():
            manifest = self.transport.get([name])[0]
            names = [name]
            split = self._values.manifest(manifest) if manifest is not None else None
            if split is not None:
                names += part_names(name, split[0])
            return self.transport.delete(names) > 0

        if (removed := bool(self._call(run, False))) and self._events is not None:
            self._events.removed(key)
        return removed

    def clear(self) -> None:
        """Delete every kdn value of this format from the store (all nodes of a cluster)."""

        self._call(lambda: self.transport.delete_matching(f"kdn:{FORMAT}:*"), None)
        if self._events is not None:
            self._events.cleared()

    def stats(self) -> dict:
        queued, queued_bytes = self._queue.waiting()
        return {"hits": self._stats["hits"], "misses": self._stats["misses"], "puts": self._stats["puts"],
                "dropped": self._stats["dropped"], "errors": self._stats["errors"],
                "corrupt": self._stats["corrupt"], "skipped": self._stats["skipped"],
                "refused": self._stats["refused"], "repaired": self._stats["repaired"],
                "replaced": self._stats["replaced"], "bad_claims": self.claims.bad,
                "queued_entries": queued, "queued_bytes": queued_bytes, "state": self._breaker.state,
                "url": redact(self.url), "cluster": self.cluster}

