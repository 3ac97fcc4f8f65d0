"""Local-disk tier: the C++ DiskStore behind the tier interface, with one warning per failure kind."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kdn import _core, codecs
from kdn._core import InvalidInputError
from kdn.storage.base import StoreTier, at_exit

log = logging.getLogger("kdn")


class DiskTier(StoreTier):
    """Blobs as files under ``directory``, bounded by ``capacity_bytes``; survives restarts.

    Contract (details in ``csrc/include/kdn/disk_store.h``):

    * Thread-safe; file I/O runs in C++ with the GIL released.
    * ``put`` queues the blob for a background writer and returns at once (write-behind); it is
      readable through ``get`` immediately. ``put(..., wait=True)`` writes synchronously.
    * Writes are atomic (temporary file, fsync, rename): readers in any process see a whole blob
      or none. Every read verifies the checksum and key; a damaged file is deleted and is a miss;
      a well-formed blob of another key (a keyed tenant's, read without its secret) is a miss,
      counted as ``foreign``, and never deleted.
    * Nothing another process wrote is deleted by opening the directory: files beyond
      ``capacity_bytes`` stay on disk unindexed (``stats()["unindexed"]``); only this process's
      writes evict. ``read_only`` (a reader that never writes the disk: ``write_policy="memory-only"``,
      ``kdn verify``): nothing is written or deleted but by ``remove`` and ``clear``.
    * Never raises for I/O: disk full, permission denied or a vanished directory make a write
      "not stored", counted in ``stats()["errors"]``; one warning per kind of failure is logged.
    * Blobs are written coded with ``codec`` (:mod:`kdn.codecs`), encoded by the background
      writer (or by ``put(..., wait=True)``); reads return them as stored.
    * Two processes may share a directory: each sees the other's files on lookup, and a file that
      another process evicted is a miss at once (the index re-checks a file before claiming it).
    * Trust: files 0600 and directories 0700 (``group_shared``: 0660 / 2770); a directory owned by
      another user is refused unless ``group_shared``; symlinks inside the tier are never
      followed. With ``mac_key`` (32 bytes) every file carries a keyed BLAKE3 tag that is
      verified on read, so a writer without the secret cannot make this tier serve its bytes.
    * ``flush()`` waits for queued writes; it also runs at interpreter exit.

    Example:
        >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
        >>> stored = cache.store(model, ids, model(ids, use_cache=True).past_key_values)
        >>> key = cache.chunk_keys(model, ids)[0]; blob = cache.memory.get(key)   # a stored chunk
        >>> tier = DiskTier("kdn-disk", 1 << 30)
        >>> tier.put(key, blob), tier.flush()
        (True, True)
        >>> DiskTier("kdn-disk", 1 << 30).contains(key)     # a new process finds it
        True
    """

    def __init__(self, directory: str, capacity_bytes: int, policy: str = "lru", queue_bytes: int = 512 << 20,
                 read_threads: int = 4, fsync: bool = True, codec: str = "raw", mac_key: bytes = b"",
                 group_shared: bool = False, read_only: bool = False, name: str = "disk"):
        self.name = name  # "node": the node's shared-memory tier (a tmpfs folder), same files
        c = codecs.parse(codec)
        self.codec = c.spec
        _check_owner(directory, group_shared)
        self._store = _core.DiskStore(str(directory), capacity_bytes, policy, queue_bytes, read_threads, fsync,
                                      c.id, c.params, mac_key, group_shared, read_only)
        self._warned: set[str] = set()
        at_exit(self, "flush")

    def keys(self):
        """Every key filed in the directory (files ``<shard>/<32 hex>.kdnb``; for offline audits)."""
        for path in Path(self.directory).glob("??/*.kdnb"):
            try:
                yield bytes.fromhex(path.name[:32])
            except ValueError:
                continue

    def put(self, key: bytes, blob, wait: bool = False) -> bool:
        ok = self._store.put(key, blob) if wait else self._store.put_async(key, blob)
        self._report()
        return ok

    def get_many(self, keys: list[bytes]) -> list:
        """Verified blobs of ``keys`` (None for each miss), read in parallel."""
        blobs = self._store.get_many(keys)
        self._report()
        return blobs

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes are on disk (at most ``timeout`` seconds); True if drained."""
        drained = self._store.flush(-1.0 if timeout is None else max(0.0, timeout))
        self._report()
        return drained

    def stats(self) -> dict:
        stats = self._store.stats()
        self._report(stats)
        return stats

    def _report(self, stats: dict | None = None) -> None:
        """Log one warning per kind of failure (errors, corrupt files, dropped writes)."""
        stats = stats or self._store.stats()
        for kind, what in (("errors", "file operations failed"), ("corrupt", "corrupt files were dropped"),
                           ("dropped", "writes were dropped because the write queue was full"),
                           ("rejected", "chunks were larger than the free disk-tier capacity")):
            if stats[kind] and kind not in self._warned:
                self._warned.add(kind)
                detail = f" (last error: {stats['last_error']})" if stats["last_error"] else ""
                log.warning("kdn disk tier %s: %d %s; those chunks are misses, generation goes on%s",
                            self.directory, stats[kind], what, detail)

    @property
    def directory(self) -> str:
        return self._store.directory


def _check_owner(directory, group_shared: bool) -> None:
    """A disk tier in another user's directory would serve what that user wrote: refuse it unless
    the tier is declared shared."""
    try:
        owner = os.stat(directory).st_uid
    except FileNotFoundError:
        return  # created by us
    except OSError as e:
        raise InvalidInputError(f"disk_dir {directory}: {e.strerror}") from None
    if owner != os.geteuid() and not group_shared:
        raise InvalidInputError(f"disk_dir {directory} belongs to uid {owner}, not to this user (uid {os.geteuid()}); "
                                "pass disk_shared=True to share a disk tier between users, ideally with a secret")

