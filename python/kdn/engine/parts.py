"""What faces beyond lookup / load / save file through an :class:`kdn.engine.Engine`: segments
(blending), sidecars (edits), codec calibrations. Each is a narrow view of the engine's chunk
reader/writer, so a face never holds the reader/writer itself."""

from __future__ import annotations

from kdn import kvtc
from kdn.engine.session import ModelSession
from kdn.engine.targets import HFTarget


class Segments:
    """A segment is a passage's KV computed at a position after some prefix, filed under a segment
    key (:meth:`kdn.engine.ModelSession.segment_key`): what blending joins at query time."""

    def __init__(self, io):
        self._io = io

    def read(self, session: ModelSession, key: bytes, position: int, tokens: int, target: HFTarget | None = None):
        """The stored KV of a segment (``tokens`` long, computed at ``position``) in ``target``'s
        layout (default CPU per-layer tensors), or None (a miss; an unusable blob is dropped and logged)."""
        return self._io.read_segment(session, key, position, tokens, target)

    def read_many(self, session: ModelSession, segments: list[tuple[bytes, int, int]],
                  target: HFTarget | None = None, exact: bool = False) -> list:
        """The KV of the leading stored ``(key, position, tokens)`` segments, read together; stops at
        the first missing or unusable one. ``exact``: a lossy coding of a segment is a miss."""
        return self._io.read_segments(session, segments, target, exact)

    def write(self, session: ModelSession, key: bytes, kv, position: int, tokens: int) -> bool:
        """Store a segment's KV: ``kv`` (per-layer CPU tensors) holds ``position + tokens`` tokens
        (its prefix, then it); True if some tier holds it."""
        return self._io.write_segment(session, key, kv, position, tokens)


class Sidecars:
    """Bytes an edit keeps beside the KV (:mod:`kdn.edits`: masks, scores, steering profiles),
    sealed for the session's model and filed under the edit's address."""

    def __init__(self, io):
        self._io = io

    def read(self, session: ModelSession, address: bytes) -> bytes | None:
        """The sidecar filed under ``address``, or None (an unusable one is dropped and logged)."""
        return self._io.read_sidecar(session, address)

    def read_many(self, session: ModelSession, addresses: list[bytes]) -> list[bytes]:
        """The sidecars of the leading ``addresses`` stored and usable, read together (one round
        trip per tier); stops at the first missing or unusable one."""
        return self._io.read_sidecars(session, addresses)

    def write(self, session: ModelSession, address: bytes, payload: bytes) -> bool:
        """File ``payload`` under ``address``; True if some tier holds it."""
        return self._io.store_sidecar(session, address, payload)


class Calibrations:
    """A model's ``kvtc`` calibration, kept in the tiers so every process that meets the model
    decodes its chunks (:mod:`kdn.kvtc`)."""

    def __init__(self, io):
        self._io = io

    def load(self, session: ModelSession) -> bool:
        """Load the model's calibration from the tiers if one is stored; True if loaded."""
        return self._io.load_calibration(session)

    def store(self, session: ModelSession, calibration: bytes) -> bytes:
        """Store a calibration of the session's model in every tier and load it; its id."""
        return self._io.store_calibration(session, calibration)

    def drop(self, session: ModelSession) -> None:
        """Remove the model's stored calibration from every tier (a loaded one stays loaded)."""
        self._io.drop([kvtc.calibration_key(session.fingerprint)])
