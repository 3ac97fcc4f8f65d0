"""The KDN object: a KV-cache provider for HF transformers models (lookup, store, retrieve, generate)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kdn import _core
from kdn.config import KDNConfig
from kdn.keys import model_fingerprint, prefix_keys, token_array
from kdn.layout import ModelLayout, cache_to_kv_list, check_kv_matches, kv_list_to_cache
from kdn.storage import MemoryTier

log = logging.getLogger("kdn")


@dataclasses.dataclass
class _ModelInfo:
    layout: ModelLayout
    fingerprint: bytes


class KDN:
    """Stores the KV caches a model computes and serves them back for prompts that share a prefix.

    Keys are chained per chunk of ``config.chunk_size`` tokens and include the model fingerprint,
    so a different model never hits. Hits are whole chunks; the rest of a prompt is prefilled.

    Example:
        >>> kdn = KDN(KDNConfig(chunk_size=256))
        >>> out = model(ids, use_cache=True)
        >>> kdn.store(model, ids, out.past_key_values)
        >>> kdn.lookup(model, ids_with_question)        # tokens available, a multiple of 256
        >>> cache, hit = kdn.retrieve(model, ids_with_question)
        >>> logits = model(ids_with_question[:, hit:], past_key_values=cache).logits
    """

    def __init__(self, config: KDNConfig | None = None):
        self.config = config or KDNConfig()
        self.memory = MemoryTier(self.config.memory_bytes)
        self._models: dict[int, _ModelInfo] = {}

    # -- model identity ---------------------------------------------------------------------
    def _info(self, model) -> _ModelInfo:
        fingerprint = model_fingerprint(model)
        info = self._models.get(id(model))
        if info is None or info.fingerprint != fingerprint:
            info = _ModelInfo(ModelLayout.of(model), fingerprint)
            self._models[id(model)] = info
        return info

    def _keys(self, info: _ModelInfo, token_ids):
        tokens = token_array(token_ids, info.layout.vocab_size)
        return tokens, prefix_keys(info.fingerprint, tokens, self.config.chunk_size)

    # -- public API -------------------------------------------------------------------------
    def lookup(self, model, token_ids) -> int:
        """Number of leading tokens of ``token_ids`` whose KV is stored (a multiple of chunk_size)."""
        info = self._info(model)
        _, keys = self._keys(info, token_ids)
        return self.memory.count_prefix(keys) * self.config.chunk_size

    def store(self, model, token_ids, past_key_values) -> int:
        """Store the KV of the full chunks of ``token_ids`` from ``past_key_values``.

        ``past_key_values`` is the model's cache (DynamicCache or tuple of (k, v)) for at least
        ``len(token_ids)`` tokens, batch 1. Chunks already stored are skipped (idempotent).
        Returns the number of leading tokens now stored.
        """
        info = self._info(model)
        tokens, keys = self._keys(info, token_ids)
        kv = cache_to_kv_list(past_key_values)
        check_kv_matches(info.layout, kv, len(tokens))
        kv = [t.cpu() for t in kv]
        chunk = self.config.chunk_size
        stored = 0
        for i, key in enumerate(keys):
            if not self.memory.contains(key):
                blob = _core.pack_chunk(kv, i * chunk, chunk, info.fingerprint, key)
                if not self.memory.put(key, blob):
                    log.warning("kdn: chunk of %d bytes does not fit the memory tier; not stored", len(blob))
                    break
            stored += chunk
        return stored

    def retrieve(self, model, token_ids, limit: int | None = None):
        """Fetch the stored KV of the longest stored prefix of ``token_ids``.

        Returns ``(cache, num_hit_tokens)``: a DynamicCache holding exactly ``num_hit_tokens``
        tokens (each layer [1, kv_heads, num_hit_tokens, head_dim], on the model's device), or
        ``(None, 0)`` on a miss. ``limit`` caps the hit (``generate`` passes ``len - 1`` so that
        the last prompt token is always prefilled to produce logits). A corrupt, truncated or
        foreign blob ends the hit before it, is dropped from the store and logged once.
        """
        info = self._info(model)
        tokens, keys = self._keys(info, token_ids)
        limit = len(tokens) if limit is None else max(0, min(int(limit), len(tokens)))
        chunk = self.config.chunk_size
        wanted = min(self.memory.count_prefix(keys), -(-limit // chunk))
        blobs = []
        for key in keys[:wanted]:
            blob = self.memory.get(key)  # may have been evicted since count_prefix
            if blob is None:
                break
            blobs.append(blob)
        layout = info.layout
        n_ok, error = _core.verify_chunks(
            blobs, keys[: len(blobs)], info.fingerprint, layout.dtype,
            layout.layers, layout.kv_heads, layout.head_dim, chunk,
        )
        if error:
            log.warning("kdn: dropping an unusable stored chunk (treated as a miss): %s", error)
            self.memory.remove(keys[n_ok])
        hit = min(n_ok * chunk, limit)
        if hit == 0:
            return None, 0
        kv = [torch.empty((1, layout.kv_heads, hit, layout.head_dim), dtype=layout.torch_dtype)
              for _ in range(2 * layout.layers)]
        _core.unpack_chunks(blobs[: -(-hit // chunk)], kv, hit)
        device = next(model.parameters()).device
        if device.type != "cpu":
            kv = [t.to(device, non_blocking=True) for t in kv]
        return kv_list_to_cache(model, kv), hit

    def generate(self, model, input_ids, **generate_kwargs):
        """``model.generate`` with the prompt's stored prefix served from kdn and the new KV stored.

        See :func:`kdn.integrations.hf.generate`.
        """
        from kdn.integrations.hf import generate

        return generate(self, model, input_ids, **generate_kwargs)

    def stats(self) -> dict:
        """Per-tier counters: hits, misses, puts, evictions, bytes."""
        return {"memory": self.memory.stats()}

    def clear(self) -> None:
        """Drop every stored chunk."""
        self.memory.clear()
