"""The tier interface: the methods every tier delegates to its C++ store in the same way."""

from __future__ import annotations


class StoreTier:
    """Base of the tiers: ``put/get/contains/count_prefix/remove/pin/unpin/clear/stats`` over a C++
    store in ``self._store``. Subclasses state their threading and failure contract."""

    name = "tier"
    _store = None

    def put(self, key: bytes, blob) -> bool:
        return self._store.put(key, blob)

    def get(self, key: bytes):
        return self._store.get(key)

    def contains(self, key: bytes) -> bool:
        return self._store.contains(key)

    def count_prefix(self, keys: list[bytes]) -> int:
        """Number of leading ``keys`` present (the longest stored prefix, in chunks)."""
        return self._store.count_prefix(keys)

    def remove(self, key: bytes) -> bool:
        return self._store.remove(key)

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        """Keep ``key`` from eviction (for ``ttl_seconds`` if > 0); False if it is not stored."""
        return self._store.pin(key, ttl_seconds)

    def unpin(self, key: bytes) -> bool:
        return self._store.unpin(key)

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
