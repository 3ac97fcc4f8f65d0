"""Tier manager: longest-prefix lookup across memory and disk, promotion, write policy, pins, stats."""

from __future__ import annotations

from kdn.config import KDNConfig
from kdn.storage.disk import DiskTier
from kdn.storage.memory import MemoryTier


class TierManager:
    """Composes the tiers of a KDN: memory first, then the local disk (if configured).

    * ``count_prefix`` is the number of leading chunk keys held by *some* tier.
    * ``get_many`` returns the blobs of leading keys, memory first, then disk (read in parallel);
      a disk hit is promoted into memory.
    * ``put`` follows ``config.write_policy``: write-through (memory, and queued for disk),
      write-back (memory; disk receives what memory evicts) or memory-only.
    * ``pin``/``unpin``/``remove``/``clear`` apply to every tier.

    Thread-safe as its tiers are; never raises for I/O (tiers count failures instead).
    """

    def __init__(self, config: KDNConfig):
        self.config = config
        self.memory = MemoryTier(config.memory_bytes, config.memory_policy)
        self.disk = None
        if config.disk_dir is not None:
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, config.disk_policy, config.disk_queue_bytes,
                                 config.disk_read_threads, config.disk_fsync)
            if config.write_policy == "write-back":
                self.memory.spill_to(self.disk)

    @property
    def tiers(self) -> list:
        return [t for t in (self.memory, self.disk) if t is not None]

    def contains(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def count_prefix(self, keys: list[bytes]) -> int:
        n = self.memory.count_prefix(keys)
        if self.disk is not None:
            while n < len(keys) and (self.memory.contains(keys[n]) or self.disk.contains(keys[n])):
                n += 1
        return n

    def get_many(self, keys: list[bytes]) -> list:
        """Blobs of the leading ``keys`` that are stored (stops at the first miss)."""
        blobs = []
        for key in keys:
            blob = self.memory.get(key)
            if blob is None:
                break
            blobs.append(blob)
        rest = keys[len(blobs):]
        if self.disk is not None and rest:
            # hold memory's later chunks before promotions can evict them; rest[0] just missed
            held = [None] + [self.memory.get(k) for k in rest[1:]]
            missing = [k for k, b in zip(rest, held) if b is None]
            from_disk = dict(zip(missing, self.disk.get_many(missing)))  # read in parallel
            for key, blob in zip(rest, held):
                if blob is None:
                    blob = from_disk[key]
                    if blob is None:
                        break
                    self.memory.put(key, blob)  # promotion; shares the bytes, no copy
                blobs.append(blob)
        return blobs

    def put(self, key: bytes, blob) -> bool:
        """Store ``blob`` per the write policy; True if some tier holds it."""
        in_memory = self.memory.put(key, blob)
        on_disk = False
        if self.disk is not None and (self.config.write_policy == "write-through" or not in_memory):
            on_disk = self.disk.put(key, blob) if self.config.write_policy != "memory-only" else False
        return in_memory or on_disk

    def remove(self, key: bytes) -> bool:
        return any([t.remove(key) for t in self.tiers])

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        """Pin ``key`` in every tier that holds it, promoting it into memory first (pinned = kept hot)."""
        if self.disk is not None and not self.memory.contains(key):
            blob = self.disk.get(key)
            if blob is not None:
                self.memory.put(key, blob)
        return any([t.pin(key, ttl_seconds) for t in self.tiers])

    def unpin(self, key: bytes) -> bool:
        return any([t.unpin(key) for t in self.tiers])

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def stats(self) -> dict:
        return {t.name: t.stats() for t in self.tiers}
