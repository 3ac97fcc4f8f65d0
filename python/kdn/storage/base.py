"""The tier protocol every tier implements alike (memory, disk, remote), and the helper base of the
tiers that sit on a C++ store."""

from __future__ import annotations

import abc
import atexit
import weakref

EXIT_FLUSH_SECONDS = 10.0  # at interpreter exit, queued and write-back data get this long to land


def at_exit(obj, method: str) -> None:
    """Call ``obj.<method>(EXIT_FLUSH_SECONDS)`` at interpreter exit, unless ``obj`` is gone by then
    (handlers run last-registered first: a manager's write-back before its disk tier's flush)."""
    ref = weakref.ref(obj)

    def run() -> None:
        target = ref()
        if target is not None:
            getattr(target, method)(EXIT_FLUSH_SECONDS)

    atexit.register(run)


class Tier(abc.ABC):
    """One storage tier of chunk blobs under 16-byte chunk keys (keys derive from the model
    fingerprint, so they carry the model's identity; every blob also names its model and key).

    Contract shared by all tiers: thread-safe; no method raises for I/O or capacity (failures are
    misses or "not stored", counted in ``stats()``); ``put`` may queue and return at once, what it
    queued is readable at once and written by ``flush``; a blob read back is verified.

    ``name`` (``"memory"``, ``"node"``, ``"disk"``, ``"remote"``) names it in ``stats()``; ``local`` tiers
    (this machine) follow the write policy and hold pins, a non-local tier is shared by machines
    and always written through; ``codec`` is the codec spec it stores blobs in.
    """

    name: str = "tier"
    local: bool = True
    codec: str = "raw"
    reads_sections: bool = False  # get_many(keys, sections) reads a blob's sections alone (DiskTier)

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool: ...

    def count_prefix(self, keys: list[bytes]) -> int:
        """Number of leading ``keys`` present (the longest stored prefix, in chunks)."""
        n = 0
        for present in self.present(keys):
            if not present:
                break
            n += 1
        return n

    def present(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored (one round trip for a remote tier)."""
        return [self.contains(k) for k in keys]

    @abc.abstractmethod
    def get_many(self, keys: list[bytes]) -> list:
        """Verified blobs of ``keys`` (None for each miss)."""

    @abc.abstractmethod
    def put(self, key: bytes, blob) -> bool:
        """Store (or queue) ``blob`` under ``key``; False if it is not stored."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> bool: ...

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        """Keep ``key`` from eviction (for ``ttl_seconds`` if > 0); False if not held or not pinnable."""
        return False

    def unpin(self, key: bytes) -> bool:
        return False

    def set_priority(self, key: bytes, priority: int) -> bool:
        """Order ``key`` among its owner's entries (lower leaves first); False if not held or not
        ordered here (a remote store evicts on its own)."""
        return False

    def set_quota(self, owner: int, bytes: int) -> None:
        """Bound the bytes of ``owner``'s blobs here (:meth:`kdn.storage.TierManager.set_quota`); a tier
        without per-owner accounting (a remote store) ignores it."""
        return None

    def record_events(self, on: bool) -> None:
        """Log every blob filed and removed here from now on (:meth:`take_events`); a tier that cannot
        tell logs nothing (a remote store logs what this process filed there and the removals the
        store tells: :mod:`kdn.storage.remote_events`)."""
        return None

    def take_events(self) -> list:
        """``[(stored, address), ...]`` since the last call, in order (``stored`` False: removed)."""
        return []

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes are done (at most ``timeout`` seconds); True if drained."""
        return True

    @abc.abstractmethod
    def stats(self) -> dict: ...

    @abc.abstractmethod
    def clear(self) -> None:
        """Drop every blob this tier holds."""

    def close(self) -> None:
        """Write what is queued and release what the tier holds open (a remote store's connection);
        a local tier may still be used, a remote one's later calls may fail (misses, not stored)."""
        self.flush()


class StoreTier(Tier):
    """A tier over a C++ store in ``self._store`` (kdn._core.MemoryStore or DiskStore)."""

    _store = None

    def put(self, key: bytes, blob) -> bool:
        return self._store.put(key, blob)

    def get(self, key: bytes):
        return self._store.get(key)

    def get_many(self, keys: list[bytes]) -> list:
        return [self._store.get(k) for k in keys]

    def contains(self, key: bytes) -> bool:
        return self._store.contains(key)

    def count_prefix(self, keys: list[bytes]) -> int:
        return self._store.count_prefix(keys)

    def remove(self, key: bytes) -> bool:
        return self._store.remove(key)

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        return self._store.pin(key, ttl_seconds)

    def unpin(self, key: bytes) -> bool:
        return self._store.unpin(key)

    def set_priority(self, key: bytes, priority: int) -> bool:
        return self._store.set_priority(key, priority)

    def set_quota(self, owner: int, bytes: int) -> None:
        self._store.set_quota(owner, bytes)

    def record_events(self, on: bool) -> None:
        self._store.record_events(on)

    def take_events(self) -> list:
        return self._store.take_events()

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict:
        return self._store.stats()

    @property
    def store(self):
        """The underlying ``kdn._core`` store."""
        return self._store

    @property
    def capacity_bytes(self) -> int:
        return self._store.capacity

    @property
    def used_bytes(self) -> int:
        return self._store.used_bytes

    def __len__(self) -> int:
        return len(self._store)
