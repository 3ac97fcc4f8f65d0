"""Host-memory tier: the C++ LRU store behind the tier interface."""

from __future__ import annotations

from kdn import _core


class MemoryTier:
    """Blobs in host memory, bounded by ``capacity_bytes``, least-recently-used out first.

    Contract: every method is thread-safe and non-blocking apart from one internal mutex (copies
    of blob bytes happen outside it, with the GIL released). ``get`` returns a shared read-only
    :class:`kdn._core.Buffer`; an entry evicted while a reader holds it stays valid for that reader.
    ``put`` never raises for capacity reasons: a blob larger than the whole tier is refused
    (returns False, counted as ``rejected``); otherwise LRU entries are evicted so that
    ``used_bytes`` never exceeds ``capacity_bytes``.

    Example:
        >>> tier = MemoryTier(1 << 20)
        >>> tier.put(b"k" * 16, b"blob bytes")
        True
        >>> bytes(tier.get(b"k" * 16))
        b'blob bytes'
    """

    name = "memory"

    def __init__(self, capacity_bytes: int):
        self._store = _core.MemoryStore(capacity_bytes)

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

    def clear(self) -> None:
        self._store.clear()

    def stats(self) -> dict:
        return self._store.stats()

    @property
    def capacity_bytes(self) -> int:
        return self._store.capacity

    @property
    def used_bytes(self) -> int:
        return self._store.used_bytes

    def __len__(self) -> int:
        return len(self._store)
