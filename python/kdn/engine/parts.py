"""What faces beyond lookup / load / save file through an :class:`kdn.engine.Engine`: segments
(blending) and sidecars (edits), each over the engine's tiers, sealed for the session's model and
verified on read, so a face never holds the tiers or the chunk reader itself (codec calibrations:
:mod:`kdn.engine.calibrations`)."""

from __future__ import annotations

import logging

from kdn import _core
from kdn._core import BlobError, InvalidInputError
from kdn.engine.session import ModelSession
from kdn.engine.targets import HFTarget

log = logging.getLogger("kdn")


class Segments:
    """A segment is a passage's KV computed at a position after some prefix, filed under a segment
    key (:meth:`kdn.engine.ModelSession.segment_key`): what blending joins at query time."""

    def __init__(self, tiers):
        self._tiers = tiers

    def read(self, session: ModelSession, key: bytes, position: int, tokens: int, target: HFTarget | None = None):
        """The stored KV of a segment (``tokens`` long, computed at ``position``) in ``target``'s
        layout (default CPU per-layer tensors), or None (a miss; an unusable blob is dropped and logged)."""
        found = self.read_many(session, [(key, position, tokens)], target)
        return found[0] if found else None

    def read_many(self, session: ModelSession, segments: list[tuple[bytes, int, int]],
                  target: HFTarget | None = None, exact: bool = False) -> list:
        """The KV of the leading stored ``(key, position, tokens)`` segments, each on its own, read
        together (one round trip per tier); stops at the first missing or unusable one (dropped and
        logged). ``exact``: only as stored exactly (a lossy coding of a segment is a miss)."""
        blobs, addresses = self._tiers.fetch([key for key, _, _ in segments], exact=exact)
        out = []
        for blob, address, (_, position, tokens) in zip(blobs, addresses, segments):
            try:
                h = _core.blob_parse(blob, verify_checksum=not getattr(blob, "verified", False))
                if (h["fingerprint"], h["key"], h["tokens"], h["position"]) != (session.fingerprint, address,
                                                                                tokens, position):
                    raise BlobError("segment blob header does not match the request")
                out.append((target or HFTarget()).receive(session, [blob], tokens))
            except (BlobError, InvalidInputError) as e:
                self._tiers.drop(address)
                log.warning("kdn: dropping an unusable stored segment (a miss): %s", e)
                break
        return out

    def write(self, session: ModelSession, key: bytes, kv, position: int, tokens: int) -> bool:
        """Store a segment's KV: ``kv`` (per-layer CPU tensors) holds ``position + tokens`` tokens
        (its prefix, then it); True if some tier holds it."""
        return self._tiers.put(key, _core.pack_chunk(kv, position, tokens, session.fingerprint, key))


class Sidecars:
    """Bytes an edit keeps beside the KV (:mod:`kdn.edits`: masks, scores, steering profiles),
    sealed for the session's model and filed under the edit's address."""

    def __init__(self, tiers):
        self._tiers = tiers

    def read(self, session: ModelSession, address: bytes) -> bytes | None:
        """The sidecar filed under ``address``, or None (an unusable one is dropped and logged)."""
        found = self.read_many(session, [address])
        return found[0] if found else None

    def read_many(self, session: ModelSession, addresses: list[bytes]) -> list[bytes]:
        """The sidecars of the leading ``addresses`` stored and usable, read together (one round
        trip per tier); stops at the first missing or unusable one (dropped and logged)."""
        blobs, _ = self._tiers.fetch(addresses, exact=True)
        out = []
        for blob, address in zip(blobs, addresses):
            try:
                out.append(_core.sidecar_read(blob, session.fingerprint, address))
            except BlobError as e:
                log.warning("kdn: dropping an unusable stored sidecar (treated as a miss): %s", e)
                self._tiers.drop(address)
                break
        return out

    def write(self, session: ModelSession, address: bytes, payload: bytes) -> bool:
        """File ``payload`` under ``address`` (an edit's address); True if some tier holds it."""
        return self._tiers.put(address, _core.sidecar_pack(session.fingerprint, address, payload))

    def held(self, addresses: list[bytes]) -> list[bool]:
        """Per address: whether some tier holds a sidecar filed there (one batched check per tier; no data read)."""
        return self._tiers.held(addresses)

    def drop(self, address: bytes) -> None:
        """Remove the sidecar filed under ``address`` from every tier (one its reader cannot use)."""
        self._tiers.drop(address)
