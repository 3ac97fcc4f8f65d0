"""Bytes of kvzip's masked chunks under kvtc with per-head bases as the kept share falls (SmolLM2-135M,
the demo document's first 1,024 tokens, calibrated on the next 1,024; kvtc ratio 8; the coder's
report summed over the 4 chunks). What docs/results/editing.md's "3.54 MB -> 1.87 -> 1.23" comes from.

    cd benchmarks/results/editing/masked_kvtc && PYTHONPATH=../../../../python python masked_bytes.py
"""

import torch

import kdn
from kdn import _core, codecs, kvtc
from kdn.demo import document
from kdn.edits import kvzip
from kdn.layout import cache_to_kv_list, output_cache

model, tokenizer = kdn.models.load("smollm2-135m")
ids = tokenizer(document())["input_ids"]
calibration_ids, ids = ids[1024:2048], ids[:1024]
kvtc.load(kvtc.calibrate(model, [calibration_ids], per_head=True, progress=False))
fingerprint = kdn.keys.model_fingerprint(model)
with torch.inference_mode():
    kv = cache_to_kv_list(output_cache(model(torch.tensor([ids]), use_cache=True)))
scores = kvzip.scores(model, kv, ids, [])
for keep in (1.0, 0.5, 0.3):
    mask = kvzip.chosen(scores, 1024, keep, 4)
    rows = kvzip.masked([t.float() for t in kv], mask, 0)  # the whole context, each chunk at its position
    total = {}
    for c in range(4):
        blob = _core.pack_chunk(rows, c * 256, 256, fingerprint, bytes([c]) * 16)
        coded, report = codecs.encode(blob, "kvtc:ratio=8", report=True)
        report["stored_bytes"] = len(coded)
        for k, v in report.items():
            total[k] = total.get(k, 0) + v
    print(f"keep {keep}: kept {float(mask.float().mean()):.3f},", {k: round(v) for k, v in total.items()}, flush=True)
