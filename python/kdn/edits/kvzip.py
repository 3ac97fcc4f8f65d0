"""KVzip pruning (arXiv 2505.23416): score every cached (layer, KV head, token) by the largest
attention it receives while the model reconstructs the context, keep the best of each chunk.

The score pass runs the model over ``instruction + context`` on top of the context's own KV, in
pieces of ``piece`` tokens (long contexts never hold a full attention matrix), through an attention
function registered with transformers' ``AttentionInterface`` (eager math, plus a running max of
the probabilities each context key receives, over the query heads of its group and over every
reconstruction query). Model code is never patched.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kdn._core import InvalidInputError
from kdn.layout import cache_arg, kv_list_to_cache

INSTRUCTION = "\n\nRepeat the previous context exactly.\n\n"
_NAME = "kdn_kvzip_score"
_state = threading.local()


def _scoring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention (query [b, q_heads, q, d], key/value [b, kv_heads, kv, d]) that also folds
    the largest probability each of the first ``n`` keys receives into this layer's scores."""
    groups = query.shape[1] // key.shape[1]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : k.shape[-2]]
    probs = torch.softmax(weights, dim=-1, dtype=torch.float32)
    scores = _state.scores[module.layer_idx]
    n = scores.shape[-1]
    seen = probs[0, :, :, :n].amax(dim=1).view(key.shape[1], groups, n).amax(dim=1)  # [kv_heads, n]
    torch.maximum(scores, seen.to(scores.device), out=scores)
    out = torch.matmul(probs.to(value.dtype), v).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(_NAME, _scoring_attention)
AttentionMaskInterface.register(_NAME, eager_mask)


@torch.inference_mode()
def scores(model, kv: list[torch.Tensor], context_ids: list[int], instruction_ids: list[int],
           piece: int = 256) -> list[torch.Tensor]:
    """Per layer, ``[kv_heads, n]`` fp32: the largest attention each of the context's ``n`` cached
    tokens receives while the model reads ``instruction_ids + context_ids`` after ``kv`` (the
    context's KV, ``2 * layers`` tensors ``[1, kv_heads, n, head_dim]``)."""
    n, layers = kv[0].shape[2], len(kv) // 2
    if not hasattr(model, "set_attn_implementation"):
        raise InvalidInputError(f"kvzip: {type(model).__name__} cannot switch its attention implementation")
    before = model.config._attn_implementation
    _state.scores = [torch.zeros(kv[0].shape[1], n) for _ in range(layers)]
    cache = kv_list_to_cache(model, list(kv))  # grows by concatenation: kv itself is not modified
    device = kv[0].device
    stream = list(instruction_ids) + list(context_ids)
    try:
        model.set_attn_implementation(_NAME)
        for start in range(0, len(stream), piece):
            ids = torch.tensor([stream[start:start + piece]], device=device)
            model(ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
        return _state.scores
    finally:
        model.set_attn_implementation(before)
        del _state.scores


def kept(keep: float, tokens: int) -> int:
    """How many of ``tokens`` a chunk keeps per layer and head: ``round(keep * tokens)``, at least 1."""
    return max(1, min(tokens, round(keep * tokens)))


def select(layer_scores: torch.Tensor, start: int, end: int, keep: float, sink: int) -> torch.Tensor:
    """``[kv_heads, k]`` ascending token indices kept from ``[start, end)``: the :func:`kept` highest
    scores per head, positions below ``sink`` always."""
    span = layer_scores[:, start:end].clone()
    first_sinks = max(0, min(sink, end) - start)
    span[:, :first_sinks] = float("inf")
    return torch.topk(span, kept(keep, end - start), dim=1).indices.sort(dim=1).values + start


def prune(kv: list[torch.Tensor], layer_scores: list[torch.Tensor], start: int, end: int, keep: float,
          sink: int) -> list[torch.Tensor]:
    """The kept rows of ``kv`` in ``[start, end)``: ``2 * layers`` tensors ``[1, kv_heads, k, dim]``
    (each head its own tokens, in position order; RoPE untouched, so positions are preserved)."""
    out = []
    for layer, s in enumerate(layer_scores):
        idx = select(s, start, end, keep, sink).to(kv[0].device)
        for t in kv[2 * layer: 2 * layer + 2]:
            gather = idx[None, :, :, None].expand(1, idx.shape[0], idx.shape[1], t.shape[-1])
            out.append(torch.gather(t, 2, gather).contiguous())
    return out
