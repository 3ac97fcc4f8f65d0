"""KV editing at deposit: kvzip pruning at several keep ratios, alone and with a codec, on one stored
context asked several questions (the demo's document and its 5 questions, greedy answers).

For each configuration: stored bytes of the edited chunks vs the fp16 size of the exact KV they
stand for, deposit seconds per 1K tokens, hit TTFT, answers containing the gold fact, and answers
identical to a full prefill's.

    python benchmarks/bench_editing.py --model smollm2-135m --keeps 1,0.5,0.3,0.2 --codecs raw,int4 \
        --out benchmarks/results/editing
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kdn  # noqa: E402
from kdn import KDN, KDNConfig  # noqa: E402
from kdn.demo import QUESTIONS, document, prompt_ids  # noqa: E402
from kdn.edits import parse  # noqa: E402
from timing import save_result  # noqa: E402

GOLD = ["1312", "Priya Lund", "40 minutes", "December", "233"]  # from the document, one per question


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--keeps", default="1,0.5,0.3,0.2")
    parser.add_argument("--codecs", default="raw,int4")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", default="bench_out/editing")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load(args.model)
    prompts = [prompt_ids(tokenizer, document(), q) for q in QUESTIONS]
    shared = 0
    while all(p.shape[1] > shared and p[0, shared] == prompts[0][0, shared] for p in prompts):
        shared += 1
    context = prompts[0][0, :shared].tolist()
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    answer = lambda out, p: tokenizer.decode(out[0, p.shape[1]:], skip_special_tokens=True)  # noqa: E731
    with torch.inference_mode():
        full = [model.generate(p, **gen) for p in prompts]
    full_text = [answer(o, p) for o, p in zip(full, prompts)]
    rows = [{"config": "full prefill", "gold": sum(g.lower() in t.lower() for g, t in zip(GOLD, full_text)),
             "identical": len(prompts), "answers": full_text}]
    print(f"context {shared} tokens, {len(prompts)} questions; full prefill: gold {rows[0]['gold']}/{len(prompts)}",
          flush=True)
    layout_bytes = None
    for codec in args.codecs.split(","):
        for keep in (float(k) for k in args.keeps.split(",")):
            spec = f"kvzip:keep={keep:g}"
            cache = KDN(KDNConfig(memory_codec=codec))
            t0 = time.perf_counter()
            report = cache.deposit(model, context, edits=[spec], tokenizer=tokenizer)
            deposit_s = time.perf_counter() - t0
            stats = report["edits"][parse(spec).spec]
            session = cache.session(model)
            if layout_bytes is None:
                layout_bytes = session.layout.bytes_per_token() // session.layout.torch_dtype.itemsize * 2
            keys = cache.chunk_keys(model, context)
            blobs, _ = cache.chunks.tiers.fetch([parse(spec).address(k) for k in keys])  # coded: at codec addresses
            stored = sum(len(b) for b in blobs)
            fp16 = len(keys) * session.chunk_size * layout_bytes
            outs, ttfts = [], []
            for p in prompts:
                outs.append(cache.generate(model, p, edits=spec, **gen))
                ttfts.append(cache.last_generate.get("ttft_seconds", float("nan")))
                assert cache.last_generate.get("edit"), "the edited cache was not served"
            texts = [answer(o, p) for o, p in zip(outs, prompts)]
            row = {"config": f"{spec} + {codec}", "keep": keep, "codec": codec, "stored_bytes": stored,
                   "fp16_bytes": fp16, "ratio_vs_fp16": fp16 / stored, "edit_seconds": stats["seconds"],
                   "deposit_s_per_1k": deposit_s / shared * 1000, "ttft_median_s": sorted(ttfts)[len(ttfts) // 2],
                   "gold": sum(g.lower() in t.lower() for g, t in zip(GOLD, texts)),
                   "identical": sum(torch.equal(a, b) for a, b in zip(outs, full)), "answers": texts}
            rows.append(row)
            print(f"{row['config']:>24}: {row['ratio_vs_fp16']:5.1f}x smaller than fp16, gold {row['gold']}/5, "
                  f"identical to full {row['identical']}/5, deposit {row['deposit_s_per_1k']:.1f} s/1K tokens, "
                  f"hit TTFT {row['ttft_median_s'] * 1e3:.0f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
    path = save_result(Path(args.out) / "bench_editing.json", {"model": args.model, "context_tokens": shared,
                                                               "gold": GOLD, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
