"""Time-to-first-token: full prefill vs a kdn memory hit (SmolLM2-135M by default, any kdn model name
with --model, e.g. qwen2.5-coder-1.5b); retrieve vs torch.clone.

Usage: python benchmarks/bench_ttft.py [--model smollm2-135m] [--lengths 1024,2048,4096,7168] [--repeats 3]
       [--question TEXT] [--out bench_out]
The prompt is a context of each length followed by a real question (``--question``, >= 20 tokens):
the full prefill computes both, the hit is served the context and computes the question. The full
prefill and the hit alternate, ``--repeats`` times each; the record keeps every run and the medians.
Prints a table with ratios and writes bench_out/bench_ttft.json. Both sides compute the logits of the
last position only (``logits_to_keep=1``), as a server answering does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import kdn
from kdn import KDN, KDNConfig
from timing import QUESTION, question_ids, save_result


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def context_ids(tokenizer, n: int) -> torch.Tensor:
    text = kdn.demo.document()
    ids = tokenizer(text, return_tensors="pt").input_ids
    while ids.shape[1] < n:
        ids = torch.cat([ids, ids], dim=1)
    return ids[:, :n]


def retrieve_breakdown(model, cache: KDN, ids: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Medians of the two C++ steps inside retrieve: checksum/header verification and the layout copy."""
    from kdn import _core

    info = cache.session(model)
    keys = info.prefix_keys(info.tokens(ids))
    blobs = [cache.memory.get(k) for k in keys]
    lay = info.layout
    verify_s, _ = timed(lambda: _core.verify_chunks(blobs, keys, info.fingerprint, lay.dtype, lay.layers,
                                                    lay.kv_heads, lay.head_dim, cache.config.chunk_size), repeats)
    n = len(keys) * cache.config.chunk_size
    dst = [torch.empty(1, lay.kv_heads, n, lay.head_dim, dtype=lay.torch_dtype) for _ in range(2 * lay.layers)]
    copy_s, _ = timed(lambda: _core.unpack_chunks(blobs, dst, n), repeats)  # warm destination
    return verify_s, copy_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1024,2048,4096,7168")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--question", default=QUESTION, help="asked after each context (>= 20 tokens)")
    args = parser.parse_args()
    import kdn.demo  # noqa: F401  (bundled document)

    model, tokenizer = kdn.models.load(args.model)
    torch.set_grad_enabled(False)
    rows = []
    question = question_ids(tokenizer, args.question)
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = context_ids(tokenizer, n)
        prompt = torch.cat([ids, question], dim=1)
        cache = KDN(KDNConfig())

        def full_prefill():
            return model(prompt, use_cache=True, logits_to_keep=1)

        def hit_ttft():
            c, hit = cache.retrieve(model, prompt, limit=prompt.shape[1] - 1)
            return model(prompt[:, hit:], past_key_values=c, logits_to_keep=1).logits[0, -1], hit

        full_runs, hit_runs = [], []
        for i in range(args.repeats):  # alternate, so both see the same load
            s_full, out = timed(full_prefill, 1)
            full_runs.append(s_full)
            if i == 0:  # the context's rows of the prompt's cache are what a miss stores (causal attention)
                out.past_key_values.crop(n - out.past_key_values.get_seq_length())
                cache.store(model, ids, out.past_key_values)
                kv = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
                kv_bytes = sum(t.numel() * t.element_size() for t in kv)
                full_logits = out.logits[0, -1]
            s_hit, (logits, hit) = timed(hit_ttft, 1)
            hit_runs.append(s_hit)
        full_s, hit_s = statistics.median(full_runs), statistics.median(hit_runs)
        # interleave retrieve and clone so both see the same allocator state; median of many runs
        retrieve_runs, clone_runs = [], []
        def retrieve_all():  # until every layer is delivered (a layer-wise retrieve returns at its start)
            served, _ = cache.retrieve(model, ids, limit=n)
            return [layer.keys for layer in served.layers]

        for _ in range(4 * args.repeats):
            retrieve_runs.append(timed(retrieve_all, 1)[0])
            clone_runs.append(timed(lambda: [t.clone() for t in kv], 1)[0])
        retrieve_s, clone_s = statistics.median(retrieve_runs), statistics.median(clone_runs)
        verify_s, copy_s = retrieve_breakdown(model, cache, ids, args.repeats)
        max_diff = (logits - full_logits).abs().max().item()
        row = {"tokens": n, "question_tokens": question.shape[1], "hit_tokens": hit, "kv_mib": kv_bytes / 2**20,
               "full_prefill_s": full_s, "full_prefill_runs_s": full_runs, "kdn_hit_ttft_s": hit_s,
               "kdn_hit_runs_s": hit_runs, "speedup": full_s / hit_s, "retrieve_s": retrieve_s,
               "clone_s": clone_s, "retrieve_over_clone": retrieve_s / clone_s, "verify_s": verify_s,
               "layout_copy_s": copy_s, "max_logit_diff": max_diff}
        rows.append(row)
        print(f"{n:>6} tokens  KV {row['kv_mib']:7.1f} MiB  full prefill {full_s * 1e3:8.0f} ms  "
              f"kdn hit {hit_s * 1e3:6.0f} ms  speedup {row['speedup']:6.1f}x  |  retrieve {retrieve_s * 1e3:6.1f} ms  "
              f"clone {clone_s * 1e3:6.1f} ms  ratio {row['retrieve_over_clone']:4.2f}x  |  "
              f"(verify {verify_s * 1e3:5.1f} ms, layout copy {copy_s * 1e3:5.1f} ms)  |  "
              f"max logit diff {max_diff:.1e}",
              flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_ttft.json", {"model": args.model, "dtype": "float32", "question": args.question,
                                              "threads": torch.get_num_threads(), "rows": rows})
    print(f"\nwrote {out_dir / 'bench_ttft.json'}")
    print("targets: speedup at 4096 tokens >= 20x; retrieve <= 2x clone")


if __name__ == "__main__":
    main()
