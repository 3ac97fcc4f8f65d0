"""Tier manager: a list of tiers behind one protocol; longest-prefix lookup, promotion, write policy, pins."""

from __future__ import annotations

import collections
import logging
import time

from kdn import _core, codecs
from kdn._core import InvalidInputError, KDNError
from kdn.config import KDNConfig
from kdn.storage.base import EXIT_FLUSH_SECONDS, Tier, at_exit
from kdn.storage.disk import DiskTier
from kdn.storage.memory import MemoryTier

log = logging.getLogger("kdn")
READ_TIMES = 4096  # the read times a tier keeps until taken (take_reads): a bound, not a sample


def build_tiers(config: KDNConfig) -> list[Tier]:
    """The tiers a config asks for, fastest first: memory, then the node's shared memory
    (``node_dir``), then the disk (``disk_dir``), then a remote store (``remote_url``)."""
    tiers: list[Tier] = [MemoryTier(config.memory_bytes, config.memory_policy, config.memory_codec)]
    if config.node_dir is not None:
        tiers.append(DiskTier(config.node_dir, config.node_bytes, config.memory_policy, config.disk_queue_bytes,
                              config.disk_read_threads, False, config.memory_codec, config.mac_key(),
                              config.disk_shared, read_only=config.write_policy == "memory-only", name="node"))
    if config.disk_dir is not None:
        tiers.append(DiskTier(config.disk_dir, config.disk_bytes, config.disk_policy, config.disk_queue_bytes,
                              config.disk_read_threads, config.disk_fsync, config.disk_codec, config.mac_key(),
                              config.disk_shared, read_only=config.write_policy == "memory-only"))
    if config.remote_url is not None:
        from kdn.storage.remote import RemoteTier  # needs redis-py only when asked for

        tiers.append(RemoteTier(config.remote_url, config.remote_timeout, config.remote_ttl, config.remote_part_bytes,
                                config.remote_queue_bytes, config.remote_retry_seconds, config.remote_codec,
                                config.mac_key(), config.delivery_levels, encrypt=config.encrypt,
                                options=dict(config.remote_options)))
    return tiers


class TierManager:
    """Composes a list of tiers (:func:`build_tiers`), fastest first; the first is the memory tier.

    * ``count_prefix`` is the number of leading chunk keys held by *some* tier (each lower tier is
      asked, in one call, about the chunks the tiers above it lack).
    * ``fetch`` / ``get_many`` return the blobs of leading keys: each tier is asked for what the
      tiers above it missed (a disk reads in parallel, a remote store in one pipelined round trip).
      A hit is promoted into memory (re-coded to memory's codec) and, unless the write policy is
      memory-only, into the local tiers above the one that held it.
    * ``put`` follows ``config.write_policy`` for the local tiers below memory: write-through
      (queued as stored in memory), write-back (they receive what memory evicts, and what memory
      holds at exit) or memory-only. A non-local (remote) tier always gets an asynchronous
      write-through.
    * Each tier stores its own codec (``memory_codec``, ``disk_codec``, ``remote_codec``); blobs
      are self-describing, so any reader decodes any of them.
    * Fidelity is part of the address: a chunk coded with a lossy codec is filed under its lossy
      key (:func:`kdn.codecs.address`), never under the exact key. Every lookup tries, per chunk,
      the exact key and then the lossy keys of :meth:`KDNConfig.lossy_codecs` (none by default),
      so a process never reads KV lossier than it accepts, whoever wrote the shared tiers.
    * ``pin``/``unpin`` apply to the local tiers; ``remove``/``clear`` to every tier.

    Thread-safe as its tiers are; never raises for I/O (tiers count failures instead).
    """

    def __init__(self, config: KDNConfig, tiers: list[Tier] | None = None):
        self.config = config
        self.lossy = config.lossy_codecs()
        self.tiers = tiers if tiers is not None else build_tiers(config)
        if not self.tiers or not isinstance(self.tiers[0], MemoryTier):
            raise InvalidInputError("TierManager: the first tier must be a MemoryTier")
        self.memory = self.tiers[0]
        self.served = {t.name: 0 for t in self.tiers}  # chunks each tier served to readers (fetch)
        # seconds of each batched read from each tier (fetch), the latest READ_TIMES per tier, until taken
        self._reads = {t.name: collections.deque(maxlen=READ_TIMES) for t in self.tiers}
        below = next((t for t in self.tiers[1:] if t.local), None)
        if below is not None and config.write_policy == "write-back":
            self.memory.spill_to(below)
            at_exit(self, "write_back")

    def tier(self, name: str):
        """The tier called ``name`` ("memory", "node", "disk", "remote"), or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def disk(self):
        return self.tier("disk")

    @property
    def remote(self):
        return self.tier("remote")

    @property
    def local_tiers(self) -> list[Tier]:
        return [t for t in self.tiers if t.local]

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

    def holders(self, keys: list[bytes]) -> list[str]:
        """Per key: the name of the fastest local tier holding it (under any of its addresses), or
        "" (a remote store's, or nobody's). Reads no data."""
        return [next((t.name for t in self.local_tiers if any(t.contains(a) for a in self.addresses(k))), "")
                for k in keys]

    def count_prefix(self, keys: list[bytes]) -> int:
        variants = [self.addresses(k) for k in keys]
        held = [False] * len(keys)
        n = 0
        for tier in self.tiers:
            if n == len(keys):
                break
            todo = [i for i in range(n, len(keys)) if not held[i]]
            flags = iter(tier.present([a for i in todo for a in variants[i]]))
            for i in todo:
                held[i] = any([next(flags) for _ in variants[i]])
            while n < len(keys) and held[n]:
                n += 1
        return n

    def held(self, keys: list[bytes]) -> list[bool]:
        """Per key: whether some tier holds a blob filed under exactly that key (no data is read)."""
        flags = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, flag in enumerate(flags) if not flag]
            if not todo:
                break
            for i, flag in zip(todo, tier.present([keys[i] for i in todo])):
                flags[i] = bool(flag)
        return flags

    def get_many(self, keys: list[bytes]) -> list:
        """Blobs of the leading ``keys`` that are stored (stops at the first miss)."""
        return self.fetch(keys)[0]

    def fetch(self, keys: list[bytes], exact: bool = False, local: bool = False,
              sections: list | None = None) -> tuple[list, list[bytes]]:
        """``(blobs, addresses)`` of the leading ``keys`` that are stored (stops at the first miss):
        each blob with the address it was found under (its header key; see :meth:`addresses`;
        ``exact``: the keys alone, for blobs that are never coded, such as pointers; ``local``:
        from this machine's tiers only, as layer-wise delivery does before it streams the rest).
        ``sections``: per key, None or the sections a reader needs of it: a tier that
        ``reads_sections`` reads those alone (a ``partial`` blob, never promoted into the tiers above).
        Keys derive from the model fingerprint; readers verify it in every blob."""
        variants = [[k] if exact else self.addresses(k) for k in keys]
        found: list = [None] * len(keys)  # (blob, address) per chunk
        source: list = [self.memory.name] * len(keys)  # the tier that served it
        for level, tier in enumerate(self.tiers):
            if local and not tier.local:
                continue
            lead = next((i for i, f in enumerate(found) if f is None), len(keys))
            if lead == len(keys):
                break
            if level > 0:  # hold memory's later chunks before promotions can evict them
                for i in range(lead + 1, len(keys)):
                    found[i] = found[i] or self._memory_get(variants[i])
            for v in range(len(variants[0]) if variants else 0):  # exact first, then each lossy codec
                todo = [i for i in range(lead, len(keys)) if found[i] is None]
                if not todo:
                    break
                wanted = [variants[i][v] for i in todo]
                began = time.perf_counter()
                if sections is not None and tier.reads_sections:
                    got = tier.get_many(wanted, [sections[i] for i in todo])
                else:
                    got = tier.get_many(wanted)
                self._reads[tier.name].append(time.perf_counter() - began)
                for i, address, blob in zip(todo, wanted, got):
                    if blob is not None:
                        kept = level == 0 or getattr(blob, "partial", False)  # a partial blob is its reader's alone
                        found[i] = (blob, address) if kept else self._promote(address, blob, v > 0, level)
                        source[i] = tier.name
        blobs, addresses = [], []
        for f, name in zip(found, source):
            if f is None:
                break
            blobs.append(f[0])
            addresses.append(f[1])
            if not exact:  # chunks, not pointers or calibrations
                self.served[name] += 1
        return blobs, addresses

    def take_reads(self) -> dict[str, list[float]]:
        """``{tier: [seconds, ...]}`` of the batched reads :meth:`fetch` made of each tier since the last
        call (at most ``READ_TIMES`` per tier, the latest), each tier's list emptied."""
        taken = {}
        for name, times in self._reads.items():
            taken[name] = [times.popleft() for _ in range(len(times))]
        return taken

    def _memory_get(self, addresses: list[bytes]):
        for address in addresses:
            blob = self.memory.get(address)
            if blob is not None:
                return blob, address
        return None

    def promote(self, address: bytes, blob, tier: str, lossy: bool) -> None:
        """Keep a verified chunk that ``tier`` served (a stream that read all of it) in the local
        tiers above it, as a hit of :meth:`fetch` would be; ``lossy``: it is filed under a lossy address."""
        self.served[tier] += 1
        self._promote(address, blob, lossy, next(i for i, t in enumerate(self.tiers) if t.name == tier))

    def _promote(self, address: bytes, blob, lossy: bool, level: int) -> tuple:
        """Copies a hit of tier ``level`` into memory and (unless memory-only) into the local tiers
        between; returns ``(what memory now holds, its address)``. The chunk is re-coded to memory's
        codec (a lossy one decoded to raw keeps its lossy address, which names the coding it went
        through), except that a lossy chunk is never re-coded with another lossy codec."""
        if self.config.write_policy != "memory-only":
            for tier in self.tiers[1:level]:
                if tier.local:
                    tier.put(address, blob)
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
        Memory gets it in ``memory_codec`` now; the other tiers encode in their own threads, each
        filing it under the address its codec gives (see :func:`kdn.codecs.address`)."""
        coded = codecs.encode(blob, self.config.memory_codec)
        in_memory = self.memory.put(codecs.key_of(coded) if coded is not blob else key, coded)
        stored = in_memory
        policy = self.config.write_policy
        for tier in self.tiers[1:]:
            if tier.local and (policy == "memory-only" or (policy == "write-back" and in_memory)):
                continue  # write-back: the tier receives memory's evictions instead
            stored = tier.put(key, blob) or stored
        return stored

    def remove(self, key: bytes) -> bool:
        """Drop ``key``'s chunk at every address this process reads, from every tier."""
        return any([self.drop(address) for address in self.addresses(key)])

    def drop(self, address: bytes) -> bool:
        """Drop what is filed under ``address`` (one of :meth:`addresses`) from every tier."""
        return any([t.remove(address) for t in self.tiers])

    def pin(self, key: bytes, ttl_seconds: float = 0.0) -> bool:
        """Pin ``key`` in every local tier that holds it (KDN.pin promotes it into memory first)."""
        return any([t.pin(a, ttl_seconds) for a in self.addresses(key) for t in self.local_tiers])

    def prioritize(self, keys: list[bytes], priority: int) -> int:
        """Give the chunks ``keys`` an eviction priority among their tenant's entries in every local
        tier holding them (lower leaves first; 0 the default); how many leading ones were held."""
        n = 0
        while n < len(keys) and any([t.set_priority(a, priority) for a in self.addresses(keys[n])
                                     for t in self.local_tiers]):
            n += 1
        return n

    def set_quota(self, fingerprint: bytes, quota: int | float) -> None:
        """Bound the bytes of the blobs written under ``fingerprint`` (a tenant's session) in each
        local tier: ``quota`` a fraction of the tier (float) or a byte count (capped at its size)."""
        owner = _core.owner_of_fingerprint(fingerprint)
        for tier in self.local_tiers:
            capacity = tier.stats()["capacity_bytes"]
            tier.set_quota(owner, max(1, int(quota * capacity)) if isinstance(quota, float) else min(quota, capacity))

    def record_events(self, on: bool) -> None:
        """Log what the tiers file and remove from now on (:meth:`take_events`): the local tiers all of
        it, the remote store what this process files there and its removals (:mod:`.remote_events`)."""
        for tier in self.tiers:
            tier.record_events(on)

    def take_events(self) -> list[tuple[str, bool, bytes]]:
        """``[(tier name, stored, address), ...]`` filed into or removed from (evicted, expired, dropped,
        cleared) the tiers since the last call, each tier's in order."""
        return [(tier.name, stored, address) for tier in self.tiers for stored, address in tier.take_events()]

    def unpin(self, key: bytes) -> bool:
        return any([t.unpin(a) for a in self.addresses(key) for t in self.local_tiers])

    def flush(self, timeout: float | None = None) -> None:
        """Wait for queued writes of every tier (at most ``timeout`` seconds in all)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.tiers:
            t.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def write_back(self, timeout: float = EXIT_FLUSH_SECONDS) -> int:
        """Write every memory entry to the first local tier below memory now (write-back keeps
        chunks only in memory until evicted); bounded by ``timeout`` seconds. Returns how many
        were written."""
        below = next((t for t in self.tiers[1:] if t.local), None)
        if below is None:
            return 0
        deadline, written = time.monotonic() + timeout, 0
        entries = self.memory.store.entries()
        for key, blob in entries:
            if time.monotonic() > deadline:
                log.warning("kdn: write-back at exit ran out of time; %d of %d memory chunks not written",
                            len(entries) - written, len(entries))
                break
            written += bool(below.put(key, blob, wait=True))
        return written

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def close(self) -> None:
        """Write what is queued in every tier and release the remote store's connection."""
        for t in self.tiers:
            t.close()

    def stats(self) -> dict:
        """Each tier's own counters, with ``served``: the chunks it served to readers."""
        return {t.name: {**t.stats(), "served": self.served[t.name]} for t in self.tiers}
