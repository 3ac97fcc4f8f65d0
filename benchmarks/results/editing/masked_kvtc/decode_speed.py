"""kvtc CPU decode speed under joint vs per-head bases (unpruned chunks), Qwen2.5-1.5B-shaped synthetic KV as in
benchmarks/bench_gpu_kvtc.py: 4 chunks of 256 tokens, ratio 8, medians of 5.

    cd benchmarks/results/editing/masked_kvtc && PYTHONPATH=../../../../python python decode_speed.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench_gpu_kvtc import FP, planes, rotated  # noqa: E402
from kdn import _core, codecs, kvtc  # noqa: E402

layers, heads, dim, n = 28, 2, 128, 1024
inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
rows = planes(layers, heads * dim, n, 64, 2)
kv = [torch.from_numpy(r).view(1, n, heads, dim).transpose(1, 2).contiguous() for r in rows]
kv = [(rotated(t, inv_freq, 0) if p % 2 == 0 else t).half() for p, t in enumerate(kv)]
for per_head in (False, True):
    cal = kvtc.fit(planes(layers, heads * dim, 1024, 64, 1), FP, dim, inv_freq=inv_freq.numpy(), ratios=(8,),
                   per_head=per_head)
    kvtc.load(cal)
    coded = [codecs.encode(_core.pack_chunk(kv, s, 256, FP, s.to_bytes(16, "little")), "kvtc:ratio=8")
             for s in range(0, n, 256)]
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for b in coded:
            codecs.decode(b)
        ts.append(time.perf_counter() - t)
    ms = statistics.median(ts)
    print("per_head" if per_head else "joint", f"{ms * 1e3:.0f} ms for {n} tokens,",
          f"{2 * layers * 2 * n * heads * dim / ms / 1e9:.2f} GB/s fp16-eq, {sum(map(len, coded)) / 1e6:.2f} MB")
    _core.kvtc_unload_all()
