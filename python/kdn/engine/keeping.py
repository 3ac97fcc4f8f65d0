"""What an engine keeps, and how engines sharing a store tell each other what they compute: the
:class:`Keeping` half of :class:`kdn.engine.Engine` (holds, pins, retention, eviction, tier events and
read times, claims), over the engine's chunk reader/writer and tiers."""

from __future__ import annotations

import dataclasses

from kdn._core import InvalidInputError
from kdn.engine.retention import Retention
from kdn.engine.session import ModelSession


class Keeping:
    """The engine's methods over what its tiers keep (``self.chunks``, ``self.tiers``, ``self.config``:
    :class:`kdn.engine.Engine`'s)."""

    # -- claims: engines sharing a remote store tell each other which chunk each is computing ----
    def computing_keys(self, session: ModelSession, tokens, hit: int) -> list[bytes]:
        """The keys of the full chunks a prefill of ``tokens`` computes after a hit of ``hit``
        tokens, in order (empty: no remote store to tell, or no full chunk left)."""
        if self.chunks.remote is None:
            return []
        return session.prefix_keys(session.tokens(tokens))[hit // session.chunk_size:]

    def claim(self, keys: list[bytes], owner: str, ttl: float) -> bool | None:
        """Tell the engines sharing the remote store that ``owner`` computes the chunks ``keys`` for
        a lease of ``ttl`` seconds (the first decides: True if ``owner`` holds it, False if another
        owner's claim on it is live, None when the store cannot tell: compute then, never wait;
        :meth:`kdn.storage.remote.RemoteTier.claim`)."""
        return self.chunks.remote.claims.claim(keys[0], owner, ttl, also=keys[1:])

    def renew_claims(self, keys: list[bytes], owner: str, ttl: float) -> None:
        """Extend ``owner``'s leases on ``keys`` (claimed with :meth:`claim`) by ``ttl`` seconds."""
        if self.chunks.remote is not None:
            self.chunks.remote.claims.renew(keys, owner, ttl)

    # -- what is kept ---------------------------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        """Whether some tier holds the blob filed under ``key`` (in any coding); reads no KV."""
        return self.chunks.holds(key)

    def stored_bytes(self, key: bytes) -> int:
        """Size of the blob filed under ``key`` as the first tier holding it stores it, or 0."""
        return self.chunks.stored_bytes(key)

    def copy_to(self, other: Keeping, keys: list[bytes]) -> int:
        """File the blobs stored under ``keys`` into ``other``'s tiers, each read exactly and coded as
        ``other``'s own writes are (its codecs, its write policy); how many were held and filed."""
        held = ((key, self.tiers.fetch([key], exact=True)[0]) for key in keys)
        return sum(other.tiers.put(key, bytes(blobs[0])) for key, blobs in held if blobs)

    def pin(self, keys: list[bytes], ttl: float | None = None) -> int:
        """Promote the chunks ``keys`` into memory and keep them from eviction (``ttl`` seconds, or
        until unpinned); how many leading ones were pinned (a missing chunk ends the run)."""
        self.tiers.get_many(keys)
        n = 0
        while n < len(keys) and self.tiers.pin(keys[n], ttl or 0.0):
            n += 1
        return n

    def check_retention(self, session: ModelSession, tokens: int, retention: Retention) -> Retention:
        """What a request may keep of a prompt of ``tokens`` tokens: its pin cut to
        ``config.retain_max_seconds``, or an InvalidInputError when the memory tier's pins would then
        hold more than ``config.retain_fraction`` of it (its full chunks counted raw, an upper
        bound). A priority orders the tenant's own entries only, so it needs no bound."""
        if retention.seconds is None:
            return retention
        config, chunk = self.config, session.chunk_size
        need = tokens // chunk * chunk * session.layout.bytes_per_token()
        pinned, bound = self.tiers.memory.stats()["pinned_bytes"], config.retain_fraction * config.memory_bytes
        if pinned + need > bound:
            raise InvalidInputError(f"retain: refused: {need / 2**10:.0f} KiB more pinned would hold "
                                    f"{(pinned + need) / 2**10:.0f} KiB of memory, over the operator's bound of "
                                    f"{bound / 2**10:.0f} KiB (retain_fraction={config.retain_fraction:g} of "
                                    f"memory_bytes)")
        return dataclasses.replace(retention, seconds=min(retention.seconds, config.retain_max_seconds))

    def retain(self, session: ModelSession, tokens, retention: Retention) -> int:
        """Keep what a request asked (:meth:`check_retention`) of the stored full chunks of
        ``tokens``: pinned in memory for the seconds allowed, given its eviction priority in each
        local tier holding them; how many leading chunks were kept."""
        tokens = session.tokens(tokens)
        retention = self.check_retention(session, len(tokens), retention)
        keys = session.prefix_keys(tokens)
        kept = self.pin(keys, retention.seconds) if retention.seconds is not None else 0
        if retention.priority:
            kept = max(kept, self.tiers.prioritize(keys, retention.priority))
        return kept

    def record_tier_events(self, on: bool = True) -> None:
        """Log what the local tiers file and remove from now on (:meth:`take_tier_events`): the
        source of a face's KV events (a router's view of what this process holds)."""
        self.chunks.tiers.record_events(on)

    def take_tier_events(self) -> list[tuple[str, bool, bytes]]:
        """``[(tier, stored, address), ...]`` since the last call (:meth:`kdn.storage.TierManager.take_events`);
        an address is the chunk's key, or its lossy address (:meth:`addresses`)."""
        return self.chunks.tiers.take_events()

    def take_read_times(self) -> dict[str, list[float]]:
        """``{tier: [seconds, ...]}``: how long each batched read from each tier took since the last
        call (:meth:`kdn.storage.TierManager.take_reads`; a face's latency histograms)."""
        return self.chunks.tiers.take_reads()

    def addresses(self, key: bytes) -> list[bytes]:
        """Where the chunk ``key`` may be filed: the key itself, then the lossy addresses of the codecs
        this process stores or accepts (:meth:`kdn.storage.TierManager.addresses`)."""
        return self.chunks.tiers.addresses(key)

    def unpin(self, keys: list[bytes]) -> int:
        """Make the chunks ``keys`` evictable again; how many were pinned."""
        return sum(self.tiers.unpin(k) for k in keys)

    def evict(self, session: ModelSession, tokens, first: int = 0) -> int:
        """Remove the chunks of ``tokens`` (from chunk ``first`` on: a prefix other prompts share stays)
        and their pointers from every tier (the remote store too); how many chunks were held."""
        return self.chunks.remove(session, tokens, first)

    def clear(self) -> None:
        """Drop every stored chunk and pointer from every tier."""
        self.chunks.clear()
