"""Local-disk tier: the C++ DiskStore behind the tier interface, with one warning per failure kind."""

from __future__ import annotations

import atexit
import logging
import weakref

from kdn import _core, codecs
from kdn.storage.base import StoreTier

log = logging.getLogger("kdn")


class DiskTier(StoreTier):
    """Blobs as files under ``directory``, bounded by ``capacity_bytes``; survives restarts.

    Contract (details in ``csrc/include/kdn/disk_store.h``):

    * Thread-safe; file I/O runs in C++ with the GIL released.
    * ``put`` queues the blob for a background writer and returns at once (write-behind); it is
      readable through ``get`` immediately. ``put(..., wait=True)`` writes synchronously.
    * Writes are atomic (temporary file, fsync, rename): readers in any process see a whole blob
      or none. Every read verifies the checksum and key; a corrupt file is deleted and is a miss.
    * Never raises for I/O: disk full, permission denied or a vanished directory make a write
      "not stored", counted in ``stats()["errors"]``; one warning per kind of failure is logged.
    * Blobs are written coded with ``codec`` (:mod:`kdn.codecs`), encoded by the background
      writer (or by ``put(..., wait=True)``); reads return them as stored.
    * Two processes may share a directory: each sees the other's files on lookup.
    * ``flush()`` waits for queued writes; it also runs at interpreter exit.

    Example:
        >>> tier = DiskTier("/tmp/kdn-disk", 1 << 30)
        >>> tier.put(key, blob); tier.flush()
        >>> DiskTier("/tmp/kdn-disk", 1 << 30).contains(key)     # a new process finds it
        True
    """

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, policy: str = "lru", queue_bytes: int = 512 << 20,
                 read_threads: int = 4, fsync: bool = True, codec: str = "raw"):
        c = codecs.parse(codec)
        self.codec = c.spec
        self._store = _core.DiskStore(str(directory), capacity_bytes, policy, queue_bytes, read_threads, fsync,
                                      c.id, c.params)
        self._warned: set[str] = set()
        atexit.register(_flush_at_exit, weakref.ref(self._store))

    def put(self, key: bytes, blob, wait: bool = False) -> bool:
        ok = self._store.put(key, blob) if wait else self._store.put_async(key, blob)
        self._report()
        return ok

    def get_many(self, keys: list[bytes]) -> list:
        blobs = self._store.get_many(keys)
        self._report()
        return blobs

    def flush(self) -> None:
        self._store.flush()
        self._report()

    def stats(self) -> dict:
        stats = self._store.stats()
        self._report(stats)
        return stats

    def _report(self, stats: dict | None = None) -> None:
        """Log one warning per kind of failure (errors, corrupt files, dropped writes)."""
        stats = stats or self._store.stats()
        for kind, what in (("errors", "writes failed"), ("corrupt", "corrupt files were dropped"),
                           ("dropped", "writes were dropped because the write queue was full"),
                           ("rejected", "chunks were larger than the free disk-tier capacity")):
            if stats[kind] and kind not in self._warned:
                self._warned.add(kind)
                detail = f" (last error: {stats['last_error']})" if stats["last_error"] else ""
                log.warning("kdn disk tier %s: %d %s; they are not stored, generation goes on%s",
                            self.directory, stats[kind], what, detail)

    @property
    def directory(self) -> str:
        return self._store.directory


def _flush_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        store.flush()
