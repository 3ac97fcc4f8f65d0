"""How a codec codes kvzip's pooled rows: relative L2 error of the kept keys and values read back
through a KDN whose memory tier stores ``codec``, and the bytes stored, at keep 1 / 0.5 / 0.3
(SmolLM2-135M, the demo document's first 1,500 tokens; kvtc calibrated on a disjoint part).

Variants (monkeypatched, to measure what each design choice does): ``default`` (kdn's pooling;
lane-first since 1274dca, so ``lanes`` now equals it: ``pooled.log`` was written before, when the
default filled each layer's slots in (head, token) order), ``lanes`` (overflow after each head's own
lane instead of each layer's), ``norope`` (keys pooled without the RoPE move), ``aligned`` (the same
tokens for every head of a layer, an equal count per layer and chunk), ``perhead`` (kvtc fit with
one PCA per KV head), ``layereq`` (an equal count per layer and chunk, ranked across that layer's
heads and tokens: no row leaves its layer), ``layereq-perhead`` (both), ``layereq-lanes-perhead``
(and each head's rows in its own lane first), ``subset`` (no pooling: the kept triples' error in the
unpruned coded cache).

    python pooled_codec_error.py int4 default    # also: kvtc:ratio=8 <variant>, int2
"""

import sys

import numpy as np
import torch

import kdn
from kdn import KDN, KDNConfig, kvtc
from kdn.demo import QUESTIONS, document, prompt_ids
from kdn.edits import kvzip, parse, stored
from kdn.layout import cache_to_kv_list


def lane_slots(mask):
    layers, heads, chunk = mask.shape
    rows = kvzip.pooled_rows(mask)
    flat = mask.reshape(layers * heads, chunk)
    src = torch.full((layers * heads, rows), -1, dtype=torch.int64)
    over = []
    for lane in range(layers * heads):
        items = flat[lane].nonzero().flatten() + lane * chunk
        src[lane, : min(len(items), rows)] = items[:rows]
        over.append(items[rows:])
    spill = torch.cat(over)
    src.view(-1)[(src.view(-1) == -1).nonzero().flatten()[: len(spill)]] = spill
    return src.view(layers, heads, rows)


def aligned_chosen(layer_scores, tokens, keep, sink, chunk=256):
    s = torch.stack([sc[:, :tokens] for sc in layer_scores]).amax(1)
    s[:, :sink] = float("inf")
    layers, n = s.shape
    mask = torch.zeros(layers, layer_scores[0].shape[0], n, dtype=torch.bool)
    for c in range(0, n, chunk):
        idx = s[:, c:c + chunk].topk(max(1, round(keep * min(chunk, n - c))), dim=1).indices + c
        for layer in range(layers):
            mask[layer, :, idx[layer]] = True
    return mask


def layer_equal_chosen(layer_scores, tokens, keep, sink, chunk=256):
    s = torch.stack([sc[:, :tokens] for sc in layer_scores]).clone()  # [layers, heads, tokens]
    s[:, :, :sink] = float("inf")
    layers, heads, n = s.shape
    mask = torch.zeros_like(s, dtype=torch.bool)
    for c in range(0, n, chunk):
        part = s[:, :, c:c + chunk].reshape(layers, -1)
        idx = part.topk(max(1, round(keep * part.shape[1])), dim=1).indices
        m = torch.zeros_like(part, dtype=torch.bool).scatter_(1, idx, True)
        mask[:, :, c:c + chunk] = m.view(layers, heads, -1)
    return mask


def per_head_fit(head_dim):
    """kvtc's plane fit with one PCA per KV head: a block-diagonal basis (a row's heads coded apart)."""
    whole = kvtc._fit_plane

    def fit(x):
        blocks = [whole(x[:, h:h + head_dim]) for h in range(0, x.shape[1], head_dim)]
        basis = np.zeros((x.shape[1], x.shape[1]))
        for i, b in enumerate(blocks):
            basis[i * head_dim:(i + 1) * head_dim, i * head_dim:(i + 1) * head_dim] = b["basis"]
        out = {"mean": np.concatenate([b["mean"] for b in blocks]), "basis": basis,
               "variance": sum(b["variance"] for b in blocks)}
        for k in ("rate", "dist", "step"):
            out[k] = np.concatenate([b[k] for b in blocks])
        return out
    return fit


def main() -> None:
    codec, variant = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "default"
    if "lanes" in variant:
        kvzip.slots = lane_slots
    elif variant == "norope":
        stored.rope_of = lambda model: None
    elif variant.startswith("layereq"):
        kvzip.chosen = layer_equal_chosen
    elif variant == "aligned":
        kvzip.chosen = aligned_chosen
    model, tok = kdn.models.load("smollm2-135m")
    if variant.endswith("perhead"):
        kvtc._fit_plane = per_head_fit(model.config.head_dim)
    ids = prompt_ids(tok, document(), QUESTIONS[0])[0].tolist()[:1500]
    if codec.startswith("kvtc"):
        kvtc.load(kvtc.calibrate(model, [prompt_ids(tok, document()[3000:], "")[0].tolist()[:1200]], progress=False))
        stored.masked_layout = lambda kdn, session: False  # measured here: kvtc on pooled rows, which deposit refuses
    with torch.inference_mode():
        past = model(torch.tensor([ids]), use_cache=True).past_key_values
        kv = cache_to_kv_list(past)
    for keep in (1.0, 0.5, 0.3):
        cache = KDN(KDNConfig(memory_codec=codec, memory_bytes=4 << 30))
        spec = f"kvzip:keep={keep}"
        cache.deposit(model, ids, edits=[spec], tokenizer=tok)
        got_cache, hit = cache.retrieve(model, ids + [0], edits=spec)
        rows = cache_to_kv_list(got_cache)
        session, edit = cache.session(model), parse(spec)
        layers, heads = session.layout.layers, session.layout.kv_heads
        masks = torch.cat([kvzip.unpack_mask(cache.engine.sidecars.read(session, edit.address(k)), layers, heads,
                                             session.chunk_size) for k in cache.chunk_keys(model, ids)], 2)
        if variant == "subset":  # the same kept triples, read from the unpruned coded cache
            cache.store(model, ids, past)
            whole, _ = cache.retrieve(model, ids + [0])
            whole = cache_to_kv_list(whole)
        errs = {0: [], 1: []}
        for layer in range(layers):
            for part in (0, 1):
                for head in range(heads):
                    want = kv[2 * layer + part][0, head, :hit][masks[layer, head]]
                    got = rows[2 * layer + part][0, head, : len(want)]
                    if variant == "subset":
                        got = whole[2 * layer + part][0, head, :hit][masks[layer, head]]
                    errs[part].append(((got - want).norm() / want.norm()).item())
        print(f"{codec} {variant} keep {keep}: key rel err {sum(errs[0]) / len(errs[0]):.4f} "
              f"value {sum(errs[1]) / len(errs[1]):.4f} "
              f"bytes {stored.stored_bytes(cache, model, ids, spec) / 1e6:.2f} MB",
              flush=True)


if __name__ == "__main__":
    main()
