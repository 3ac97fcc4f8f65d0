"""Host-memory tier: the C++ MemoryStore (LRU or S3-FIFO, pins) behind the tier interface."""

from __future__ import annotations

from kdn import _core, codecs
from kdn.storage.base import StoreTier


class MemoryTier(StoreTier):
    """Blobs in host memory, bounded by ``capacity_bytes``, evicted in ``policy`` order.

    Contract: every method is thread-safe and non-blocking apart from one internal mutex (copies
    of blob bytes happen outside it, with the GIL released). ``get`` returns a shared read-only
    :class:`kdn._core.Buffer`; an entry evicted while a reader holds it stays valid for that reader.
    ``put`` never raises for capacity reasons: a blob larger than the whole tier is refused
    (returns False, counted as ``rejected``); otherwise unpinned entries are evicted (``"lru"``:
    least recently used first; ``"s3fifo"``: scan-resistant S3-FIFO) so that ``used_bytes`` never
    exceeds ``capacity_bytes``. A pinned entry is never evicted until unpinned or its TTL ends.

    Example:
        >>> tier = MemoryTier(1 << 20)
        >>> tier.put(b"k" * 16, b"blob bytes")
        True
        >>> bytes(tier.get(b"k" * 16))
        b'blob bytes'
    """

    name = "memory"

    def __init__(self, capacity_bytes: int, policy: str = "lru", codec: str = "raw"):
        self.codec = codecs.parse(codec).spec
        self._store = _core.MemoryStore(capacity_bytes, policy)

    def spill_to(self, disk) -> None:
        """Hand evicted entries to ``disk`` (a DiskTier) for write-back; ``None`` stops it."""
        self._store.spill_to(disk.store if disk is not None else None)
