"""Attention steering at deposit (PASTA, arXiv 2311.02262): emphasized tokens of a stored context,
kept in a sidecar beside its exact KV, steer a profiled set of attention heads of every later reader.

For each steered (layer, query head), attention to the context's non-emphasized tokens is scaled by
``alpha`` (then renormalised): a bias of ``log(alpha)`` on their attention logits. The KV itself is
the exact KV (never rewritten); what is stored is a sidecar per full chunk (one flag per token:
emphasized or not) under the edit's address, and once per model a head profile (which heads steer
best), stored through the tiers like a kvtc calibration, keyed by the model fingerprint.

The bias is applied through an attention function registered with transformers'
``AttentionInterface`` (sdpa with an additive mask; model code is never patched). A reader that
does not name the edit gets the exact KV and the model's own attention: output bit-identical to an
unedited hit.

Head profiling (PASTA profiles heads by task gain; this is the same measure on a synthetic probe
task): contexts with one emphasized fact buried in filler text, the question about it; each (layer,
head) is steered alone over the cached context and scored by how much the answer's log-probability
rises. The ``heads`` best are steered.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import threading

import blake3
import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kdn._core import InvalidInputError
from kdn.layout import cache_arg, cache_to_kv_list, kv_list_to_cache, output_cache

_NAME = "kdn_steer"
_state = threading.local()
PROFILE_VERSION = 1


def _steered_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention with this thread's steering bias added for the steered heads of this layer:
    ``_state.bias[layer]`` is ``[query_heads, n]`` (or ``[batch, query_heads, n]``: a bias per
    batch row) over the first ``n`` keys (the stored context)."""
    bias = getattr(_state, "bias", {}).get(module.layer_idx)
    if bias is not None:
        kv = key.shape[2]
        n = min(bias.shape[-1], kv)
        add = torch.zeros(*bias.shape[:-1], kv, dtype=query.dtype, device=query.device)
        add[..., :n] = bias[..., :n].to(device=query.device, dtype=query.dtype)
        add = add.unsqueeze(-2) if add.dim() == 3 else add[None, :, None, :]  # [batch or 1, heads, 1, kv]
        base = attention_mask[:, :, :, :kv] if attention_mask is not None else 0
        attention_mask = base + add
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(_NAME, _steered_attention)
AttentionMaskInterface.register(_NAME, eager_mask)


def biases(heads: list, alpha: float, emphasized: np.ndarray, query_heads: int, layers: int) -> dict:
    """``{layer: [query_heads, n] fp32}``: ``log(alpha)`` on the non-emphasized tokens of each
    steered head (``heads``: ``(layer, head)`` pairs), 0 elsewhere; layers with no steered head absent."""
    penalty = torch.from_numpy(np.where(emphasized, 0.0, math.log(alpha)).astype(np.float32))
    out: dict = {}
    for layer, head in heads:
        if not 0 <= layer < layers or not 0 <= head < query_heads:
            continue
        if layer not in out:
            out[layer] = torch.zeros(query_heads, len(emphasized))
        out[layer][head] = penalty
    return out


def check_model(model) -> None:
    """A model whose attention cannot take a bias through transformers' attention interface is an
    InvalidInputError at the call."""
    if not hasattr(model, "set_attn_implementation") or getattr(model.config, "_attn_implementation", None) is None:
        raise InvalidInputError(f"steer: {type(model).__name__} cannot switch its attention implementation, "
                                "so its attention cannot take a steering bias")


@contextlib.contextmanager
def applied(model, layer_biases: dict):
    """Run ``model`` with ``layer_biases`` (:func:`biases`) on its attention; restored on exit."""
    check_model(model)
    before = model.config._attn_implementation
    previous = getattr(_state, "bias", None)
    _state.bias = layer_biases
    model.set_attn_implementation(_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
        _state.bias = previous if previous is not None else {}


# -- sidecars --------------------------------------------------------------------------------------
def pack_flags(emphasized: np.ndarray) -> bytes:
    """A chunk's sidecar payload: its token count (u32) and one bit per token (1: emphasized)."""
    return np.uint32(len(emphasized)).tobytes() + np.packbits(emphasized.astype(np.uint8)).tobytes()


def unpack_flags(payload: bytes) -> np.ndarray:
    n = int(np.frombuffer(payload[:4], dtype=np.uint32)[0])
    bits = np.unpackbits(np.frombuffer(payload[4:], dtype=np.uint8))
    if len(bits) < n:
        raise InvalidInputError("steer: a sidecar shorter than its token count")
    return bits[:n].astype(bool)


def token_mask(spans, length: int, offsets=None) -> np.ndarray:
    """One flag per token, set inside ``spans`` (``[(start, end), ...]``, end exclusive): token
    indices, or character offsets of the text when ``offsets`` (each token's ``(start, end)``
    characters) is given. A span that is empty or runs outside the prompt is an InvalidInputError."""
    if not spans:
        raise InvalidInputError("steer: give the emphasized spans at deposit (emphasize=[(start, end), ...])")
    limit = length if offsets is None else max((e for _, e in offsets), default=0)
    mask = np.zeros(length, dtype=bool)
    for span in spans:
        try:
            start, end = (int(v) for v in span)
        except (TypeError, ValueError):
            raise InvalidInputError(f"steer: a span is (start, end), got {span!r}") from None
        what = "tokens" if offsets is None else "characters"
        if not 0 <= start < end <= limit:
            raise InvalidInputError(f"steer: span ({start}, {end}) is outside the prompt's {limit} {what}")
        if offsets is None:
            mask[start:end] = True
        else:
            for i, (a, b) in enumerate(offsets):
                if b > start and a < end:
                    mask[i] = True
    return mask


# -- head profile ----------------------------------------------------------------------------------
def profile_key(fingerprint: bytes) -> bytes:
    """Where a model's head profile is filed (16 bytes, from the model fingerprint)."""
    return blake3.blake3(b"kdn/steer-profile\0%d\0" % PROFILE_VERSION + fingerprint).digest(16)


NAMES = ["Aldren", "Brisca", "Corvel", "Dunmore", "Elspeth", "Farrow", "Galen", "Hollis", "Isolde", "Jaspar",
         "Kestrel", "Lorcan", "Maren", "Nolwen", "Orrin", "Perrin", "Quillon", "Rowena", "Sorrel", "Tamsin"]
THINGS = ["the lighthouse keeper", "the harbour master", "the first archivist", "the bridge architect",
          "the ferry captain", "the guild treasurer", "the clock maker", "the school founder"]


def probe(filler: str, rng: random.Random, words: int = 300, conflict: bool = True) -> tuple[str, tuple[int, int],
                                                                                          str, str]:
    """One synthetic emphasis case: ``(context, emphasized character span, question, answer)``: the
    context states two different names for one role, in random order; the emphasized statement is
    the one the answer must follow (``conflict=False``: the second statement names no one, so the
    emphasized one is the only answer). ``words``: words of filler around them."""
    thing = rng.choice(THINGS)
    right, wrong = rng.sample(NAMES, 2)
    true_fact = f" The records are clear that {thing} was {right}."
    false_fact = f" Some say {thing} was {wrong}." if conflict else " Some records of that year were lost."
    text = filler.split()
    start = rng.randrange(max(1, len(text) - words - 100))
    body = text[start:start + words]
    cut1, cut2 = sorted(rng.sample(range(20, len(body) - 20), 2))
    first, second = (true_fact, false_fact) if rng.random() < 0.5 else (false_fact, true_fact)
    head = " ".join(body[:cut1]) + first
    middle = " " + " ".join(body[cut1:cut2]) + second
    context = head + middle + " " + " ".join(body[cut2:])
    at = context.index(true_fact)
    question = f"\nQuestion: Who was {thing}?\nAnswer: {thing[0].upper() + thing[1:]} was"
    return context, (at, at + len(true_fact)), question, " " + right


@torch.inference_mode()
def profile(model, tokenizer, filler: str, cases: int = 3, alpha: float = 0.01, seed: int = 0,
            progress: bool = True, words: int = 150) -> list:
    """``[(layer, head, gain), ...]`` best first: each query head steered alone (``alpha``) over
    ``cases`` synthetic contexts (:func:`probe`), by the mean rise of the answer's log-probability.
    One batched forward per layer and case (row 0 unsteered, row ``h + 1`` steers head ``h``)."""
    check_model(model)
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    device = next(model.parameters()).device
    gains = torch.zeros(layers, heads, dtype=torch.float64)
    bar = tqdm(total=cases * layers, desc="kdn steer: profiling heads", disable=not progress, unit="layer")
    for _ in range(cases):
        context, span, question, answer = probe(filler, rng, words)
        enc = tokenizer(context, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        penalty = biases([(0, 0)], alpha, token_mask([span], len(ids), offsets), 1, 1)[0][0]  # [n]
        out = model(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
        kv = cache_to_kv_list(output_cache(out))
        tail = tokenizer(question + answer, add_special_tokens=False)["input_ids"]
        n_answer = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        target = torch.tensor(tail[-n_answer:], device=device)
        rows = heads + 1
        batch_tail = torch.tensor([tail] * rows, device=device)
        for layer in range(layers):
            bias = torch.zeros(rows, heads, len(ids))
            for h in range(heads):
                bias[h + 1, h] = penalty
            cache = kv_list_to_cache(model, [t.expand(rows, *t.shape[1:]).contiguous() for t in kv])
            with applied(model, {layer: bias}):
                logits = model(batch_tail, **cache_arg(cache), use_cache=True, logits_to_keep=n_answer + 1).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # the positions that predict the answer
            score = logp.gather(2, target[None, :, None].expand(rows, -1, 1)).sum(dim=(1, 2)).double().cpu()
            gains[layer] += score[1:] - score[0]
            bar.update(1)
    bar.close()
    gains /= cases
    flat = gains.flatten()
    order = torch.argsort(flat, descending=True).tolist()
    return [(i // heads, i % heads, float(flat[i])) for i in order]


def pack_profile(ranked: list) -> bytes:
    return json.dumps({"version": PROFILE_VERSION, "heads": ranked}).encode()


def unpack_profile(payload: bytes) -> list:
    data = json.loads(payload)
    if data.get("version") != PROFILE_VERSION:
        raise InvalidInputError("steer: a head profile of another version")
    return [tuple(h) for h in data["heads"]]


def chosen(ranked: list, count: int) -> list:
    """The ``count`` best heads of a profile that gained at all: ``[(layer, head), ...]``."""
    return [(int(layer), int(head)) for layer, head, gain in ranked[:count] if gain > 0]
