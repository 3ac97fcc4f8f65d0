"""KVzip pruning (arXiv 2505.23416): score every cached (layer, KV head, token) by the largest
attention it receives while the model reconstructs the context, keep the best across the whole
deposit (ranked together over layers, heads and tokens: KVzip's non-uniform budget).

The score pass runs the model over ``instruction + context`` on top of the context's own KV, in
pieces of ``piece`` tokens (long contexts never hold a full attention matrix), through an attention
function registered with transformers' ``AttentionInterface`` (eager math, plus a running max of
the probabilities each context key receives, over the query heads of its group and over every
reconstruction query). Model code is never patched.

Storage stays dense: a chunk's kept triples are pooled into ``[1, kv_heads, rows, dim]`` tensors
per layer (:func:`slots`; the element-wise codecs code them), filed beside a bitmask of what was
kept; the reader puts each head's rows back in position order and pads the shorter heads with rows
that an attention bias of -inf hides (:func:`unpool`, :func:`padding_bias`). Uniform per-head
budgets were measured first and lost to this (Qwen2.5-0.5B, the demo's 5 questions at keep 0.5: 2
right vs 4, the full prefill's count; docs/results/editing.md, "Pruning at deposit").

``kvtc`` cannot code pooled rows (its rows are tokens; a pooled row mixes tokens across heads). With
a per-head calibration (:func:`kdn.kvtc.fit`, ``per_head=True``) a chunk is instead filed *masked*:
in its own layout with the dropped (layer, head, token) rows zeroed, which that codec codes for one
bit each (:func:`masked`). The mask's sidecar says which layout a chunk's rows have.
"""

from __future__ import annotations

import threading

import blake3
import numpy as np
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


def chosen(layer_scores: list[torch.Tensor], tokens: int, keep: float, sink: int) -> torch.Tensor:
    """``[layers, kv_heads, tokens]`` bool: the ``keep`` share of all (layer, head, token) triples of
    the first ``tokens`` with the highest scores, ranked together across layers and heads (KVzip's
    non-uniform budget: a head that reads much keeps much), positions below ``sink`` always."""
    s = torch.stack([sc[:, :tokens] for sc in layer_scores]).clone()
    s[:, :, :sink] = float("inf")
    mask = torch.zeros(s.numel(), dtype=torch.bool)
    mask[torch.topk(s.flatten(), kept(keep, s.numel())).indices] = True
    return mask.view(s.shape)


def kept(keep: float, count: int) -> int:
    """How many of ``count`` (layer, head, token) triples are kept: ``round(keep * count)``, at least 1."""
    return max(1, min(count, round(keep * count)))


def pooled_rows(mask: torch.Tensor) -> int:
    """Rows per layer and head a chunk's pooled tensors hold: ``ceil(kept / (layers * kv_heads))``,
    at least 1 (a chunk that kept nothing still stores one empty row)."""
    layers, heads, _ = mask.shape
    return max(1, -(-int(mask.sum()) // (layers * heads)))


def slots(mask: torch.Tensor) -> torch.Tensor:
    """Where a chunk's kept triples are stored: ``[layers, kv_heads, rows]`` int64, each slot the
    flat index ``(layer * kv_heads + head) * chunk + token`` of the triple it holds, -1 if empty.
    ``rows = ceil(kept / (layers * kv_heads))`` so the stored tensor is dense. Each (layer, head)
    lane holds its own triples first (in token order); the triples of lanes that keep more than
    ``rows`` fill the free slots at the ends of the other lanes, in order (a lane's spill stays
    together). An element-wise codec groups a lane's consecutive rows (int4: 32 per channel), so a
    lane holds as few other heads' rows as it can: Qwen2.5's heads differ in key scale by orders of
    magnitude. A function of the chunk's mask alone: the reader places rows as the writer did."""
    layers, heads, chunk = mask.shape
    rows = pooled_rows(mask)
    flat = mask.reshape(layers * heads, chunk)
    rank = flat.cumsum(-1) - 1
    index = torch.arange(flat.numel()).view(flat.shape)
    own = flat & (rank < rows)
    src = torch.full((layers * heads, rows), -1, dtype=torch.int64)
    src[own.nonzero()[:, 0], rank[own]] = index[own]
    spill = index[flat & (rank >= rows)]
    free = (src.view(-1) == -1).nonzero().flatten()[: len(spill)]
    src.view(-1)[free] = spill
    return src.view(layers, heads, rows)


def masked(kv: list[torch.Tensor], mask: torch.Tensor, start: int) -> list[torch.Tensor]:
    """A chunk's KV (``mask`` over the tokens from ``start``) in its own layout, ``2 * layers``
    tensors ``[1, kv_heads, chunk, dim]`` with every dropped row zero: the masked layout."""
    layers, _, chunk = mask.shape
    return [(kv[2 * layer + part][:, :, start:start + chunk] * mask[layer][None, :, :, None].to(kv[0].dtype))
            .contiguous() for layer in range(layers) for part in (0, 1)]


def turn(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor | None) -> torch.Tensor:
    """``keys`` ``[n, head_dim]`` (RoPE rotate-half) moved by ``delta`` ``[n]`` positions each."""
    if inv_freq is None:
        return keys
    angle = delta.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(keys.dtype), torch.cat([angle.sin()] * 2, -1).to(keys.dtype)
    half = keys.shape[-1] // 2
    return keys * cos + torch.cat([-keys[:, half:], keys[:, :half]], -1) * sin


def pool(kv: list[torch.Tensor], mask: torch.Tensor, start: int, inv_freq: torch.Tensor | None = None) -> list:
    """A chunk's kept rows (``mask`` over the tokens from ``start``) as ``2 * layers`` dense tensors
    ``[1, kv_heads, rows, dim]`` laid out by :func:`slots` (empty slots are zero). With the model's
    RoPE ``inv_freq``, each kept key is moved from its position to its slot's row (as if computed
    there), so a codec that undoes RoPE by row (``kvtc``) sees keys it was calibrated on."""
    layers, heads, chunk = mask.shape
    src = slots(mask).view(-1)
    rows = src.shape[0] // (layers * heads)
    out = []
    for part in (0, 1):  # keys, values
        flat = torch.stack([kv[2 * layer + part][0, :, start:start + chunk] for layer in range(layers)])
        flat = flat.reshape(layers * heads * chunk, -1)
        placed = flat[src.clamp(min=0)] * (src >= 0).unsqueeze(1).to(flat.dtype)
        if part == 0:
            placed = turn(placed, torch.arange(len(src)) % rows - (start + src % chunk), inv_freq)
        out.append(placed.view(layers, heads, rows, -1))
    return [out[part][layer].unsqueeze(0).contiguous() for layer in range(layers) for part in (0, 1)]


def unpool(parts: list[tuple], inv_freq: torch.Tensor | None = None) -> tuple:
    """``(kv, held)`` from the chunks' ``(mask, pooled rows)`` in prompt order (keys moved back to
    their positions with ``inv_freq``, as :func:`pool` moved them), or ``(mask, rows, True)`` for a
    chunk in the :func:`masked` layout: ``2 * layers``
    tensors ``[1, kv_heads, m, dim]`` holding each head's kept rows in position order, ``m`` the
    most any head keeps, heads with fewer padded with zero rows after theirs; ``held``
    ``[layers, kv_heads]``, each head's real row count (:func:`padding_bias` masks the rest)."""
    layers, heads, chunk = parts[0][0].shape
    counts = torch.stack([part[0].sum(-1) for part in parts])  # [chunks, layers, heads]
    held = counts.sum(0)
    m = int(held.max())
    ref = parts[0][1][0]
    dim = ref.shape[-1]
    out = [torch.zeros(layers * heads * m, dim, dtype=ref.dtype, device=ref.device) for _ in (0, 1)]
    base = torch.zeros(layers, heads, dtype=torch.int64)
    for c, ((mask, rows, *layout), count) in enumerate(zip(parts, counts)):
        if layout and layout[0]:  # masked: each kept row where it was computed, keys unmoved
            layer, head, token = mask.nonzero().unbind(1)
            valid, delta = (layer * heads + head) * chunk + token, None
        else:
            src = slots(mask).view(-1)
            valid = (src >= 0).nonzero().flatten()
            s = src[valid]
            layer, head, token = s // (heads * chunk), (s // chunk) % heads, s % chunk
            delta = (c * chunk + token) - valid % (len(src) // (layers * heads))
        rank = (mask.cumsum(-1) - 1)[layer, head, token]
        dest = ((layer * heads + head) * m + base[layer, head] + rank).to(ref.device)
        valid = valid.to(ref.device)
        for part in (0, 1):
            pooled = torch.cat([rows[2 * li + part][0] for li in range(layers)]).reshape(-1, dim)[valid]
            if part == 0 and inv_freq is not None and delta is not None:
                pooled = turn(pooled, delta.to(ref.device), inv_freq.to(ref.device))
            out[part][dest] = pooled
        base += count
    kv = [out[part].view(layers, heads, m, dim)[layer].unsqueeze(0) for layer in range(layers) for part in (0, 1)]
    return kv, held


def padding_bias(held: torch.Tensor, query_heads: int, after: int = 0) -> dict:
    """``{layer: [query_heads, m + after] fp32}``: -inf on the padding rows :func:`unpool` added
    (each query head reads its KV head's rows; the ``after`` rows appended past them are read by
    every head), for the layers that have any; run the model under
    :func:`kdn.edits.steer.applied` with it."""
    layers, heads = held.shape
    m = int(held.max())
    rows = torch.arange(m + after)
    out = {}
    for layer in range(layers):
        if bool((held[layer] < m).any()):
            pad = torch.where((rows[None, :] < held[layer][:, None]) | (rows[None, :] >= m), 0.0, float("-inf"))
            out[layer] = pad.repeat_interleave(query_heads // heads, dim=0)
    return out


def pack_mask(mask: torch.Tensor, layout_masked: bool = False) -> bytes:
    """A chunk's ``[layers, kv_heads, chunk]`` mask as bits (stored beside its rows), then one byte
    1 when the rows are in the :func:`masked` layout (none: pooled)."""
    return np.packbits(mask.numpy().reshape(-1)).tobytes() + (b"\x01" if layout_masked else b"")


def unpack_mask(payload: bytes, layers: int, heads: int, chunk: int) -> torch.Tensor | None:
    """The mask :func:`pack_mask` stored, or None when ``payload`` is not one of that shape."""
    count = layers * heads * chunk
    n = -(-count // 8)
    if not (len(payload) == n or len(payload) == n + 1 and payload[-1:] == b"\x01"):
        return None
    bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, count=n))[:count]
    return torch.from_numpy(bits.astype(bool)).view(layers, heads, chunk)


def is_masked(payload: bytes, mask: torch.Tensor) -> bool:
    """Whether the chunk whose mask sidecar is ``payload`` has its rows in the :func:`masked` layout."""
    return len(payload) == -(-mask.numel() // 8) + 1


def stored_rows(payload: bytes, mask: torch.Tensor) -> int:
    """Rows per (layer, head) the chunk's stored tensors hold: its length when masked, else
    :func:`pooled_rows`."""
    return mask.shape[-1] if is_masked(payload, mask) else pooled_rows(mask)


def rows_address(address: bytes, mask_payload: bytes) -> bytes:
    """Where a chunk's pooled rows are filed: a hash of its edit address and its mask, so rows are
    only ever read with the mask they were placed by (a later deposit that chose other rows files
    them elsewhere), and of the version of :func:`slots` that placed them (2: lane-first; rows
    placed by another version are never found, a miss rather than rows read out of place)."""
    return blake3.blake3(b"kdn/kvzip-rows/2\0" + address + mask_payload).digest(len(address))
