"""The chunk reader/writer: keys -> tiers -> verify -> decode -> a target layout, and back.

Every reader of stored KV goes through :class:`ChunkIO`, so a corrupt, foreign or undecodable
chunk is handled in one place: it ends the hit before it, is dropped from the tiers, and is
logged once; it is never served.
"""

from __future__ import annotations

import logging

import torch

from kdn import _core
from kdn._core import BlobError, InvalidInputError
from kdn.engine.session import ModelSession
from kdn.layout import empty_kv_list
from kdn.storage import TierManager

log = logging.getLogger("kdn")


class HFTarget:
    """Decodes chunks into HF's per-layer KV tensors (``2 * layers`` of ``[1, kv_heads, n, head_dim]``,
    K then V per layer), on ``device`` (CPU decode, then one copy to the device)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def receive(self, session: ModelSession, blobs: list, num_tokens: int) -> list[torch.Tensor]:
        """The first ``num_tokens`` tokens of the verified ``blobs`` in this target's layout."""
        kv = empty_kv_list(session.layout, num_tokens)
        _core.unpack_chunks(blobs, kv, num_tokens)  # decodes coded chunks; BlobError if one cannot be
        if self.device.type != "cpu":
            kv = [t.to(self.device, non_blocking=True) for t in kv]
        return kv


class ChunkIO:
    """Reads and writes a model's chunks through a :class:`~kdn.storage.TierManager`.

    Thread-safe as the tiers are. Never raises for storage faults: what cannot be read is a miss,
    what cannot be written is reported (and the count of retrievable tokens says so).

    Example:
        >>> io = ChunkIO(TierManager(KDNConfig()))
        >>> io.write(session, keys, kv)               # kv: 2 * layers tensors [1, heads, >= n, dim]
        >>> kv, hit = io.read(session, keys, limit=n - 1)
    """

    def __init__(self, tiers: TierManager):
        self.tiers = tiers

    # -- prefix chunks --------------------------------------------------------------------------
    def available(self, session: ModelSession, keys: list[bytes]) -> int:
        """Leading chunks of ``keys`` held by some tier (no data is read)."""
        return self.tiers.count_prefix(keys)

    def read(self, session: ModelSession, keys: list[bytes], limit: int, target: HFTarget | None = None):
        """``(kv, hit)``: the KV of the longest stored prefix of ``keys``, at most ``limit`` tokens,
        in ``target``'s layout (default HF per-layer tensors on the CPU); ``(None, 0)`` on a miss."""
        chunk = session.chunk_size
        wanted = min(self.available(session, keys), -(-limit // chunk))
        # may stop early (evicted since the count); addresses: exact keys, or accepted lossy ones
        blobs, addresses = self.tiers.fetch(keys[:wanted])
        layout = session.layout
        n_ok, error = _core.verify_chunks(blobs, addresses, session.fingerprint, layout.dtype, layout.layers,
                                          layout.kv_heads, layout.head_dim, chunk)
        if error:
            log.warning("kdn: dropping an unusable stored chunk (treated as a miss): %s", error)
            self.tiers.drop(addresses[n_ok])
        hit = min(n_ok * chunk, limit)
        if hit == 0:
            return None, 0
        used = -(-hit // chunk)
        try:
            return (target or HFTarget()).receive(session, blobs[:used], hit), hit
        except BlobError as e:  # a coded payload that its checksum did not catch: a miss, never wrong KV
            log.warning("kdn: dropping undecodable stored chunks (treated as a miss): %s", e)
            for address in addresses[:used]:
                self.tiers.drop(address)
            return None, 0

    def write(self, session: ModelSession, keys: list[bytes], kv: list[torch.Tensor]) -> int:
        """Store the chunks of ``keys`` from ``kv`` (CPU per-layer tensors holding at least
        ``len(keys) * chunk_size`` tokens); chunks already held are skipped. Returns the leading
        tokens a :meth:`read` can now serve, with one warning when that is fewer than were given."""
        chunk = session.chunk_size
        written = 0
        for i, key in enumerate(keys):
            if not self.tiers.contains_local(key):
                blob = _core.pack_chunk(kv, i * chunk, chunk, session.fingerprint, key)
                if not self.tiers.put(key, blob):
                    log.warning("kdn: chunk of %d bytes fits no tier (pinned entries hold the space?); not stored",
                                len(blob))
                    break
            written += chunk
        retrievable = self.available(session, keys[: written // chunk]) * chunk
        if retrievable < written:  # the prompt's tail evicted its own head
            log.warning("kdn: stored %d tokens but only the first %d can be retrieved: the prompt's KV is larger "
                        "than the tiers hold (memory_bytes=%d; add a disk tier or raise memory_bytes)",
                        written, retrievable, self.tiers.config.memory_bytes)
        return retrievable

    def remove(self, session: ModelSession, keys: list[bytes]) -> int:
        """Drop the chunks of ``keys`` from every tier; returns how many were held."""
        return sum(self.tiers.remove(k) for k in keys)

    # -- segments (blending) --------------------------------------------------------------------
    def read_segment(self, session: ModelSession, key: bytes, position: int, tokens: int):
        """The stored KV of a segment (``tokens`` long, computed at ``position``) as CPU per-layer
        tensors, or None (a miss; an unusable blob is dropped and logged)."""
        blobs, addresses = self.tiers.fetch([key])
        if not blobs:
            return None
        blob = blobs[0]
        try:
            h = _core.blob_parse(blob, verify_checksum=not getattr(blob, "verified", False))
            if (h["fingerprint"], h["key"], h["tokens"], h["position"]) != (session.fingerprint, addresses[0],
                                                                            tokens, position):
                raise BlobError("segment blob header does not match the request")
            return HFTarget().receive(session, [blob], tokens)
        except (BlobError, InvalidInputError) as e:
            self.tiers.drop(addresses[0])
            log.warning("kdn: dropping an unusable stored segment (a miss): %s", e)
            return None

    def write_segment(self, session: ModelSession, key: bytes, kv: list[torch.Tensor], position: int,
                      tokens: int) -> bool:
        """Store a segment's KV: ``kv`` holds ``position + tokens`` tokens (its prefix, then it)."""
        return self.tiers.put(key, _core.pack_chunk(kv, position, tokens, session.fingerprint, key))
