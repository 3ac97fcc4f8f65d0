"""Knowledge injected three ways over the same documents and questions, in one run: the paper's Table 1
("Do Large Language Models Need a Content Delivery Network?": in a RAG setup, KV-cache learning
through a KDN injects new knowledge 40x faster than fine-tuning and answers 3.7x cheaper and 2.5x
faster than in-context learning).

- **fine-tuning**: LoRA (peft) trained on the documents' text (next-token loss; ``--steps``: the
  budgets, each evaluated), then each question asked without its documents;
- **in-context learning**: each question's documents in its prompt, prefilled for every question;
- **KV-cache learning**: each question's documents deposited into kdn once (``KDN.deposit``), then the
  same prompts as in-context learning served from kdn (``KDN.generate``: only the question prefilled).

Measured per method: the wall seconds and the CPU-seconds of this process (the cost proxy here) to
inject the knowledge base (training; deposits), and per question the CPU-seconds, the time to the
first token and the end-to-end delay of a greedy answer, its QA F1 and exact match (MuSiQue's
answers). The KV path's answer tokens are compared with in-context learning's, question by question.

    python benchmarks/bench_injection.py --model smollm2-135m --questions 12 --out benchmarks/results/injection
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kdn import KDN, KDNConfig
from kdn.eval.datasets import load_dataset
from kdn.eval.metrics import exact_match, qa_f1
from kdn.eval.runner import encode
from kdn.eval.stats import bootstrap_ci
from kdn.integrations.hf import FirstTokenTimer
from kdn.models import load

PAPER = {"injection vs fine-tuning": 40.0, "cheaper than in-context learning": 3.7,
         "faster than in-context learning": 2.5}


@dataclasses.dataclass
class Question:
    """One question of the knowledge base: its prompt with its documents (``ids``, the documents'
    part ``context_tokens`` long), the same question alone (``bare``), its gold answers."""

    sample_id: str
    ids: torch.Tensor
    context_tokens: int
    bare: torch.Tensor
    answers: tuple
    documents: str


@contextlib.contextmanager
def measured(into: dict, prefix: str = ""):
    """Wall and process CPU seconds of the block, into ``into[prefix + "wall_s" / "cpu_s"]``."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    into[prefix + "wall_s"] = time.perf_counter() - wall
    into[prefix + "cpu_s"] = time.process_time() - cpu


def knowledge(tokenizer, questions: int, max_prompt_tokens: int, max_new_tokens: int, data_dir=None) -> list:
    """The first ``questions`` MuSiQue questions, each with its retrieved documents (SystemExit when the
    file found holds fewer: a clone's 3-question slice, say)."""
    from kdn.eval.datasets import dataset_path

    samples = load_dataset("musique", limit=questions, data_dir=data_dir)
    if len(samples) < questions:
        raise SystemExit(f"{dataset_path('musique', data_dir)} holds {len(samples)} questions, not {questions}: "
                         "point --data-dir at the full dataset")
    out = []
    for sample in samples:
        enc = encode(tokenizer, sample, max_prompt_tokens, max_new_tokens)
        bare = encode(tokenizer, dataclasses.replace(sample, segments=()), max_prompt_tokens, max_new_tokens)
        out.append(Question(sample.id, enc.ids, enc.context_tokens, bare.ids, sample.answers,
                            "".join(sample.segments)))
    return out


def answer(model, tokenizer, ids: torch.Tensor, max_new_tokens: int, cache: KDN | None = None) -> dict:
    """A greedy answer to ``ids`` (through ``cache``: its stored prefix served): its tokens, text,
    time to the first token, end-to-end wall and CPU seconds, and the tokens kdn served."""
    row: dict = {}
    timer = FirstTokenTimer()
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, streamer=timer,
                  attention_mask=torch.ones_like(ids), pad_token_id=tokenizer.eos_token_id)
    with measured(row), torch.inference_mode():
        timer.start()
        out = cache.generate(model, ids, **kwargs) if cache is not None else model.generate(ids, **kwargs)
    tokens = out[0, ids.shape[1]:].tolist()
    row.update(tokens=tokens, text=tokenizer.decode(tokens, skip_special_tokens=True), ttft_s=timer.ttft,
               served_tokens=cache.last_generate["hit_tokens"] if cache is not None else 0)
    return row


def scored(rows: list, questions: list) -> list:
    for row, q in zip(rows, questions):
        row["f1"], row["em"] = qa_f1(row["text"], list(q.answers)), exact_match(row["text"], list(q.answers))
    return rows


def in_context_and_kv(model, tokenizer, questions: list, max_new_tokens: int, config: KDNConfig) -> tuple:
    """In-context learning (every question prefilled with its documents: nothing to inject) and
    KV-cache learning (each question's documents deposited once, then its prompt served from kdn),
    their answers alternating question by question, after one untimed answer of each (warm-up)."""
    cache, inject = KDN(config), {}
    with measured(inject):
        deposited = set()
        for q in questions:
            if q.sample_id not in deposited:
                cache.deposit(model, q.ids[0, :q.context_tokens].tolist())
                deposited.add(q.sample_id)
        cache.flush()
    answer(model, tokenizer, questions[0].ids, 1)
    answer(model, tokenizer, questions[0].ids, 1, cache)
    icl, kv = [], []
    for q in questions:
        icl.append(answer(model, tokenizer, q.ids, max_new_tokens))
        kv.append(answer(model, tokenizer, q.ids, max_new_tokens, cache))
    cache.close()
    return ({"inject": {"wall_s": 0.0, "cpu_s": 0.0}, "questions": scored(icl, questions)},
            {"inject": inject, "questions": scored(kv, questions)})


def fine_tuned(model, tokenizer, questions: list, max_new_tokens: int, budgets: list, rank: int, lr: float,
               window: int, seed: int = 0) -> dict:
    """LoRA trained on the documents (windows of ``window`` tokens, one per step, in turn), each budget
    of steps evaluated on the questions asked alone; the budget with the best mean F1 is the row."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    tuned = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                            task_type="CAUSAL_LM"))
    text = "".join(dict.fromkeys(q.documents for q in questions))  # each question's documents, once
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    windows = [ids[i:i + window] for i in range(0, max(1, len(ids) - 1), window) if len(ids[i:i + window]) > 1]
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=lr)
    done, trained, budgets_out = 0, {"wall_s": 0.0, "cpu_s": 0.0}, []
    for budget in sorted(budgets):
        step_cost: dict = {}
        tuned.train()
        with measured(step_cost):
            losses = []
            for step in range(done, budget):
                batch = windows[step % len(windows)].unsqueeze(0)
                loss = tuned(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss.detach()))
        done = budget
        trained = {k: trained[k] + step_cost[k] for k in trained}
        tuned.eval()
        rows = scored([answer(tuned, tokenizer, q.bare, max_new_tokens) for q in questions], questions)
        budgets_out.append({"steps": budget, "inject": dict(trained), "last_loss": statistics.fmean(losses[-5:])
                            if losses else None, "f1": statistics.fmean(r["f1"] for r in rows), "questions": rows})
    best = max(budgets_out, key=lambda b: (b["f1"], -b["steps"]))
    return {"inject": best["inject"], "questions": best["questions"], "steps": best["steps"], "budgets": [
        {k: v for k, v in b.items() if k != "questions"} for b in budgets_out], "windows": len(windows),
        "document_tokens": len(ids)}


def ratio(numer: list, denom: list) -> dict:
    """The ratio of two methods' per-question costs (mean of ``numer`` over mean of ``denom``), with a
    paired bootstrap interval over questions."""
    a, b = np.asarray(numer, dtype=np.float64), np.asarray(denom, dtype=np.float64)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(a), (2000, len(a)))
    boot = a[picks].mean(axis=1) / b[picks].mean(axis=1)
    return {"ratio": float(a.mean() / b.mean()), "ci95": [float(x) for x in np.quantile(boot, [0.025, 0.975])]}


def summary(methods: dict) -> dict:
    """Each method's row (injection; per question: mean CPU-s, TTFT, end to end; F1, EM with intervals)
    and the paper's three ratios measured."""
    rows = {}
    for name, m in methods.items():
        qs = m["questions"]
        rows[name] = {"inject_wall_s": m["inject"]["wall_s"], "inject_cpu_s": m["inject"]["cpu_s"],
                      **{f"{k}_mean": statistics.fmean(r[k] for r in qs) for k in ("cpu_s", "ttft_s", "wall_s")},
                      "f1": statistics.fmean(r["f1"] for r in qs), "f1_ci95": list(bootstrap_ci([r["f1"] for r in qs])),
                      "em": statistics.fmean(r["em"] for r in qs)}
    icl, kv, ft = (methods[n]["questions"] for n in ("in-context learning", "KV-cache learning", "fine-tuning"))
    return {"rows": rows, "measured": {
        "injection vs fine-tuning": methods["fine-tuning"]["inject"]["wall_s"] / methods["KV-cache learning"]["inject"][
            "wall_s"],
        "cheaper than in-context learning": ratio([r["cpu_s"] for r in icl], [r["cpu_s"] for r in kv]),
        "faster than in-context learning": ratio([r["ttft_s"] for r in icl], [r["ttft_s"] for r in kv]),
        "fine-tuning cheaper per question than KV": ratio([r["cpu_s"] for r in kv], [r["cpu_s"] for r in ft])},
        "same_answers_as_icl": sum(a["tokens"] == b["tokens"] for a, b in zip(icl, kv)), "questions": len(icl),
        "paper": PAPER}


def cost_plot(methods: dict, path: Path) -> None:
    """CPU-seconds per question against questions asked of one knowledge base: injection amortized."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = np.logspace(0, 4, 60)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in methods.items():
        per_question = statistics.fmean(r["cpu_s"] for r in m["questions"])
        ax.plot(n, m["inject"]["cpu_s"] / n + per_question, label=name)
    ax.set(xscale="log", yscale="log", xlabel="questions asked of the knowledge base",
           ylabel="CPU-seconds per question (injection amortized)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(model_name: str, questions: int, steps: list, max_prompt_tokens: int, max_new_tokens: int, rank: int,
        lr: float, window: int, data_dir=None) -> dict:
    model, tokenizer = load(model_name)
    base = knowledge(tokenizer, questions, max_prompt_tokens, max_new_tokens, data_dir)
    icl, kv = in_context_and_kv(model, tokenizer, base, max_new_tokens, KDNConfig(chunk_size=256, memory_bytes=4 << 30))
    methods = {"in-context learning": icl, "KV-cache learning": kv,
               "fine-tuning": fine_tuned(model, tokenizer, base, max_new_tokens, steps, rank, lr, window)}
    return {"model": model_name, "questions": len(base), "prompt_tokens": [int(q.ids.shape[1]) for q in base],
            "settings": {"steps": steps, "rank": rank, "lr": lr, "window": window, "max_new_tokens": max_new_tokens,
                         "max_prompt_tokens": max_prompt_tokens}, "methods": methods, **summary(methods)}


def main() -> None:
    from timing import save_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--steps", default="25,50,100", help="fine-tuning budgets in steps, each evaluated")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--window", type=int, default=512, help="tokens of the documents per training step")
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--data-dir", default=None, help="where MuSiQue is (default: kdn eval's: $KDN_DATA, "
                        "$KDN_SHARED/data, ../shared/data)")
    parser.add_argument("--out", default="bench_out/injection")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        before = f.read().split()[:3]
    result = run(args.model, args.questions, [int(s) for s in args.steps.split(",")], args.max_prompt_tokens,
                 args.max_new_tokens, args.rank, args.lr, args.window, args.data_dir)
    with open("/proc/loadavg") as f:
        result["load_average"] = {"before": before, "after": f.read().split()[:3]}
    out = Path(args.out)
    path = save_result(out / "injection.json", result)
    cost_plot(result["methods"], out / "cost_per_question.png")
    for name, row in result["rows"].items():
        print(f"{name:22s} inject {row['inject_wall_s']:8.1f} s  per question: CPU {row['cpu_s_mean']:6.2f} s  TTFT "
              f"{row['ttft_s_mean']:6.2f} s  e2e {row['wall_s_mean']:6.2f} s  F1 {row['f1']:.3f}  EM {row['em']:.3f}")
    print({k: v for k, v in result["measured"].items()}, f"same answers {result['same_answers_as_icl']} of "
          f"{result['questions']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
