"""CacheBlend selective recompute for HF Llama-family models, running the model's own modules.

Given a prompt whose first ``n_cached`` tokens have KV from separately computed segments (keys
already re-rotated to their positions), the first layers up to ``check_layer`` are computed for
every token; at ``check_layer`` the tokens whose fresh K/V deviate most from the cached ones are
chosen (``ratio`` of the cached tokens; tokens without cached KV are always computed), and the
later layers compute Q/K/V, attention and MLP for the chosen tokens only, writing their K/V into
the blended cache. Each chosen token attends to every key at or before its own position (a causal
mask over true positions; CacheBlend's reference implementation lets them see later keys too).
``ratio=1.0`` computes every token in every layer: the result equals a full prefill.

Which tokens are recomputed is one switch, ``selection`` (:data:`SELECTIONS`):

* ``"kv"`` (default): once, at ``check_layer``, the ``ratio`` of cached tokens whose K and V
  deviate most (squared L2 over heads and channels).
* ``"v"``: the same on V's deviation alone (keys mix rotating channel pairs after RoPE).
* ``"gradual"``: CacheBlend's gradual filtering: ``3 * ratio`` at ``check_layer``, then ``2x``,
  ``1.5x`` and ``1x`` in the next layers, each re-ranked on that layer's fresh K/V deviation.
* ``"first-k"``: EPIC-style, by position: the first ``ceil(ratio * len)`` tokens of every segment
  (where attention sinks form at passage starts), chosen before layer 0, so no layer computes the
  rest (the cheapest: no full layers before the check).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kdn.rope import UnsupportedModelError, inv_freq

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SELECTIONS = ("kv", "v", "gradual", "first-k")
_GRADUAL = (3.0, 2.0, 1.5, 1.0)  # multiples of the ratio kept at check_layer, check_layer + 1, ...
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")


def check_supported(model) -> None:
    """Raise UnsupportedModelError naming the architecture and what is missing."""
    arch = type(model).__name__
    inner = getattr(model, "model", None)
    missing = [f"model.{p}" for p in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, p)]
    if not missing:
        layer = inner.layers[0]
        missing += [f"layers[i].{p}" for p in _LAYER_PARTS if not hasattr(layer, p)]
        attn = getattr(layer, "self_attn", None)
        missing += [f"self_attn.{p}" for p in _ATTN_PARTS if not hasattr(attn, p)]
        missing += [f"no self_attn.{p} (per-head norms)" for p in ("q_norm", "k_norm") if hasattr(attn, p)]
    if arch not in SUPPORTED or missing:
        reasons = ([] if arch in SUPPORTED else [f"architecture not in {', '.join(SUPPORTED)}"]) + missing
        raise UnsupportedModelError(f"{arch} cannot be blended: " + "; ".join(reasons))
    inv_freq(model)  # refuses unsupported RoPE scaling


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def selective_prefill(model, ids: torch.Tensor, kv: list[torch.Tensor], n_cached: int, ratio: float,
                      check_layer: int = 1, selection: str = "kv",
                      segments: list[tuple[int, int]] | None = None) -> tuple[list[torch.Tensor], dict]:
    """Compute the KV of ``ids`` ([1, n]) reusing ``kv``'s first ``n_cached`` tokens where it can.

    ``kv`` is a per-layer list ``[k0, v0, ...]`` of [1, kv_heads, n, head_dim] tensors whose first
    ``n_cached`` tokens hold the cached (re-rotated) KV; it is updated in place and returned with
    stats ``{"recomputed_per_layer": [...], "selected": positions finally chosen}``. ``selection``
    picks the rule (module docstring); ``segments`` (``[start, end)`` per cached segment) is what
    ``"first-k"`` reads.
    """
    check_supported(model)
    n = ids.shape[1]
    inner, config = model.model, model.config
    layers = inner.layers
    check_layer = min(check_layer, len(layers) - 1)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    positions = torch.arange(n, device=ids.device)
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, positions[None])
    sel = positions
    recomputed, selected = [], None
    schedule = _schedule(selection, ratio, check_layer, len(layers))
    if selection == "first-k" and ratio < 1.0:  # chosen by position, before any layer runs
        sel = _first_tokens(segments or [(0, n_cached)], ratio, n, n_cached, ids.device)
        h, selected = h[:, sel], sel
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        k_cache, v_cache = kv[2 * index], kv[2 * index + 1]
        x = layer.input_layernorm(h)
        shape = (1, len(sel), -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        c, s = cos[:, sel][:, None], sin[:, sel][:, None]
        q, k = _rotate(q, c, s), _rotate(k, c, s)
        keep = None
        if index in schedule:
            keep = _select(k, v, k_cache, v_cache, sel, n_cached, schedule[index], selection != "v")
            selected = sel[keep]
        k_cache[:, :, sel] = k.to(k_cache.dtype)
        v_cache[:, :, sel] = v.to(v_cache.dtype)
        recomputed.append(len(sel))  # tokens whose K/V this layer computed
        if keep is not None:
            q, h, sel = q[:, :, keep], h[:, keep], sel[keep]
        mask = positions[None, :] <= sel[:, None]  # [chosen, n]: keys at or before each token
        if window:
            mask &= positions[None, :] > sel[:, None] - window
        groups = q.shape[1] // k_cache.shape[1]
        out = F.scaled_dot_product_attention(q, _repeat_kv(k_cache, groups).to(q.dtype),
                                             _repeat_kv(v_cache, groups).to(q.dtype), attn_mask=mask[None, None],
                                             scale=attn.scaling)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(1, len(sel), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return kv, {"recomputed_per_layer": recomputed, "selected": selected.tolist() if selected is not None else None}


def _schedule(selection: str, ratio: float, check_layer: int, layers: int) -> dict[int, float]:
    """{layer: share of the cached tokens kept from that layer on} for the deviation-based rules."""
    if ratio >= 1.0 or selection == "first-k":
        return {}
    if selection == "gradual":
        return {check_layer + i: min(1.0, m * ratio) for i, m in enumerate(_GRADUAL) if check_layer + i < layers}
    return {check_layer: ratio}


def _first_tokens(segments, ratio: float, n: int, n_cached: int, device) -> torch.Tensor:
    """Positions of the first ``ceil(ratio * len)`` tokens of each segment, and every uncached one."""
    keep = torch.zeros(n, dtype=torch.bool, device=device)
    for start, end in segments:
        keep[start:start + math.ceil(ratio * (end - start))] = True
    keep[n_cached:] = True
    return keep.nonzero().flatten()


def _select(k, v, k_cache, v_cache, sel, n_cached, share: float, use_keys: bool = True) -> torch.Tensor:
    """Indices (into ``sel``) of the tokens to keep computing: ``share`` of all cached tokens (at
    most those still selected), those whose V (and K, with ``use_keys``) deviate most from the
    cache (squared L2 over heads and channels), plus every uncached token."""
    cached = sel < n_cached
    deviation = ((v - v_cache[:, :, sel].to(v.dtype)) ** 2).sum(dim=(0, 1, 3))
    if use_keys:
        deviation += ((k - k_cache[:, :, sel].to(k.dtype)) ** 2).sum(dim=(0, 1, 3))
    count = min(int(cached.sum()), math.ceil(share * n_cached))
    top = torch.topk(deviation.masked_fill(~cached, float("-inf")), count).indices if count else sel[:0]
    keep = torch.zeros_like(cached)
    keep[top] = True
    keep |= ~cached
    return keep.nonzero().flatten()
