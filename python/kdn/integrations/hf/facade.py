"""The KDN object: a KV-cache provider for HF transformers models (lookup, store, retrieve, generate)."""

from __future__ import annotations

import logging
import numbers
import threading
import time

import torch

from kdn import _core
from kdn._core import InvalidInputError
from kdn.compat import UnvouchedError, refused
from kdn.config import KDNConfig
from kdn.engine import Engine, ModelSession, Retention
from kdn.integrations.hf import generate as hf
from kdn.integrations.hf import vouch
from kdn.integrations.hf.cache import load_cache
from kdn.layout import cache_arg, cache_to_kv_list, check_kv_matches, layout_of

log = logging.getLogger("kdn")


class KDN:
    """Stores the KV caches a model computes and serves them back for prompts that share a prefix.

    Keys are chained per chunk of ``config.chunk_size`` tokens and include the model fingerprint,
    so a different model never hits. Hits are token-granular: a prompt is served every leading token
    it shares with a stored prompt (found through pointers every ``config.probe_step`` tokens); the
    rest of it is prefilled.
    A face over one :class:`kdn.engine.Engine` (``engine``; ``session(model)``, ``chunks`` and
    ``delivery`` are the engine's).

    Example:
        >>> cache = KDN(KDNConfig(chunk_size=16))
        >>> out = model(ids, use_cache=True)                # ids: a document's tokens, [1, n]
        >>> stored = cache.store(model, ids, out.past_key_values)
        >>> question_ids = tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids
        >>> ids_with_question = torch.cat([ids, question_ids], dim=1)
        >>> ids.shape[1], cache.lookup(model, ids_with_question)   # 3 chunks of 16 stored (a tail < probe_step is not)
        (62, 48)
        >>> kv, hit = cache.retrieve(model, ids_with_question)
        >>> logits = model(ids_with_question[:, hit:], past_key_values=kv).logits
        >>> full = model(ids_with_question).logits[:, hit:]
        >>> torch.allclose(logits, full, atol=1e-4)
        True
    """

    def __init__(self, config: KDNConfig | None = None):
        self.config = config or KDNConfig()
        self.engine = Engine(self.config, layout_of=layout_of)
        self._local = threading.local()

    # -- the engine -----------------------------------------------------------------------------
    def session(self, model, namespace: str | None = None) -> ModelSession:
        """The engine's view of ``model``: KV layout, fingerprint, prefix and segment keys (in the
        tenant ``namespace`` within ``config.namespace``, when given)."""
        return self.engine.session(model, namespace)

    def _attention_only(self, model, what: str, namespace: str | None = None) -> ModelSession:
        """The model's session; InvalidInputError naming ``what`` for a hybrid model (served by
        :meth:`generate` alone), :class:`kdn.compat.UnvouchedError` for a model whose caches kdn cannot
        vouch for (:mod:`kdn.integrations.hf.vouch`)."""
        from kdn.integrations.hf.hybrid import refuse

        session = self.session(model, namespace)
        refuse(session.layout, what)
        vouch.check(model, session.layout, what)
        return session

    def calibrate(self, model, contexts, codec: str = "kvtc", **options) -> bytes:
        """Fit a calibrated codec's per-model state (``kvtc``'s calibration) of ``model`` on
        ``contexts`` (token id lists; see :func:`kdn.kvtc.calibrate` for ``options``), store it in every
        tier (other processes and machines that meet the model load it from there) and load it here.
        Returns its id.

        Example:
            >>> cache = KDN(KDNConfig(memory_codec="kvtc:ratio=8"))
            >>> calibration_id = cache.calibrate(model, [tokenizer(document)["input_ids"]])
        """
        from kdn import codecs

        states = codecs.model_states()
        if codec not in states:
            raise InvalidInputError(f"codec {codec!r} is not calibrated; calibrated codecs: {', '.join(states)}")
        session = self._attention_only(model, "KDN.calibrate")
        return self.engine.calibrations.store(session, codec, states[codec].calibrate(model, contexts, **options))

    @property
    def memory(self):
        """The memory tier (:class:`kdn.storage.MemoryTier`)."""
        return self.engine.tier("memory")

    @property
    def disk(self):
        """The disk tier (:class:`kdn.storage.DiskTier`), or None."""
        return self.engine.tier("disk")

    @property
    def remote(self):
        """The remote tier (:class:`kdn.storage.remote.RemoteTier`), or None."""
        return self.engine.tier("remote")

    # -- public API -------------------------------------------------------------------------
    def lookup(self, model, token_ids, limit: int | None = None, namespace: str | None = None) -> int:
        """Number of leading tokens of ``token_ids`` that :meth:`retrieve` would serve (only pointers
        are read, no KV): the stored prefix, at most ``len(token_ids) - 1`` unless ``limit`` says
        otherwise (``limit=len(token_ids)`` asks how much of the whole prompt is stored); for a hybrid
        model, what :meth:`generate` would serve: up to its deepest stored recurrent state.

        ``namespace`` (here and in :meth:`store`, :meth:`retrieve`, :meth:`generate`): the tenant
        the call belongs to, within ``config.namespace``. Different namespaces share no KV and see
        none of each other's; the same string as a vLLM request's ``cache_salt`` shares with it."""
        session = self.session(model, namespace)
        tokens = session.tokens(token_ids)
        if not vouch.served(model, session.layout, "KDN.lookup"):
            return 0
        if session.layout.recurrent:  # a hybrid model's: up to the last stored state (its payload is read)
            from kdn.integrations.hf.hybrid import held

            return held(self.engine, session, model, tokens, _limit(limit, len(tokens), "lookup"))[0]
        return self.engine.lookup(session, tokens, _limit(limit, len(tokens), "lookup"))

    def store(self, model, token_ids, past_key_values, namespace: str | None = None,
              retain: float | None = None, priority: int | None = None) -> int:
        """Store the KV of ``token_ids`` from ``past_key_values`` (its full chunks, and a tail of at
        least ``config.probe_step`` tokens); ``retain``: seconds to keep it pinned in memory, within
        the operator's bound (:meth:`kdn.engine.Engine.check_retention`: refused before storing);
        ``priority``: its place in its tenant's eviction order (:class:`kdn.engine.Retention`).

        ``past_key_values`` is the model's cache (DynamicCache or tuple of (k, v)) for at least
        ``len(token_ids)`` tokens, batch 1. Chunks already stored are skipped (idempotent).
        Returns the number of leading tokens a retrieve can now serve (fewer than given, with one
        warning, when the prompt's KV is larger than the tiers hold).
        """
        try:
            session = self._attention_only(model, "KDN.store", namespace)
        except UnvouchedError as e:
            refused(f"KDN.store for {type(model).__name__}", str(e))
            return 0
        tokens = session.tokens(token_ids)
        kv = cache_to_kv_list(past_key_values)
        check_kv_matches(session.layout, kv, len(tokens))
        retention = Retention.asked(retain, priority)
        if retention:
            self.engine.check_retention(session, len(tokens), retention)
        stored = self.engine.save(session, tokens, [t.cpu() for t in kv])
        if retention:
            self.engine.retain(session, tokens, retention)
        return stored

    def retrieve(self, model, token_ids, limit: int | None = None, edits=None, namespace: str | None = None):
        """Fetch the stored KV of the longest stored prefix of ``token_ids``.

        Returns ``(cache, num_hit_tokens)``: a DynamicCache holding exactly ``num_hit_tokens``
        tokens (each layer [1, kv_heads, num_hit_tokens, head_dim], on the model's device), or
        ``(None, 0)`` on a miss. ``limit`` caps the hit (``generate`` passes ``len - 1`` so that
        the last prompt token is always prefilled to produce logits). A corrupt, truncated or
        foreign blob ends the hit before it, is dropped from the store and logged once.

        ``limit`` defaults to ``len(token_ids) - 1``: the last prompt token is always left to the
        model, so both HF patterns stay correct for a prompt stored whole, in part or not at all:
        ``model(ids[:, hit:], past_key_values=cache)`` never gets an empty input, and
        ``model.generate(ids, past_key_values=cache)`` computes the last token's logits itself (a
        cache holding every prompt token makes ``generate`` drop the first new token). Pass
        ``limit=len(token_ids)`` to get the whole prompt's KV.

        With ``config.delivery="layerwise"`` (default; models on the CPU) the cache comes back at
        once while its layers are still arriving: the model's attention at layer i waits for layer
        i only (:mod:`kdn.delivery`). If the delivery fails mid-way (the remote store goes down),
        the model's forward raises :class:`kdn.delivery.DeliveryError`; :meth:`generate` then
        recomputes the prompt. :attr:`last_retrieve` describes what was served.

        ``edits`` (a spec or a list, :mod:`kdn.edits`) accepts edited caches deposited with
        :meth:`deposit`: the first edit stored for the prompt's leading chunks is served (a
        :class:`kdn.edits.stored.PrunedCache` for ``kvzip``: fewer rows, the original positions;
        for ``steer`` the exact cache), else the exact cache as without ``edits``. An edited hit may
        come with attention biases in ``last_retrieve["bias"]`` (a steer edit's emphasis; the mask
        over a pruned cache's padding rows): run the model under
        ``kdn.edits.steer.applied(model, biases)`` (``generate`` does).
        """
        try:
            session = self._attention_only(model, "KDN.retrieve", namespace)
        except UnvouchedError as e:
            refused(f"KDN.retrieve for {type(model).__name__}", str(e))
            self._local.last_retrieve = {"hit_tokens": 0, "stream": None, "lossy": False, "edit": None, "bias": None}
            return None, 0
        started = time.perf_counter()
        tokens = session.tokens(token_ids)
        cache, load = load_cache(self.engine, model, tokens, _limit(limit, len(tokens), "retrieve"), edits, started,
                                    namespace)
        self._local.last_retrieve = {"hit_tokens": load.hit, "stream": load.stream, "lossy": load.lossy,
                                     "edit": load.edit, "bias": load.bias}
        return (cache, load.hit) if load.hit else (None, 0)

    @property
    def last_retrieve(self) -> dict | None:
        """This thread's last :meth:`retrieve`: ``{"hit_tokens", "stream", "lossy", "edit"}``; ``stream``
        is the :class:`kdn.delivery.LayerStream` of a layer-wise hit (its ``stats``: levels, bytes,
        bandwidth, chunks streamed and recomputed; whether it was lossy is known there once it ends),
        ``edit`` the edit served (:mod:`kdn.edits`), if any."""
        return getattr(self._local, "last_retrieve", None)

    @property
    def last_generate(self) -> dict | None:
        """``{"hit_tokens", "prompt_tokens"}`` of this thread's last :meth:`generate` (also in the
        output of ``generate(..., return_dict_in_generate=True)`` as ``kdn_stats``)."""
        return getattr(self._local, "last_generate", None)

    def generate(self, model, input_ids, **generate_kwargs):
        """``model.generate`` with the prompt's stored prefix served from kdn and the new KV stored.

        See :func:`kdn.integrations.hf.generate` (``namespace=``: the tenant, as in :meth:`lookup`).
        """
        out, stats = hf.generate(self.engine, model, input_ids, **generate_kwargs)
        self._local.last_generate = stats
        return out

    # -- editing at deposit ----------------------------------------------------------------------
    def deposit(self, model, prompt, edits=(), tokenizer=None, emphasize=None, keep_exact: bool = True) -> dict:
        """Store ``prompt``'s KV (text with ``tokenizer``, or token ids) exactly and, for each of
        ``edits`` (e.g. ``["kvzip:keep=0.3"]``, :mod:`kdn.edits`), an edited form under that edit's
        own addresses, which only readers naming the edit are served (``generate(..., edits=...)``).
        ``emphasize``: the spans a ``steer`` edit emphasizes, ``[(start, end), ...]`` (characters
        of a text prompt, tokens of ids), or ``"auto"``: the sentences the model names when asked
        for the text's most important facts (AutoPASTA at deposit, :mod:`kdn.edits.autospans`;
        a model that names none is an InvalidInputError). Every edit is computed before anything
        is stored: an edit that fails stores nothing. ``keep_exact=False`` stores only the edited
        form (``kvzip`` edits) and the partial last chunk served with it: less space, and exact
        readers miss the prompt.
        Returns ``{"tokens", "exact_tokens", "prefill_seconds", "edits": {spec: {"chunks", "bytes",
        "seconds"}}}``, and with ``"auto"`` ``"auto_spans": {"spans", "answer", "seconds"}``.

        Example:
            >>> cache = KDN(KDNConfig(chunk_size=16))
            >>> report = cache.deposit(model, document, edits=["kvzip:keep=0.3"], tokenizer=tokenizer)
            >>> {spec: edit["chunks"] for spec, edit in report["edits"].items()}   # specs in canonical form
            {'kvzip:keep=0.3,sink=4': 3}
            >>> prompt = tokenizer(document + question, return_tensors="pt").input_ids
            >>> out = cache.generate(model, prompt, edits="kvzip:keep=0.3", max_new_tokens=8)
            >>> cache.last_generate["edit"]                   # served the pruned KV
            'kvzip:keep=0.3,sink=4'
        """
        from kdn.edits import stored

        self._attention_only(model, "KDN.deposit")
        return stored.deposit(self.engine, model, prompt, edits, tokenizer, emphasize, keep_exact)

    # -- blending ---------------------------------------------------------------------------
    def store_segments(self, model, segments, prefix=None) -> dict:
        """Precompute and store the KV of each segment (token ids) on its own, behind ``prefix``
        (default: the model's BOS), under a key of the segment's tokens and the model only.

        Returns ``{"already_stored": n, "computed": m}``. See :mod:`kdn.blend`.
        """
        from kdn.blend import store_segments

        self._attention_only(model, "KDN.store_segments")
        return store_segments(self.engine, model, segments, prefix)

    def blend(self, model, segments, query, recompute_ratio: float = 0.15, prefix=None, mode: str = "blend",
              selection: str = "kv"):
        """KV cache for ``prefix + segments + query[:-1]`` from separately cached segments.

        ``mode``: ``"blend"`` (re-rotate, join, recompute the ``recompute_ratio`` most deviating
        tokens: CacheBlend), ``"naive"`` (re-rotate and join only), ``"prefix"`` (plain prefix
        reuse) or ``"full"`` (no reuse). ``selection``: which tokens are recomputed, ``"kv"``
        (K+V deviation at layer 1), ``"v"`` (V only), ``"gradual"`` (CacheBlend's narrowing over
        layers) or ``"first-k"`` (EPIC: each segment's first tokens); see :mod:`kdn.blend.recompute`.
        Returns ``(cache, stats)``; ``stats["tokens"]`` is how many
        prompt tokens the cache covers, ``stats["recomputed_per_layer"]`` the recompute.

        Example:
            >>> cache = KDN()
            >>> passages = [tokenizer(p)["input_ids"][1:] for p in ("Lily had a dog.", "The ball was red.")]
            >>> question_ids = tokenizer(question)["input_ids"][1:]
            >>> counts = cache.store_segments(model, passages)
            >>> kv, stats = cache.blend(model, passages, question_ids, recompute_ratio=0.15)
            >>> prompt = torch.tensor([[tokenizer.bos_token_id] + sum(passages, []) + question_ids])
            >>> out = model.generate(prompt, past_key_values=kv, max_new_tokens=8)
        """
        from kdn.blend import blend

        self._attention_only(model, "KDN.blend")
        return blend(self.engine, model, segments, query, prefix, recompute_ratio, mode, selection=selection,
                     load=load_cache)

    def blend_generate(self, model, segments, query, recompute_ratio: float = 0.15, prefix=None, mode="blend",
                       **generate_kwargs):
        """``model.generate`` over ``prefix + segments + query`` with the cache from :meth:`blend`;
        returns the new tokens ([1, m]) and the blend stats."""
        from kdn.blend import blend, prompt_tokens

        self._attention_only(model, "KDN.blend_generate")
        cache, stats = blend(self.engine, model, segments, query, prefix, recompute_ratio, mode, load=load_cache)
        ids = prompt_tokens(self.session(model), model, segments, query, prefix)[3]
        ids = torch.tensor([ids], device=next(model.parameters()).device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), **generate_kwargs)
        return out[:, ids.shape[1]:], stats

    # -- management -------------------------------------------------------------------------
    def chunk_keys(self, model, prompt, tokenizer=None) -> list[bytes]:
        """Keys of the full chunks of ``prompt`` (token ids, or text with ``tokenizer``)."""
        return self._prompt_keys(self.session(model), prompt, tokenizer)

    def _prompt_keys(self, session: ModelSession, prompt, tokenizer) -> list[bytes]:
        return session.prefix_keys(self._prompt_tokens(session, prompt, tokenizer))

    def _prompt_tokens(self, session: ModelSession, prompt, tokenizer):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InvalidInputError("a text prompt needs tokenizer=... to find its chunks (or pass token ids)")
            prompt = tokenizer(prompt)["input_ids"]
        return session.tokens(prompt)

    def pin(self, model, prompt, tokenizer=None, ttl: float | None = None) -> int:
        """Keep the stored chunks of ``prompt`` from eviction (for ``ttl`` seconds if given).

        Returns the number of leading tokens pinned. Pinned chunks are promoted into memory
        from wherever they are stored; pins live in this process. A prompt that is not stored
        pins nothing: the count is 0 and one warning says so (store it first, e.g. by ``generate``).
        Example: ``kdn.pin(model, document, tokenizer=tok, ttl=3600)``.
        """
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, numbers.Real) or not ttl > 0):
            raise InvalidInputError(f"pin: ttl must be a positive number of seconds (inf: until unpinned) or None, "
                                    f"got {ttl!r}")
        session = self.session(model)
        keys = self._prompt_keys(session, prompt, tokenizer)
        n = self.engine.pin(keys, ttl)
        if n == 0:
            log.warning("kdn: pin: no chunk of this prompt is stored, nothing was pinned (store it first: "
                        "generate() or store(); whole chunks of %d tokens are pinned)", self.config.chunk_size)
        return n * self.config.chunk_size

    def unpin(self, model, prompt, tokenizer=None) -> int:
        """Make the chunks of ``prompt`` evictable again; returns the number of chunks unpinned."""
        return self.engine.unpin(self.chunk_keys(model, prompt, tokenizer))

    def evict(self, model, prompt, tokenizer=None) -> int:
        """Remove the chunks of ``prompt`` from every tier (the remote store too); returns how many were held."""
        session = self.session(model)
        return self.engine.evict(session, self._prompt_tokens(session, prompt, tokenizer))

    def flush(self) -> None:
        """Wait until queued disk writes are on disk and queued remote stores are sent."""
        self.engine.flush()

    def close(self) -> None:
        """Write what is queued and release the remote store's connection (``with KDN(...) as kdn:``
        closes at the end of the block); the memory and disk tiers stay readable."""
        self.engine.close()

    def __enter__(self) -> KDN:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Per-tier counters: ``{"memory": {...}, "node": {...}, "disk": {...}, "remote": {...}}`` with hits, misses,
        puts, evictions, rejected, entries, used/capacity/pinned bytes (disk also: writes, errors,
        corrupt, dropped, queued bytes, last_error; remote: errors, dropped, corrupt, skipped,
        state "ok"/"down"), and ``"delivery"``: layer-wise streams, chunks streamed and recomputed,
        bytes, layer groups served per level, failures, measured bandwidth and round trip."""
        return self.engine.stats()

    def clear(self) -> None:
        """Drop every stored chunk from every tier (the disk tier's files included) and hand the
        process's idle pooled buffers back to the system allocator."""
        self.engine.clear()
        _core.buffer_pool_trim()


def _limit(limit, n: int, where: str) -> int:
    """The token cap of a lookup or retrieve: ``n - 1`` by default (the last token is the model's),
    else ``limit`` clamped to n; a limit that is not a whole non-negative number is an InvalidInputError."""
    if limit is None:
        return max(0, n - 1)
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
        if not (isinstance(limit, float) and limit.is_integer()):
            raise InvalidInputError(f"{where}: limit must be a whole number of tokens or None, got {limit!r}")
    if limit < 0:
        raise InvalidInputError(f"{where}: limit must be a non-negative number of tokens or None, got {limit!r}")
    return min(int(limit), n)
