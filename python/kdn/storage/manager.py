"""Tier manager: longest-prefix lookup across memory, disk and remote; promotion, write policy, pins, stats."""

from __future__ import annotations

from kdn import codecs
from kdn._core import KDNError
from kdn.config import KDNConfig
from kdn.storage.disk import DiskTier
from kdn.storage.memory import MemoryTier


class TierManager:
    """Composes the tiers of a KDN: memory, then the local disk, then a remote store (each optional
    but memory).

    * ``count_prefix`` is the number of leading chunk keys held by *some* tier (the remote store is
      asked about the chunks the local tiers lack, in one round trip).
    * ``get_many`` returns the blobs of leading keys: memory, then disk (read in parallel), then
      remote (one pipelined round trip). Disk hits are promoted into memory; remote hits into
      memory and (unless memory-only) the disk.
    * ``put`` follows ``config.write_policy`` for the disk: write-through (queued for disk as
      stored in memory), write-back (disk receives what memory evicts) or memory-only. A remote
      store always gets an asynchronous write-through.
    * Each tier stores its own codec (``memory_codec``, ``disk_codec``, ``remote_codec``); blobs
      are self-describing, so any reader decodes any of them.
    * ``pin``/``unpin`` apply to the local tiers; ``remove``/``clear`` to every tier.

    Keys are chunk keys; ``fingerprint`` (the model's) namespaces them in the remote store.
    Thread-safe as its tiers are; never raises for I/O (tiers count failures instead).
    """

    def __init__(self, config: KDNConfig):
        self.config = config
        self.memory = MemoryTier(config.memory_bytes, config.memory_policy)
        self.disk = self.remote = None
        if config.disk_dir is not None:
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, config.disk_policy, config.disk_queue_bytes,
                                 config.disk_read_threads, config.disk_fsync, config.disk_codec)
            if config.write_policy == "write-back":
                self.memory.spill_to(self.disk)
        if config.remote_url is not None:
            from kdn.storage.remote import RemoteTier

            self.remote = RemoteTier(config.remote_url, config.remote_timeout, config.remote_ttl,
                                     config.remote_part_bytes, config.remote_queue_bytes, config.remote_retry_seconds,
                                     config.remote_codec)

    @property
    def local_tiers(self) -> list:
        return [t for t in (self.memory, self.disk) if t is not None]

    @property
    def tiers(self) -> list:
        return self.local_tiers + ([self.remote] if self.remote is not None else [])

    def contains_local(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.local_tiers)

    def count_prefix(self, keys: list[bytes], fingerprint: bytes) -> int:
        n = self.memory.count_prefix(keys)
        if self.disk is not None:
            while n < len(keys) and (self.memory.contains(keys[n]) or self.disk.contains(keys[n])):
                n += 1
        if self.remote is not None and n < len(keys):
            n += self.remote.count_prefix(keys[n:], fingerprint)
        return n

    def get_many(self, keys: list[bytes], fingerprint: bytes) -> list:
        """Blobs of the leading ``keys`` that are stored (stops at the first miss)."""
        blobs = []
        for key in keys:
            blob = self.memory.get(key)
            if blob is None:
                break
            blobs.append(blob)
        for lower in (self.disk, self.remote):
            rest = keys[len(blobs):]
            if lower is None or not rest:
                continue
            # hold memory's later chunks before promotions can evict them; rest[0] just missed
            held = [None] + [self.memory.get(k) for k in rest[1:]]
            missing = [k for k, b in zip(rest, held) if b is None]
            fetched = lower.get_many(missing) if lower is self.disk else lower.get_many(missing, fingerprint)
            found = dict(zip(missing, fetched))
            for key, blob in zip(rest, held):
                if blob is None:
                    blob = found[key]
                    if blob is None:
                        break
                    blob = self._promote(key, blob, from_remote=lower is self.remote)
                blobs.append(blob)
        return blobs

    def _promote(self, key: bytes, blob, from_remote: bool):
        """Copies a lower tier's hit into memory (re-coded to memory's codec, else the same bytes)
        and returns what memory now holds."""
        try:
            coded = codecs.encode(blob, self.config.memory_codec)
        except KDNError:  # a payload its checksum did not catch: the reader will report it
            return blob
        self.memory.put(key, coded)
        if from_remote and self.disk is not None and self.config.write_policy != "memory-only":
            self.disk.put(key, blob)
        return coded

    def put(self, key: bytes, blob) -> bool:
        """Store ``blob`` per the write policy; True if some tier holds it (or will: queued).
        Memory gets it in ``memory_codec`` now; disk and remote encode in their own threads."""
        in_memory = self.memory.put(key, codecs.encode(blob, self.config.memory_codec))
        stored = in_memory
        if self.disk is not None and self.config.write_policy != "memory-only":
            if self.config.write_policy == "write-through" or not in_memory:
                stored = self.disk.put(key, blob) or stored
        if self.remote is not None:
            stored = self.remote.put(key, blob) or stored
        return stored

    def remove(self, key: bytes, fingerprint: bytes) -> bool:
        removed = [t.remove(key) for t in self.local_tiers]
        if self.remote is not None:
            removed.append(self.remote.remove(key, fingerprint))
        return any(removed)

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        """Pin ``key`` in every local tier that holds it (KDN.pin promotes it into memory first)."""
        return any([t.pin(key, ttl_seconds) for t in self.local_tiers])

    def unpin(self, key: bytes) -> bool:
        return any([t.unpin(key) for t in self.local_tiers])

    def flush(self) -> None:
        for t in (self.disk, self.remote):
            if t is not None:
                t.flush()

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def stats(self) -> dict:
        return {t.name: t.stats() for t in self.tiers}
