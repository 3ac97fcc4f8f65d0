"""A model session: what kdn knows of one model (KV layout, fingerprint) and how its chunks are keyed."""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from kdn.keys import model_fingerprint, prefix_keys, segment_key, token_array
from kdn.layout import ModelLayout


@dataclasses.dataclass(frozen=True)
class ModelSession:
    """One model as the engine sees it: its KV ``layout``, its ``fingerprint`` (config, dtype and
    every weight byte) and the ``chunk_size`` its prefix keys are chained over.

    Example:
        >>> session = kdn.session(model)
        >>> keys = session.prefix_keys(session.tokens(ids))   # one 16-byte key per full chunk
    """

    layout: ModelLayout
    fingerprint: bytes
    chunk_size: int

    def tokens(self, token_ids) -> np.ndarray:
        """Validated uint32 token ids (list, numpy or torch; 1-D or [1, n])."""
        return token_array(token_ids, self.layout.vocab_size)

    def prefix_keys(self, tokens: np.ndarray) -> list[bytes]:
        """Chained keys of the full chunks of ``tokens`` (from :meth:`tokens`)."""
        return prefix_keys(self.fingerprint, tokens, self.chunk_size)

    def segment_key(self, prefix: np.ndarray, tokens: np.ndarray) -> bytes:
        """Key of a segment's KV computed behind ``prefix`` (position independent; for blending)."""
        return segment_key(self.fingerprint, prefix, tokens)


class Sessions:
    """The :class:`ModelSession` of each live model object, rebuilt when the model changes (a new
    dtype or device, new weights): the fingerprint is re-checked on every call (cheap when cached)."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def of(self, model) -> ModelSession:
        fingerprint = model_fingerprint(model)
        session = self._by_model.get(model)
        if session is None or session.fingerprint != fingerprint:
            session = ModelSession(ModelLayout.of(model), fingerprint, self.chunk_size)
            self._by_model[model] = session
        return session
