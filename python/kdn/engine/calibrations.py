"""A model's calibrated-codec states (``kvtc``'s calibration: :class:`kdn.codecs.ModelState`), kept in
the engine's tiers so every process that meets the model decodes its chunks, and the check every
chunk reader makes before it decodes one: is the state its coding needs loaded."""

from __future__ import annotations

import logging

from kdn import codecs
from kdn._core import BlobError
from kdn.engine.session import ModelSession

log = logging.getLogger("kdn")


class Calibrations:
    """The calibrated-codec states of the models an engine serves, over its tiers (sealed for the
    model, verified on load; an unusable one is dropped and logged)."""

    def __init__(self, tiers):
        self._tiers = tiers

    def load(self, session: ModelSession) -> bool:
        """Load the model's calibrations from the tiers where they are stored; True if any was loaded."""
        loaded = False
        for name, state in codecs.model_states().items():
            key = state.key(session.fingerprint)
            blobs, _ = self._tiers.fetch([key], exact=True)
            if not blobs:
                continue
            try:
                state.load_blob(blobs[0], session.fingerprint, key)
                loaded = True
            except BlobError as e:
                log.warning("kdn: dropping an unusable stored %s calibration: %s", name, e)
                self._tiers.drop(key)
        return loaded

    def store(self, session: ModelSession, codec: str, payload: bytes) -> bytes:
        """Store ``codec``'s calibration of the session's model in every tier and load it; its id."""
        state = codecs.model_states()[codec]
        key = state.key(session.fingerprint)
        blob = state.pack(session.fingerprint, key, payload)
        if not self._tiers.put(key, blob):
            log.warning("kdn: the %s calibration (%d bytes) fits no tier; it is loaded in this process only",
                        codec, len(blob))
        return state.load(payload)

    def keys(self, session: ModelSession) -> list[bytes]:
        """Where the model's calibrations are filed."""
        return [state.key(session.fingerprint) for state in codecs.model_states().values()]

    def drop(self, session: ModelSession) -> None:
        """Remove the model's stored calibrations from every tier (a loaded one stays loaded)."""
        for key in self.keys(session):
            self._tiers.drop(key)

    def decodable(self, session: ModelSession, blobs: list) -> int:
        """How many leading ``blobs`` can be decoded: a chunk of a calibrated codec needs its model's
        state loaded (from the tiers, once, if it is not)."""
        tried = False
        for i, blob in enumerate(blobs):
            missing = _missing_state(blob)
            if missing is None:
                continue
            if not tried:
                tried = True
                self.load(session)
                if _missing_state(blob) is None:
                    continue
            log.info("kdn: a stored chunk needs a %s calibration that is not loaded (a miss)", missing)
            return i
        return len(blobs)


def _missing_state(blob) -> str | None:
    """The calibrated codec whose state ``blob`` needs and this process has not loaded, or None (a
    damaged blob too: verification reports and drops it)."""
    for name, state in codecs.model_states().items():
        try:
            needed = state.needed(blob)
        except BlobError:
            return None
        if needed is not None and not state.loaded(needed):
            return name
    return None
