"""Local-disk tier: the C++ DiskStore behind the tier interface, with one warning per failure kind."""

from __future__ import annotations

import logging
import os
import stat
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
    * Trust: files 0600 and directories 0700 (``group_shared``: 0660 / 2770). A folder another local
      user could have planted KV in is refused (reached through another user's symlink, below a
      folder another user owns or can write unless sticky, owned by another user unless
      ``group_shared``, writable by others: one of ours is narrowed to 0700 first); inside it,
      symlinks are never followed and a shard folder or file another user owns or can write is a
      miss. With ``mac_key`` (32 bytes) every file carries a keyed BLAKE3 tag that is
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
        _check_trust(directory, group_shared, read_only)
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

    reads_sections = True

    def get_many(self, keys: list[bytes], sections: list | None = None) -> list:
        """Verified blobs of ``keys`` (None for each miss), read in parallel. ``sections``: per key,
        None for the whole blob, or inclusive ranges ``(first, last)`` of its sections (section
        ``1 + 2 * layer`` holds a layer's K, the next its V) to read and verify alone, with its header
        and trailer: a ``partial`` blob, for its reader only (no tier stores it). A keyed store, or a
        blob still queued for writing, is read whole."""
        if sections is not None and any(sections):
            blobs = self._store.get_many(keys, [list(s) if s else [] for s in sections])
        else:
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


def _check_trust(directory, group_shared: bool, read_only: bool) -> None:
    """Refuse a tier folder another local user could have planted KV in (without a secret kdn cannot
    authenticate what it reads): reached through a symlink another user owns, below a folder another
    user owns or can write (a sticky one such as /tmp or /dev/shm is fine: no one renames what is
    ours there), owned by another user (unless ``group_shared``), or writable by anyone else (the
    group too unless shared). A folder of ours that others could write is narrowed to 0700 first,
    with a warning; the C++ store then reads no shard folder or file in it that is not ours."""
    me, path = os.geteuid(), os.path.abspath(directory)

    def refuse(why: str):
        raise InvalidInputError(f"disk tier {directory}: {why}; another local user could plant KV there, so kdn "
                                "does not read it (name a folder of yours, or pass disk_shared=True for a group "
                                "tier, ideally with a secret)")

    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):  # every component as named: a link is followed only if ours or root's
        named = os.sep.join(parts[:i]) or os.sep
        try:
            st = os.lstat(named)
        except FileNotFoundError:
            break
        except OSError as e:
            raise InvalidInputError(f"disk_dir {directory}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
            refuse(f"{named} is a symlink of uid {st.st_uid}")
    real = os.path.realpath(path)
    for parent in list(Path(real).parents)[::-1]:  # from / down: no one else may rename a folder on the way
        st = os.stat(parent)
        if st.st_uid not in (me, 0) and not group_shared:
            refuse(f"{parent} belongs to uid {st.st_uid}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX and not (
                group_shared and not st.st_mode & stat.S_IWOTH):
            refuse(f"{parent} is writable by other users and not sticky")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return  # made by the store, 0700
    if not stat.S_ISDIR(st.st_mode):
        refuse("it is not a directory")
    if st.st_uid != me and not group_shared:
        refuse(f"it belongs to uid {st.st_uid}, not to this user (uid {me})")
    wide = st.st_mode & (stat.S_IWOTH if group_shared else stat.S_IWGRP | stat.S_IWOTH)
    if wide and (st.st_mode & stat.S_ISVTX or st.st_uid != me or read_only):
        refuse(f"it is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")
    if wide:
        os.chmod(real, 0o2770 if group_shared else 0o700)
        log.warning("kdn disk tier %s was writable by other users (mode %o): narrowed to %o; what they put "
                    "there is not read", directory, stat.S_IMODE(st.st_mode), 0o2770 if group_shared else 0o700)
