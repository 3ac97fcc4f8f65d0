"""The KDN object: a KV-cache provider for HF transformers models (lookup, store, retrieve, generate)."""

from __future__ import annotations

import dataclasses
import logging
import numbers

import torch

from kdn import _core
from kdn._core import BlobError, InvalidInputError
from kdn.config import KDNConfig
from kdn.keys import model_fingerprint, prefix_keys, token_array
from kdn.layout import ModelLayout, cache_to_kv_list, check_kv_matches, empty_kv_list, kv_list_to_cache
from kdn.storage import TierManager

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
        self.tiers = TierManager(self.config)
        self.memory, self.disk = self.tiers.memory, self.tiers.disk
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
        return self.tiers.count_prefix(keys, info.fingerprint) * self.config.chunk_size

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
            if not self.tiers.contains_local(key):
                blob = _core.pack_chunk(kv, i * chunk, chunk, info.fingerprint, key)
                if not self.tiers.put(key, blob):
                    log.warning("kdn: chunk of %d bytes fits no tier (pinned entries hold the space?); not stored",
                                len(blob))
                    break
            stored += chunk
        retrievable = self.tiers.count_prefix(keys[: stored // chunk], info.fingerprint) * chunk
        if retrievable < stored:  # the prompt's tail evicted its own head
            log.warning("kdn: stored %d tokens but only the first %d can be retrieved: the prompt's KV is larger "
                        "than the tiers hold (memory_bytes=%d; add a disk tier or raise memory_bytes)",
                        stored, retrievable, self.config.memory_bytes)
        return retrievable

    def retrieve(self, model, token_ids, limit: int | None = None):
        """Fetch the stored KV of the longest stored prefix of ``token_ids``.

        Returns ``(cache, num_hit_tokens)``: a DynamicCache holding exactly ``num_hit_tokens``
        tokens (each layer [1, kv_heads, num_hit_tokens, head_dim], on the model's device), or
        ``(None, 0)`` on a miss. ``limit`` caps the hit (``generate`` passes ``len - 1`` so that
        the last prompt token is always prefilled to produce logits). A corrupt, truncated or
        foreign blob ends the hit before it, is dropped from the store and logged once.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Integral)):
            if not (isinstance(limit, float) and limit.is_integer()):
                raise InvalidInputError(f"retrieve: limit must be a whole number of tokens or None, got {limit!r}")
        info = self._info(model)
        tokens, keys = self._keys(info, token_ids)
        limit = len(tokens) if limit is None else max(0, min(int(limit), len(tokens)))
        chunk = self.config.chunk_size
        wanted = min(self.tiers.count_prefix(keys, info.fingerprint), -(-limit // chunk))
        # may stop early (evicted since count_prefix); addresses: exact keys, or accepted lossy ones
        blobs, addresses = self.tiers.fetch(keys[:wanted], info.fingerprint)
        layout = info.layout
        n_ok, error = _core.verify_chunks(
            blobs, addresses, info.fingerprint, layout.dtype,
            layout.layers, layout.kv_heads, layout.head_dim, chunk,
        )
        if error:
            log.warning("kdn: dropping an unusable stored chunk (treated as a miss): %s", error)
            self.tiers.drop(addresses[n_ok], info.fingerprint)
        hit = min(n_ok * chunk, limit)
        if hit == 0:
            return None, 0
        kv = empty_kv_list(layout, hit)
        try:
            _core.unpack_chunks(blobs[: -(-hit // chunk)], kv, hit)  # decodes coded chunks
        except BlobError as e:  # a coded payload that its checksum did not catch: a miss, never wrong KV
            log.warning("kdn: dropping undecodable stored chunks (treated as a miss): %s", e)
            for address in addresses[: -(-hit // chunk)]:
                self.tiers.drop(address, info.fingerprint)
            return None, 0
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

    # -- blending ---------------------------------------------------------------------------
    def store_segments(self, model, segments, prefix=None) -> dict:
        """Precompute and store the KV of each segment (token ids) on its own, behind ``prefix``
        (default: the model's BOS), under a key of the segment's tokens and the model only.

        Returns ``{"already_stored": n, "computed": m}``. See :mod:`kdn.blend`.
        """
        from kdn.blend import store_segments

        return store_segments(self, model, segments, prefix)

    def blend(self, model, segments, query, recompute_ratio: float = 0.15, prefix=None, mode: str = "blend"):
        """KV cache for ``prefix + segments + query[:-1]`` from separately cached segments.

        ``mode``: ``"blend"`` (re-rotate, join, recompute the ``recompute_ratio`` most deviating
        tokens: CacheBlend), ``"naive"`` (re-rotate and join only), ``"prefix"`` (plain prefix
        reuse) or ``"full"`` (no reuse). Returns ``(cache, stats)``; ``stats["tokens"]`` is how many
        prompt tokens the cache covers, ``stats["recomputed_per_layer"]`` the recompute.

        Example:
            >>> kdn.store_segments(model, passages)
            >>> cache, stats = kdn.blend(model, passages, question_ids, recompute_ratio=0.15)
            >>> out = model.generate(torch.tensor([bos + sum(passages, []) + question_ids]), past_key_values=cache)
        """
        from kdn.blend import blend

        return blend(self, model, segments, query, prefix, recompute_ratio, mode)

    def blend_generate(self, model, segments, query, recompute_ratio: float = 0.15, prefix=None, mode="blend",
                       **generate_kwargs):
        """``model.generate`` over ``prefix + segments + query`` with the cache from :meth:`blend`;
        returns the new tokens ([1, m]) and the blend stats."""
        from kdn.blend import blend, prompt_tokens

        cache, stats = blend(self, model, segments, query, prefix, recompute_ratio, mode)
        ids = prompt_tokens(self._info(model), model, segments, query, prefix)[3]
        ids = torch.tensor([ids], device=next(model.parameters()).device)
        kwargs = {"past_key_values": cache} if cache is not None else {}
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **generate_kwargs)
        return out[:, ids.shape[1]:], stats

    # -- management -------------------------------------------------------------------------
    def chunk_keys(self, model, prompt, tokenizer=None) -> list[bytes]:
        """Keys of the full chunks of ``prompt`` (token ids, or text with ``tokenizer``)."""
        return self._prompt_keys(self._info(model), prompt, tokenizer)

    def _prompt_keys(self, info: _ModelInfo, prompt, tokenizer) -> list[bytes]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InvalidInputError("a text prompt needs tokenizer=... to find its chunks (or pass token ids)")
            prompt = tokenizer(prompt)["input_ids"]
        return self._keys(info, prompt)[1]

    def pin(self, model, prompt, tokenizer=None, ttl: float | None = None) -> int:
        """Keep the stored chunks of ``prompt`` from eviction (for ``ttl`` seconds if given).

        Returns the number of leading tokens pinned. Pinned chunks are promoted into memory
        from wherever they are stored; pins live in this process.
        Example: ``kdn.pin(model, document, tokenizer=tok, ttl=3600)``.
        """
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, numbers.Real) or not ttl > 0):
            raise InvalidInputError(f"pin: ttl must be a positive number of seconds (inf: until unpinned) or None, "
                                    f"got {ttl!r}")
        info = self._info(model)
        keys = self._prompt_keys(info, prompt, tokenizer)
        self.tiers.get_many(keys, info.fingerprint)  # promote into memory
        n = 0
        while n < len(keys) and self.tiers.pin(keys[n], ttl or 0.0):
            n += 1
        return n * self.config.chunk_size

    def unpin(self, model, prompt, tokenizer=None) -> int:
        """Make the chunks of ``prompt`` evictable again; returns the number of chunks unpinned."""
        return sum(self.tiers.unpin(k) for k in self.chunk_keys(model, prompt, tokenizer))

    def evict(self, model, prompt, tokenizer=None) -> int:
        """Remove the chunks of ``prompt`` from every tier (the remote store too); returns how many were held."""
        info = self._info(model)
        return sum(self.tiers.remove(k, info.fingerprint) for k in self._prompt_keys(info, prompt, tokenizer))

    def flush(self) -> None:
        """Wait until queued disk writes are on disk and queued remote stores are sent."""
        self.tiers.flush()

    def stats(self) -> dict:
        """Per-tier counters: ``{"memory": {...}, "disk": {...}, "remote": {...}}`` with hits, misses,
        puts, evictions, rejected, entries, used/capacity/pinned bytes (disk also: writes, errors,
        corrupt, dropped, queued bytes, last_error; remote: errors, dropped, corrupt, skipped,
        state "ok"/"down")."""
        return self.tiers.stats()

    def clear(self) -> None:
        """Drop every stored chunk from every tier (the disk tier's files included) and hand the
        process's idle pooled buffers back to the system allocator."""
        self.tiers.clear()
        _core.buffer_pool_trim()
