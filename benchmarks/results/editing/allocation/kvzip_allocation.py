"""Experiment (run at 2e1c58f, kvzip v1: kvzip.prune per chunk): KVzip budget allocation on the demo document.

per-chunk uniform (v1) vs per-head global vs global across layers and heads vs global across the heads of each layer,
the last two simulated with a -inf mask over the exact KV. `python kvzip_allocation.py qwen2.5-coder-0.5b 0.5,0.3,0.2`
"""
import sys
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kdn
from kdn.demo import QUESTIONS, document, prompt_ids
from kdn.edits import kvzip
from kdn.edits.stored import PrunedCache
from kdn.layout import cache_to_kv_list, output_cache

GOLD = ["1312", "Priya Lund", "40 minutes", "December", "233"]
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
keeps = [float(k) for k in (sys.argv[2] if len(sys.argv) > 2 else "0.5,0.3,0.2").split(",")]
torch.manual_seed(0)
model, tok = kdn.models.load(name)
prompts = [prompt_ids(tok, document(), q) for q in QUESTIONS]
shared = 0
while all(p.shape[1] > shared and p[0, shared] == prompts[0][0, shared] for p in prompts):
    shared += 1
ctx = prompts[0][0, :shared].tolist()
gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
def ans(o, p):
    return tok.decode(o[0, p.shape[1]:], skip_special_tokens=True)
with torch.inference_mode():
    full = [model.generate(p, **gen) for p in prompts]
    right = sum(g.lower() in ans(o, p).lower() for g, o, p in zip(GOLD, full, prompts))
    print("ctx", shared, "full gold", right, flush=True)
    out = model(torch.tensor([ctx]), use_cache=True, logits_to_keep=1)
    kv = cache_to_kv_list(output_cache(out))
    t0 = time.time()
    instr = list(tok(kvzip.INSTRUCTION, add_special_tokens=False)["input_ids"])
    sc = kvzip.scores(model, kv, ctx, instr)
    print("score s", time.time() - t0, flush=True)
L = len(sc)
H, n = sc[0].shape
MASK = {}
def masked_attn(module, query, key, value, attention_mask, **kw):
    m = MASK.get(module.layer_idx)
    if m is not None:
        extra = torch.zeros(key.shape[0], key.shape[1], 1, key.shape[2])
        extra[0, :, 0, :m.shape[1]] = torch.where(m, 0.0, float("-inf"))
        groups = query.shape[1] // key.shape[1]
        extra = extra.repeat_interleave(groups, dim=1)
        am = attention_mask
        if am is None:
            am = torch.zeros(1, 1, query.shape[2], key.shape[2])
        if am.dtype == torch.bool:
            am = torch.where(am, 0.0, float("-inf"))
        attention_mask = am[:, :, :, :key.shape[2]] + extra
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
AttentionInterface.register("exp_mask", masked_attn)
AttentionMaskInterface.register("exp_mask", sdpa_mask)

def run(label, kvp, masks=None):
    MASK.clear()
    if masks:
        MASK.update(masks)
        model.set_attn_implementation("exp_mask")
    texts, same = [], 0
    with torch.inference_mode():
        for p, f in zip(prompts, full):
            cache = PrunedCache.holding(model, [t.clone() for t in kvp], shared)
            o = model.generate(p, past_key_values=cache, **gen)
            texts.append(ans(o, p))
            same += torch.equal(o, f)
    model.set_attn_implementation("sdpa")
    g = sum(gg.lower() in t.lower() for gg, t in zip(GOLD, texts))
    print(f"{label:30s} gold {g}/5 identical {same}/5 {[t[:40] for t in texts]}", flush=True)

chunk = 256
for keep in keeps:
    # a) per chunk uniform (today)
    parts = [kvzip.prune(kv, sc, s, min(s + chunk, n), keep, 4) for s in range(0, n, chunk)]
    kva = [torch.cat([p[j] for p in parts], 2) for j in range(2 * L)]
    run(f"keep {keep} per-chunk", kva)
    # b) per head global over context (equal count per head)
    kvb = kvzip.prune(kv, sc, 0, n, keep, 4)
    run(f"keep {keep} per-head global", kvb)
    # c) global across heads and layers (mask)
    allsc = torch.stack(sc)  # L,H,n
    s2 = allsc.clone()
    s2[:, :, :4] = float("inf")
    k = int(round(keep * s2.numel()))
    thr = s2.flatten().topk(k).values[-1]
    m = s2 >= thr
    run(f"keep {keep} global L+H (mask)", kv, {layer: m[layer] for layer in range(L)})
    # d) global across heads within layer (mask), equal per layer
    m2 = torch.zeros_like(m)
    for layer in range(L):
        f = s2[layer].flatten()
        kk = int(round(keep * f.numel()))
        m2[layer] = s2[layer] >= f.topk(kk).values[-1]
    run(f"keep {keep} per-layer H-global (mask)", kv, {layer: m2[layer] for layer in range(L)})
