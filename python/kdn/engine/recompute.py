"""CacheBlend's selective recompute over any model's layers: which tokens of a blended cache are
computed again, layer by layer, and their K/V written over the reused ones. Model-free: a face hands
its model's layers as a :class:`LayerStack` (HF's modules, :mod:`kdn.blend.recompute`; a vLLM
engine's own, :mod:`kdn.integrations.vllm.blend`), so both faces select and recompute by this code.

Given a prompt whose first ``n_cached`` tokens have KV from separately computed segments (keys
already re-rotated to their positions), the layers up to ``check_layer`` are computed for every
token; at ``check_layer`` the tokens whose fresh K/V deviate most from the cached ones are chosen
(``ratio`` of the cached tokens; tokens without cached KV are always computed), and the later
layers compute Q/K/V, attention and MLP for the chosen tokens only, writing their K/V into the
blended cache. Each chosen token attends to every key at or before its own position (a causal mask
over true positions; CacheBlend's reference implementation lets them see later keys too).
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
from typing import Protocol

import torch
import torch.nn.functional as F

SELECTIONS = ("kv", "v", "gradual", "first-k")
_GRADUAL = (3.0, 2.0, 1.5, 1.0)  # multiples of the ratio kept at check_layer, check_layer + 1, ...


class LayerStack(Protocol):
    """A decoder's layers as the recompute runs them (hidden states ``[1, tokens, hidden]``; Q/K/V
    ``[1, heads, tokens, head_dim]``)."""

    layers: int
    window: int | None  # a sliding window every layer applies, or None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids`` ([1, n])."""

    def qkv(self, index: int, h: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Layer ``index``'s (q, k, v) of hidden states ``h`` at ``positions``, q and k rotated there,
        and the attention's scale."""

    def finish(self, index: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The hidden states after layer ``index`` from its input ``h`` and its attention's output
        ``attended`` ([1, tokens, heads * head_dim]): output projection, residuals and MLP."""


def missing_parts(model, model_parts: tuple, layer_parts: tuple, attention_parts: tuple) -> list[str]:
    """What a decoder ``model`` (``model.model.layers[i].self_attn``, as HF's and vLLM's Llama family
    nest them) lacks of the parts a :class:`LayerStack` over it runs, and per-head norms it has that
    the stack would skip; empty when it has them all."""
    inner = getattr(model, "model", None)
    missing = [f"model.{p}" for p in model_parts if not hasattr(inner, p)]
    if not missing:
        layer = inner.layers[0]
        missing += [f"layers[i].{p}" for p in layer_parts if not hasattr(layer, p)]
        attn = getattr(layer, "self_attn", None)
        missing += [f"self_attn.{p}" for p in attention_parts if not hasattr(attn, p)]
        missing += [f"no self_attn.{p} (per-head norms)" for p in ("q_norm", "k_norm") if hasattr(attn, p)]
    return missing


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@torch.inference_mode()
def selective_prefill(stack: LayerStack, ids: torch.Tensor, kv: list[torch.Tensor], n_cached: int, ratio: float,
                      check_layer: int = 1, selection: str = "kv",
                      segments: list[tuple[int, int]] | None = None) -> tuple[list[torch.Tensor], dict]:
    """Compute the KV of ``ids`` ([1, n]) through ``stack``, reusing ``kv``'s first ``n_cached`` tokens
    where it can.

    ``kv`` is a per-layer list ``[k0, v0, ...]`` of [1, kv_heads, n, head_dim] tensors whose first
    ``n_cached`` tokens hold the cached (re-rotated) KV; it is updated in place and returned with
    stats ``{"recomputed_per_layer": [...], "selected": positions finally chosen}``. ``selection``
    picks the rule (module docstring); ``segments`` (``[start, end)`` per cached segment) is what
    ``"first-k"`` reads.
    """
    n = ids.shape[1]
    check_layer = min(check_layer, stack.layers - 1)
    positions = torch.arange(n, device=ids.device)
    h = stack.embed(ids)
    sel = positions
    recomputed, selected = [], None
    schedule = _schedule(selection, ratio, check_layer, stack.layers)
    if selection == "first-k" and ratio < 1.0:  # chosen by position, before any layer runs
        sel = _first_tokens(segments or [(0, n_cached)], ratio, n, n_cached, ids.device)
        h, selected = h[:, sel], sel
    for index in range(stack.layers):
        k_cache, v_cache = kv[2 * index], kv[2 * index + 1]
        q, k, v, scale = stack.qkv(index, h, sel)
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
        if stack.window:
            mask &= positions[None, :] > sel[:, None] - stack.window
        groups = q.shape[1] // k_cache.shape[1]
        out = F.scaled_dot_product_attention(q, _repeat_kv(k_cache, groups).to(q.dtype),
                                             _repeat_kv(v_cache, groups).to(q.dtype), attn_mask=mask[None, None],
                                             scale=scale)
        h = stack.finish(index, h, out.transpose(1, 2).reshape(1, len(sel), -1))
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
