"""A model session: what kdn knows of one model (KV layout, fingerprint) and how its chunks are keyed."""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref

import numpy as np

from kdn import _core
from kdn._core import InvalidInputError
from kdn.config import check_namespace
from kdn.engine.layout import ModelLayout
from kdn.keys import (
    adapter_state,
    model_fingerprint,
    prefix_keys,
    request_scope,
    scoped_fingerprint,
    segment_key,
    tenant_fingerprint,
    token_array,
)

ROOT = bytes(16)  # the parent key of a prompt's first chunk


class RecentKeys:
    """The chained keys of the last ``size`` prompts a session hashed: a request hashes each of its
    chunks once. Its lookups (asked again each step while it waits) find its exact tokens; its load
    (a prefix of them) and its save (the prompt and what was generated: more chunks) reuse the keys
    of the leading chunks they share with a prompt hashed before, and hash only the rest (keys are
    chained, so a shared chunk-aligned prefix has the same keys). ``hashed``: chunks hashed so far."""

    def __init__(self, size: int = 64):
        self.size, self._lru, self._lock = size, collections.OrderedDict(), threading.Lock()
        self.hashed = 0

    def keys(self, tokens: np.ndarray, fingerprint: bytes, chunk: int) -> list[bytes]:
        """Keys of the full chunks of ``tokens`` and of a trailing partial chunk."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        data = tokens.tobytes()
        with self._lock:
            known = self._lru.get(data)
            if known is not None:
                self._lru.move_to_end(data)
                return known[1]
            shared, reuse = 0, []
            for other, keys in self._lru.values():  # the longest chunk-aligned prefix hashed before
                span = min(len(other), len(tokens)) // chunk * chunk
                if span <= shared * chunk:
                    continue
                differ = np.flatnonzero(other[:span] != tokens[:span])
                full = (int(differ[0]) if differ.size else span) // chunk
                if full > shared:
                    shared, reuse = full, keys
        keys = list(reuse[:shared])
        if shared:
            parent = keys[-1]
            for start in range(shared * chunk, len(tokens), chunk):
                parent = _core.chunk_key(fingerprint, parent, tokens[start:start + chunk])
                keys.append(parent)
        else:
            keys = prefix_keys(fingerprint, tokens, chunk, True)
        with self._lock:
            self.hashed += len(keys) - shared
            self._lru[data] = (tokens, keys)
            while len(self._lru) > self.size:
                self._lru.popitem(last=False)
        return keys


@dataclasses.dataclass(frozen=True)
class ModelSession:
    """One model as the engine sees it: its KV ``layout``, its ``fingerprint`` (config, dtype and
    every weight byte), the ``chunk_size`` its prefix keys are chained over and the ``probe_step``
    of its token-granular lookups (0: whole chunks only).

    Example:
        >>> session = kdn.KDN(kdn.KDNConfig(chunk_size=16)).session(model)
        >>> keys = session.prefix_keys(session.tokens(ids))   # one 16-byte key per full chunk
        >>> ids.shape[1], [len(k) for k in keys]
        (62, [16, 16, 16])
    """

    layout: ModelLayout
    fingerprint: bytes
    chunk_size: int
    probe_step: int = 0
    recent: RecentKeys = dataclasses.field(default_factory=RecentKeys, init=False, compare=False, repr=False)
    _tenants: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def within(self, scope: str | bytes | None) -> ModelSession:
        """This session for one request's scope inside it: a tenant name (the facade's per-call
        ``namespace=``, checked: a non-empty string) or a 16-byte scope id
        (:func:`kdn.keys.request_scope`: a vLLM request's ``cache_salt``, LoRA adapter and multimodal
        inputs; never refused). Keys from :func:`kdn.keys.scoped_fingerprint`, so nothing is shared
        with another scope, nor with a config's ``namespace`` of the same name; ``None``: this
        session itself.

        Example:
            >>> session = kdn.KDN(kdn.KDNConfig(chunk_size=16)).session(model)
            >>> session.within(None) is session, session.within("tenant-b").fingerprint != session.fingerprint
            (True, True)
            >>> session.within("tenant-b") is session.within(request_scope("tenant-b"))
            True
        """
        if scope is None:
            return self
        if isinstance(scope, str):
            scope = request_scope(check_namespace(scope))
        elif not isinstance(scope, bytes) or len(scope) != 16:
            raise InvalidInputError(f"namespace must be a non-empty string (a tenant name) or a 16-byte request_scope "
                                    f"id, got {scope!r:.80}")
        tenant = self._tenants.get(scope)
        if tenant is None:
            tenant = dataclasses.replace(self, fingerprint=scoped_fingerprint(self.fingerprint, scope))
            if len(self._tenants) >= 4096:  # many short-lived tenants: forget the oldest
                self._tenants.pop(next(iter(self._tenants)))
            self._tenants[scope] = tenant
        return tenant

    def tokens(self, token_ids) -> np.ndarray:
        """Validated uint32 token ids (list, numpy or torch; 1-D or [1, n])."""
        return token_array(token_ids, self.layout.vocab_size)

    def prefix_keys(self, tokens: np.ndarray, include_partial: bool = False) -> list[bytes]:
        """Chained keys of the full chunks of ``tokens`` (from :meth:`tokens`), and of a trailing
        partial chunk with ``include_partial``; each prompt hashed once, :class:`RecentKeys`)."""
        keys = self.recent.keys(tokens, self.fingerprint, self.chunk_size)
        return list(keys if include_partial else keys[: len(tokens) // self.chunk_size])

    def chunk_key(self, parent: bytes, tokens: np.ndarray) -> bytes:
        """The key of a chunk holding ``tokens`` behind the chunk keyed ``parent`` (:data:`ROOT` first)."""
        return _core.chunk_key(self.fingerprint, parent, tokens)

    def probe_keys(self, parent: bytes, tokens: np.ndarray) -> list[bytes]:
        """Probe keys of the first ``probe_step``, ``2 * probe_step``, ... of ``tokens`` (a chunk's
        tokens, or a reader's tokens where it leaves the stored chain) behind ``parent``."""
        if not self.probe_step:
            return []
        return _core.probe_keys(self.fingerprint, parent, tokens, self.probe_step)

    def segment_key(self, prefix: np.ndarray, tokens: np.ndarray) -> bytes:
        """Key of a segment's KV computed behind ``prefix`` (position independent; for blending)."""
        return segment_key(self.fingerprint, prefix, tokens)


class Sessions:
    """The :class:`ModelSession` of each live model object, rebuilt when the model changes (a new
    dtype or device, new weights): the fingerprint is re-checked on every call (cheap when cached).
    ``layout_of(model)``: the model's :class:`ModelLayout`, read by its face's library adapter
    (:func:`kdn.layout.layout_of` for transformers); None: this engine serves no live model."""

    def __init__(self, chunk_size: int, probe_step: int = 0, on_new=None, namespace: str | None = None,
                 key: bytes = b"", layout_of=None):
        self.layout_of = layout_of
        self.chunk_size = chunk_size
        self.probe_step = probe_step
        self.namespace, self._key = namespace, key  # the config's tenant: every session's root
        self._on_new = on_new  # called with each new session (KDN: load the model's codec calibration)
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def of(self, model) -> ModelSession:
        if self.layout_of is None:
            raise InvalidInputError("this engine was made without a reader of live models (Engine(config, "
                                    "layout_of=kdn.layout.layout_of)): it serves sessions made by checkpoint_session")
        fingerprint = tenant_fingerprint(model_fingerprint(model), self.namespace, self._key)
        adapters = adapter_state(model)  # a PEFT model: which of its adapters compute is in the keys too
        if adapters:
            fingerprint = _core.blake3(b"kdn/adapters\0" + fingerprint + adapters, 16)
        session = self._by_model.get(model)
        if session is None or session.fingerprint != fingerprint:
            session = ModelSession(self.layout_of(model), fingerprint, self.chunk_size, self.probe_step)
            self._by_model[model] = session
            if self._on_new is not None:
                self._on_new(session)
        return session
