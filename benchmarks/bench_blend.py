"""Blending on MuSiQue (10 passages per question) with SmolLM2-135M: F1, KL of the next-token
distribution vs full prefill, greedy agreement and time-to-first-token for full, naive and blend@r.

Usage: python benchmarks/bench_blend.py [--questions 20] [--ratios 0.05,0.15,0.3] [--max-new-tokens 32]
Segments are stored before timing (as in a RAG deployment). Prints a table, writes bench_out/bench_blend.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import kdn
from kdn import KDN, KDNConfig
from kdn.eval import load_dataset
from kdn.eval.metrics import qa_f1
from kdn.eval.runner import encode
from timing import save_result


def kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(reference.float(), -1), torch.log_softmax(logits.float(), -1)
    return float(torch.sum(p.exp() * (p - q)))


@torch.inference_mode()
def first_token_logits(model, cache, covered, ids):
    if cache is None:
        return model(ids).logits[0, -1]
    return model(ids[:, covered:], past_key_values=cache).logits[0, -1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--ratios", default="0.05,0.15,0.3")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load("smollm2-135m")
    methods = [("full", "full", 0.0), ("naive", "naive", 0.0)] + [
        (f"blend@{r}", "blend", float(r)) for r in args.ratios.split(",")]
    rows = {name: {"f1": [], "kl": [], "ttft": [], "same_greedy": [], "recomputed": []} for name, _, _ in methods}
    model(torch.tensor([[1, 2, 3]]))  # warm-up
    for sample in load_dataset("musique", limit=args.questions):
        enc = encode(tokenizer, sample, model.config.max_position_embeddings, args.max_new_tokens)
        ids = enc.ids
        flat = ids[0].tolist()
        prefix = flat[: enc.segment_spans[0][0]]
        segments = [flat[a:b] for a, b in enc.segment_spans]
        query = flat[enc.context_tokens:]
        cache_kdn = KDN(KDNConfig())
        cache_kdn.store_segments(model, segments, prefix=prefix)
        reference, full_answer = None, None
        for name, mode, ratio in methods:
            t0 = time.perf_counter()
            cache, stats = cache_kdn.blend(model, segments, query, recompute_ratio=ratio, prefix=prefix, mode=mode)
            logits = first_token_logits(model, cache, stats["tokens"], ids)
            ttft = time.perf_counter() - t0
            cache, stats = cache_kdn.blend(model, segments, query, recompute_ratio=ratio, prefix=prefix, mode=mode)
            kwargs = {"past_key_values": cache} if cache is not None else {}
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.max_new_tokens, **kwargs)[0, ids.shape[1]:]
            answer = tokenizer.decode(out, skip_special_tokens=True)
            if name == "full":
                reference, full_answer = logits, out
            r = rows[name]
            r["f1"].append(qa_f1(answer, list(sample.answers)))
            r["kl"].append(kl(reference, logits))
            r["ttft"].append(ttft)
            n = min(len(out), len(full_answer))
            r["same_greedy"].append(float((out[:n] == full_answer[:n]).float().mean()) if n else 1.0)
            per_layer = stats.get("recomputed_per_layer")
            r["recomputed"].append(sum(per_layer) / len(per_layer) / ids.shape[1] if per_layer else
                                   (1.0 if name == "full" else 0.0))
    full_ttft = statistics.fmean(rows["full"]["ttft"])
    print(f"\nMuSiQue, {args.questions} questions x 10 passages, SmolLM2-135M fp32, 2-core CPU; segments stored "
          "beforehand; KL and greedy agreement vs full prefill")
    print("| method | F1 | KL vs full | greedy tokens equal to full | recomputed tokens | TTFT | TTFT / full |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for name, r in rows.items():
        s = {k: statistics.fmean(v) for k, v in r.items()}
        summary[name] = s
        print(f"| {name} | {s['f1']:.3f} | {s['kl']:.4f} | {s['same_greedy']:.0%} | {s['recomputed']:.0%} | "
              f"{s['ttft'] * 1e3:.0f} ms | {s['ttft'] / full_ttft:.2f} |")
    b = summary.get("blend@0.15")
    if b:
        kl_ratio = summary["naive"]["kl"] / max(b["kl"], 1e-12)
        print(f"\nblend@0.15: TTFT {b['ttft'] / full_ttft:.2f}x full (target <= 0.35); KL naive/blend "
              f"{kl_ratio:.1f}x (target >= 3); F1 gap {summary['full']['f1'] - b['f1']:+.3f}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_blend.json", {"questions": args.questions, "summary": summary, "per_question": rows})
    print(f"wrote {out_dir / 'bench_blend.json'}")


if __name__ == "__main__":
    main()
