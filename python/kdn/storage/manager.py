"""Tier manager: longest-prefix lookup across memory, disk and remote; promotion, write policy, pins, stats."""

from __future__ import annotations

import atexit
import logging
import time
import weakref

from kdn import codecs
from kdn._core import KDNError
from kdn.config import KDNConfig
from kdn.storage.disk import DiskTier
from kdn.storage.memory import MemoryTier

log = logging.getLogger("kdn")
EXIT_FLUSH_SECONDS = 10.0  # at interpreter exit, queued and write-back data get this long to land


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
    * Fidelity is part of the address: a chunk coded with a lossy codec is filed under its lossy
      key (:func:`kdn.codecs.address`), never under the exact key. Every lookup tries, per chunk,
      the exact key and then the lossy keys of :meth:`KDNConfig.lossy_codecs` (none by default),
      so a process never reads KV lossier than it accepts, whoever wrote the shared tiers.
    * ``pin``/``unpin`` apply to the local tiers; ``remove``/``clear`` to every tier.

    Keys are chunk keys; ``fingerprint`` (the model's) namespaces them in the remote store.
    Thread-safe as its tiers are; never raises for I/O (tiers count failures instead).
    """

    def __init__(self, config: KDNConfig):
        self.config = config
        self.lossy = config.lossy_codecs()
        self.memory = MemoryTier(config.memory_bytes, config.memory_policy)
        self.disk = self.remote = None
        if config.disk_dir is not None:
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, config.disk_policy, config.disk_queue_bytes,
                                 config.disk_read_threads, config.disk_fsync, config.disk_codec, config.mac_key(),
                                 config.disk_shared)
            if config.write_policy == "write-back":
                self.memory.spill_to(self.disk)
                atexit.register(_write_back_at_exit, weakref.ref(self))
        if config.remote_url is not None:
            from kdn.storage.remote import RemoteTier

            self.remote = RemoteTier(config.remote_url, config.remote_timeout, config.remote_ttl,
                                     config.remote_part_bytes, config.remote_queue_bytes, config.remote_retry_seconds,
                                     config.remote_codec, config.mac_key())

    @property
    def local_tiers(self) -> list:
        return [t for t in (self.memory, self.disk) if t is not None]

    @property
    def tiers(self) -> list:
        return self.local_tiers + ([self.remote] if self.remote is not None else [])

    def addresses(self, key: bytes) -> list[bytes]:
        """Where ``key``'s chunk may be filed for this process: the exact key, then the lossy keys
        of the lossy codecs it accepts, in preference order."""
        return [key] + [codecs.address(key, c) for c in self.lossy]

    def _local_address(self, key: bytes):
        for address in self.addresses(key):
            if any(t.contains(address) for t in self.local_tiers):
                return address
        return None

    def contains_local(self, key: bytes) -> bool:
        return self._local_address(key) is not None

    def count_prefix(self, keys: list[bytes], fingerprint: bytes) -> int:
        if not self.lossy:  # one address per chunk: the tiers' own prefix counts
            n = self.memory.count_prefix(keys)
            if self.disk is not None:
                while n < len(keys) and (self.memory.contains(keys[n]) or self.disk.contains(keys[n])):
                    n += 1
            if self.remote is not None and n < len(keys):
                n += self.remote.count_prefix(keys[n:], fingerprint)
            return n
        n = 0
        while n < len(keys) and self._local_address(keys[n]) is not None:
            n += 1
        if self.remote is not None and n < len(keys):
            rest = [self.addresses(k) for k in keys[n:]]
            present = iter(self.remote.present([a for group in rest for a in group], fingerprint))
            for group in rest:
                if not any([next(present) for _ in group]):
                    break
                n += 1
        return n

    def get_many(self, keys: list[bytes], fingerprint: bytes) -> list:
        """Blobs of the leading ``keys`` that are stored (stops at the first miss)."""
        return self.fetch(keys, fingerprint)[0]

    def fetch(self, keys: list[bytes], fingerprint: bytes) -> tuple[list, list[bytes]]:
        """``(blobs, addresses)`` of the leading ``keys`` that are stored (stops at the first miss):
        each blob with the address it was found under (its header key; see :meth:`addresses`)."""
        variants = [self.addresses(k) for k in keys]
        found: list = [None] * len(keys)  # (blob, address) per chunk
        for tier in [self.memory, *(t for t in (self.disk, self.remote) if t is not None)]:
            lead = next((i for i, f in enumerate(found) if f is None), len(keys))
            if lead == len(keys):
                break
            if tier is not self.memory:  # hold memory's later chunks before promotions can evict them
                for i in range(lead + 1, len(keys)):
                    found[i] = found[i] or self._memory_get(variants[i])
            for v in range(len(variants[0]) if variants else 0):  # exact first, then each lossy codec
                todo = [i for i in range(lead, len(keys)) if found[i] is None]
                if not todo:
                    break
                wanted = [variants[i][v] for i in todo]
                if tier is self.memory:
                    blobs = [tier.get(a) for a in wanted]
                elif tier is self.disk:
                    blobs = tier.get_many(wanted)
                else:
                    blobs = tier.get_many(wanted, fingerprint)
                for i, address, blob in zip(todo, wanted, blobs):
                    if blob is not None:
                        found[i] = ((blob, address) if tier is self.memory
                                    else self._promote(address, blob, lossy=v > 0, from_remote=tier is self.remote))
        blobs, addresses = [], []
        for f in found:
            if f is None:
                break
            blobs.append(f[0])
            addresses.append(f[1])
        return blobs, addresses

    def _memory_get(self, addresses: list[bytes]):
        for address in addresses:
            blob = self.memory.get(address)
            if blob is not None:
                return blob, address
        return None

    def _promote(self, address: bytes, blob, lossy: bool, from_remote: bool) -> tuple:
        """Copies a lower tier's hit into memory; returns ``(what memory now holds, its address)``.
        The chunk is re-coded to memory's codec (a lossy one decoded to raw keeps its lossy address,
        which names the coding it went through), except that a lossy chunk is never re-coded with
        another lossy codec: it keeps its bytes and address."""
        if from_remote and self.disk is not None and self.config.write_policy != "memory-only":
            self.disk.put(address, blob)
        try:
            keep = lossy and codecs.parse(self.config.memory_codec).lossy
            coded = blob if keep else codecs.encode(blob, self.config.memory_codec)
        except KDNError:  # a payload its checksum did not catch: the reader will report it
            return blob, address
        if coded is not blob:
            address = codecs.key_of(coded)
        self.memory.put(address, coded)
        return coded, address

    def put(self, key: bytes, blob) -> bool:
        """Store ``blob`` per the write policy; True if some tier holds it (or will: queued).
        Memory gets it in ``memory_codec`` now; disk and remote encode in their own threads, each
        filing it under the address its codec gives (see :func:`kdn.codecs.address`)."""
        coded = codecs.encode(blob, self.config.memory_codec)
        in_memory = self.memory.put(codecs.key_of(coded) if coded is not blob else key, coded)
        stored = in_memory
        if self.disk is not None and self.config.write_policy != "memory-only":
            if self.config.write_policy == "write-through" or not in_memory:
                stored = self.disk.put(key, blob) or stored
        if self.remote is not None:
            stored = self.remote.put(key, blob) or stored
        return stored

    def remove(self, key: bytes, fingerprint: bytes) -> bool:
        """Drop ``key``'s chunk at every address this process reads, from every tier."""
        return any([self.drop(address, fingerprint) for address in self.addresses(key)])

    def drop(self, address: bytes, fingerprint: bytes) -> bool:
        """Drop what is filed under ``address`` (one of :meth:`addresses`) from every tier."""
        removed = [t.remove(address) for t in self.local_tiers]
        if self.remote is not None:
            removed.append(self.remote.remove(address, fingerprint))
        return any(removed)

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        """Pin ``key`` in every local tier that holds it (KDN.pin promotes it into memory first)."""
        return any([t.pin(a, ttl_seconds) for a in self.addresses(key) for t in self.local_tiers])

    def unpin(self, key: bytes) -> bool:
        return any([t.unpin(a) for a in self.addresses(key) for t in self.local_tiers])

    def flush(self, timeout: float | None = None) -> None:
        """Wait for queued disk writes and remote stores (at most ``timeout`` seconds in all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in (self.disk, self.remote):
            if t is not None:
                t.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def write_back(self, timeout: float = EXIT_FLUSH_SECONDS) -> int:
        """Write every memory entry the disk lacks to the disk now (write-back keeps chunks only in
        memory until evicted); bounded by ``timeout`` seconds. Returns how many were written."""
        if self.disk is None:
            return 0
        deadline, written = time.monotonic() + timeout, 0
        entries = self.memory.store.entries()
        for key, blob in entries:
            if time.monotonic() > deadline:
                log.warning("kdn: write-back at exit ran out of time; %d of %d memory chunks not written to disk",
                            len(entries) - written, len(entries))
                break
            written += bool(self.disk.put(key, blob, wait=True))
        return written

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def stats(self) -> dict:
        return {t.name: t.stats() for t in self.tiers}


def _write_back_at_exit(ref) -> None:
    manager = ref()
    if manager is not None:
        manager.write_back(EXIT_FLUSH_SECONDS)
