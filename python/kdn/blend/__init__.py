"""Blending: reuse the KV of segments that are not a prefix (RAG passages), joined at query time.

Each segment's KV is computed on its own behind a shared ``prefix`` (default: the model's BOS
token) and stored under a segment key (model + prefix + segment tokens) at canonical positions
starting right after the prefix. At query time the segments' keys are re-rotated (RoPE) to where
the segments sit in the prompt and joined; ``naive`` stops there, ``blend`` then recomputes the
tokens whose KV deviates most (CacheBlend, :mod:`kdn.blend.recompute`).

Modes of :func:`blend`: ``full`` (no reuse: the baseline), ``prefix`` (prefix caching of the whole
prompt), ``naive`` (concatenate, no recompute) and ``blend`` (selective recompute at ``ratio``).
"""

from __future__ import annotations

import numbers
import time

import torch

from kdn._core import InvalidInputError
from kdn.blend.recompute import SELECTIONS, check_supported, selective_prefill
from kdn.engine import HFTarget
from kdn.layout import cache_to_kv_list, kv_list_to_cache, prefill_cache
from kdn.rope import UnsupportedModelError, shift_keys

MODES = ("full", "prefix", "naive", "blend")


def default_prefix(model) -> list[int]:
    bos = getattr(model.config, "bos_token_id", None)
    return [int(bos)] if isinstance(bos, int) else []


def _tokens(ids, session, what: str) -> list[int]:
    tokens = session.tokens(ids)
    if what != "prefix" and len(tokens) == 0:
        raise InvalidInputError(f"{what} is empty")
    return tokens.tolist()


def segment_kv(kdn, model, session, prefix: list[int], segment: list[int]) -> tuple[list[torch.Tensor], bool]:
    """The KV of ``segment`` computed behind ``prefix`` (positions len(prefix)...), from kdn or computed
    and stored. Returns (per-layer [1, kv_heads, len(segment), head_dim] tensors on the model's device,
    was_stored)."""
    device = next(model.parameters()).device
    key = session.segment_key(session.tokens(prefix), session.tokens(segment))
    kv = kdn.segments.read(session, key, len(prefix), len(segment), HFTarget(device))
    if kv is not None:
        return kv, True
    ids = torch.tensor([prefix + segment], device=device)
    with torch.inference_mode():
        kv_full = cache_to_kv_list(prefill_cache(model, ids))
    kdn.segments.write(session, key, [t.cpu() for t in kv_full], len(prefix), len(segment))
    return [t[:, :, len(prefix):].contiguous() for t in kv_full], False


def prompt_tokens(session, model, segments, query, prefix=None):
    """Checked token lists ``(prefix, segments, query)`` and the whole prompt ``prefix + segments + query``."""
    prefix = default_prefix(model) if prefix is None else _tokens(prefix, session, "prefix")
    segs = [_tokens(s, session, "segment") for s in segments]
    query = _tokens(query, session, "query")
    return prefix, segs, query, prefix + [t for s in segs for t in s] + query


def store_segments(kdn, model, segments, prefix=None) -> dict:
    """Compute (or find) and store every segment's KV; returns counts of computed and already stored."""
    session = kdn.session(model)
    check_supported(model)
    prefix = default_prefix(model) if prefix is None else _tokens(prefix, session, "prefix")
    jobs = ([([], prefix)] if prefix else []) + [(prefix, _tokens(s, session, "segment")) for s in segments]
    hits = [segment_kv(kdn, model, session, behind, seg)[1] for behind, seg in jobs]
    return {"already_stored": sum(hits), "computed": len(hits) - sum(hits)}


def blend(kdn, model, segments, query, prefix=None, recompute_ratio: float = 0.15, mode: str = "blend",
          check_layer: int = 1, selection: str = "kv", load=None):
    """KV cache for ``prefix + segments + query[:-1]`` built from separately cached segments.

    Returns ``(cache, stats)``: a DynamicCache covering the first ``stats["tokens"]`` prompt tokens
    (``None`` for ``full``), so ``model.generate(ids, past_key_values=cache)`` computes the rest.
    ``selection`` is the rule that picks the recomputed tokens (:data:`SELECTIONS`; see
    :mod:`kdn.blend.recompute`). ``load``: how the ``prefix`` mode reads the stored prefix as an HF
    cache (the HF face's :func:`kdn.integrations.hf.load_cache`, layer-wise on the CPU); None: whole.
    """
    if mode not in MODES:
        raise InvalidInputError(f"blend mode {mode!r}; choose one of {', '.join(MODES)}")
    if selection not in SELECTIONS:
        raise InvalidInputError(f"blend selection {selection!r}; choose one of {', '.join(SELECTIONS)}")
    if isinstance(recompute_ratio, bool) or not isinstance(recompute_ratio, numbers.Real) \
            or not 0.0 <= recompute_ratio <= 1.0:
        raise InvalidInputError(f"recompute_ratio must be a number within [0, 1], got {recompute_ratio!r}")
    session = kdn.session(model)
    layout = session.layout
    check_supported(model)
    prefix, segs, query, ids = prompt_tokens(session, model, segments, query, prefix)
    n_ctx, device = len(ids) - len(query), next(model.parameters()).device
    stats = {"mode": mode, "prompt_tokens": len(ids), "context_tokens": n_ctx, "segments": len(segs)}
    t0 = time.perf_counter()
    if mode == "full":
        return None, {**stats, "tokens": 0, "segment_hits": 0, "blend_s": 0.0}
    if mode == "prefix":
        tokens = session.tokens(ids)
        if load is not None:
            cache, got = load(kdn, model, tokens, len(ids) - 1)
        else:
            got = kdn.load(session, tokens, len(ids) - 1, HFTarget(device))
            cache = kv_list_to_cache(model, got.result) if got.hit else None
        return cache, {**stats, "tokens": got.hit, "segment_hits": 0, "blend_s": time.perf_counter() - t0}
    parts, hits, offset, spans = [], 0, 0, []
    if prefix:
        kv, hit = segment_kv(kdn, model, session, [], prefix)
        parts.append(kv)
        hits, offset = hits + hit, len(prefix)
    for seg in segs:
        kv, hit = segment_kv(kdn, model, session, prefix, seg)
        shift_keys(model, kv, offset - len(prefix))  # stored at len(prefix), used at offset
        parts.append(kv)
        spans.append((offset, offset + len(seg)))
        hits, offset = hits + hit, offset + len(seg)
    n = n_ctx if mode == "naive" else len(ids) - 1
    kv = [torch.empty((1, layout.kv_heads, n, layout.head_dim), dtype=layout.torch_dtype, device=device)
          for _ in range(2 * layout.layers)]
    for i, t in enumerate(kv):
        t[:, :, :n_ctx] = torch.cat([p[i].to(device) for p in parts], dim=2)
    stats.update(segment_hits=hits)
    if mode == "blend":
        ids_t = torch.tensor([ids[:-1]], device=device)
        kv, extra = selective_prefill(model, ids_t, kv, n_ctx, float(recompute_ratio), check_layer, selection, spans)
        stats.update(extra, recompute_ratio=float(recompute_ratio), selection=selection)
    return kv_list_to_cache(model, kv), {**stats, "tokens": n, "blend_s": time.perf_counter() - t0}


__all__ = ["MODES", "SELECTIONS", "UnsupportedModelError", "blend", "store_segments", "segment_kv", "default_prefix",
           "prompt_tokens"]
