"""Blending on MuSiQue (10 passages per question) with SmolLM2-135M: KL of the next-token
distributions vs full prefill, greedy agreement, recomputed tokens and time-to-first-token for full,
naive and blend@r under each selection rule (kv, v, gradual, first-k).

Usage: python benchmarks/bench_blend.py [--questions 30] [--ratios 0.15] [--selections kv,v,gradual,first-k]
       [--continuation 16] [--f1] [--out bench_out]
Segments are stored before timing (as in a RAG deployment). KL and agreement are measured over the
first token and a teacher-forced continuation (full prefill's greedy tokens); ``--f1`` also
generates each method's answer for F1 (slower). Prints a table, writes bench_blend.json and
bench_blend.png under --out.
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


@torch.inference_mode()
def reference_run(model, ids: torch.Tensor, steps: int):
    """Full prefill: TTFT, and log-probs at the prompt's end and along its own greedy continuation."""
    t0 = time.perf_counter()
    out = model(ids, use_cache=True)
    ttft = time.perf_counter() - t0
    logps, tokens, cache = [out.logits[0, -1].log_softmax(-1)], [], out.past_key_values
    for _ in range(steps):
        tokens.append(int(logps[-1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logps.append(out.logits[0, -1].log_softmax(-1))
    return ttft, torch.stack(logps[:-1]), torch.tensor([tokens])


@torch.inference_mode()
def served_logps(model, cache, covered: int, ids: torch.Tensor, continuation: torch.Tensor):
    """Log-probs at the prompt's end (the first token: its time is the TTFT) and, teacher-forced,
    along ``continuation``; returns (seconds to the first logits, log-probs)."""
    t0 = time.perf_counter()
    out = model(ids[:, covered:], past_key_values=cache, use_cache=True)
    first_s = time.perf_counter() - t0
    rest = model(continuation[:, :-1], past_key_values=out.past_key_values).logits[0]
    return first_s, torch.cat([out.logits[0, -1:], rest]).log_softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--ratios", default="0.15")
    parser.add_argument("--selections", default="kv,v,gradual,first-k")
    parser.add_argument("--continuation", type=int, default=16)
    parser.add_argument("--f1", action="store_true", help="also generate answers (32 tokens) for F1")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = kdn.models.load("smollm2-135m")
    methods = [("naive", "naive", 0.0, "kv")] + [
        (f"blend@{r}" + ("" if s == "kv" else f":{s}"), "blend", float(r), s)
        for r in args.ratios.split(",") for s in args.selections.split(",")]
    names = ["full"] + [m[0] for m in methods]
    rows = {name: {"kl": [], "kl_first": [], "agreement": [], "ttft": [], "recomputed": [], "f1": []}
            for name in names}
    model(torch.tensor([[1, 2, 3]]))  # warm-up
    for q, sample in enumerate(load_dataset("musique", limit=args.questions)):
        enc = encode(tokenizer, sample, model.config.max_position_embeddings, 32)
        ids = enc.ids
        flat = ids[0].tolist()
        prefix = flat[: enc.segment_spans[0][0]]
        segments = [flat[a:b] for a, b in enc.segment_spans]
        query = flat[enc.context_tokens:]
        store = KDN(KDNConfig())
        store.store_segments(model, segments, prefix=prefix)
        full_s, ref, continuation = reference_run(model, ids, args.continuation)
        rows["full"]["ttft"].append(full_s)
        for key, value in (("kl", 0.0), ("kl_first", 0.0), ("agreement", 1.0), ("recomputed", 1.0)):
            rows["full"][key].append(value)
        for name, mode, ratio, selection in methods:
            t0 = time.perf_counter()
            cache, stats = store.blend(model, segments, query, recompute_ratio=ratio, prefix=prefix, mode=mode,
                                       selection=selection)
            blend_s = time.perf_counter() - t0
            first_s, got = served_logps(model, cache, stats["tokens"], ids, continuation)
            r = rows[name]
            kl = (ref.exp() * (ref - got)).sum(-1)
            r["kl"].append(kl.mean().item())
            r["kl_first"].append(kl[0].item())
            r["agreement"].append((ref.argmax(-1) == got.argmax(-1)).float().mean().item())
            r["ttft"].append(blend_s + first_s)
            per_layer = stats.get("recomputed_per_layer")
            r["recomputed"].append(sum(per_layer) / len(per_layer) / ids.shape[1] if per_layer else 0.0)
            if args.f1:
                cache, stats = store.blend(model, segments, query, recompute_ratio=ratio, prefix=prefix,
                                           mode=mode, selection=selection)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                     past_key_values=cache)[0, ids.shape[1]:]
                r["f1"].append(qa_f1(tokenizer.decode(out, skip_special_tokens=True), list(sample.answers)))
        print(f"question {q + 1}/{args.questions}: {ids.shape[1]} tokens, full {full_s:.1f} s", flush=True)
    summary = {name: {k: statistics.fmean(v) for k, v in r.items() if v} for name, r in rows.items()}
    full_ttft = summary["full"]["ttft"]
    print(f"\nMuSiQue, {args.questions} questions x 10 passages, SmolLM2-135M fp32, 2-core CPU; segments stored "
          f"beforehand; KL and greedy agreement vs full prefill over the first token and {args.continuation} "
          "teacher-forced tokens")
    print("| method | KL (first token) | KL (mean) | greedy agreement | recomputed tokens | TTFT | TTFT / full |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['kl_first']:.4f} | {s['kl']:.4f} | {s['agreement']:.1%} | {s['recomputed']:.0%} | "
              f"{s['ttft'] * 1e3:.0f} ms | {s['ttft'] / full_ttft:.2f} |")
    naive = summary["naive"]["kl"]
    for name, s in summary.items():
        if name.startswith("blend@"):
            print(f"{name}: KL naive/blend {naive / max(s['kl'], 1e-12):.1f}x (target >= 3), "
                  f"TTFT {s['ttft'] / full_ttft:.2f}x full (target <= 0.35)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_blend.json", {"questions": args.questions, "summary": summary, "per_question": rows})
    plot(summary, out_dir / "bench_blend.png")
    print(f"wrote {out_dir / 'bench_blend.json'} and bench_blend.png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    full = summary["full"]["ttft"]
    for name, s in summary.items():
        if name == "full":
            continue
        left.scatter(s["recomputed"], s["kl"], label=name)
        right.scatter(s["ttft"] / full, s["kl"], label=name)
    left.set(xlabel="recomputed tokens (share, mean over layers)", ylabel="KL vs full prefill (nats)", yscale="log")
    right.set(xlabel="TTFT / full prefill", ylabel="KL vs full prefill (nats)", yscale="log")
    right.axvline(0.35, color="gray", ls=":")
    left.legend(fontsize=8)
    fig.suptitle("Blend selection rules on MuSiQue, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
