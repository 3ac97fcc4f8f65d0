"""What an edited hit's bias costs a long suffix: an 860-token suffix prefilled over a 2,048-token
SmolLM2 cache, exact hit vs kvzip keep 0.5 (its padding rows hidden by a -inf bias through the
registered attention function), as one forward pass (with its cProfile top) and through
``KDN.generate`` (1 new token).

    python suffix_over_edited_hit.py
"""

import cProfile
import pstats
import time

import torch

import kdn
from kdn import KDN, KDNConfig
from kdn.demo import document, prompt_ids
from kdn.edits import steer

model, tok = kdn.models.load("smollm2-135m")
ids = prompt_ids(tok, document(), "x")[0].tolist()
doc, suffix = ids[:2048], ids[2048:2048 + 860]
k = KDN(KDNConfig())
k.deposit(model, doc, edits=["kvzip:keep=0.5"], tokenizer=tok)
full = torch.tensor([doc + suffix])
for edits in (None, "kvzip:keep=0.5"):
    cache, hit = k.retrieve(model, full[0], edits=edits)
    bias = k.last_retrieve.get("bias") or {}
    t = time.time()
    profile = cProfile.Profile()
    profile.enable()
    with torch.inference_mode(), steer.applied(model, bias):
        model(full[:, hit:], past_key_values=cache, position_ids=torch.arange(hit, full.shape[1])[None])
    profile.disable()
    print(edits, hit, "suffix forward s", round(time.time() - t, 2), flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(6)
for edits in (None, "kvzip:keep=0.5"):
    t = time.time()
    k.generate(model, full, edits=edits, max_new_tokens=1, do_sample=False)
    print("generate", edits, round(time.time() - t, 2), flush=True)
