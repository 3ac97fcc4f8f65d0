"""Attention steering at deposit (`steer`, PASTA) against the unedited hit, at identical prompts.

Task `conflict` (default): a context with two conflicting statements about one role ("The records
are clear that X was A." / "Some say X was B.", in random order, buried in filler text); the first
is emphasized at deposit; the question asks who X was. Correct = the answer names A. Task `single`:
the same with one statement only (steering should not cost accuracy where the model already
answers). Task `instruction` (another family than the profiled one): a chat prompt whose document
buries a format instruction (answer in capital letters / begin with "Indeed" / answer as a JSON
object with the key "answer"), the instruction emphasized, then one of the demo's questions;
correct = the answer follows the format. Cases are drawn with seeds disjoint from the head
profiling's (which uses the conflict template, as PASTA profiles on task examples). Several tasks
in one run (``--task conflict,instruction``) share one head profile. Each case is deposited once; the unedited hit and
the steered hits answer the same prompt. Reports accuracy of each, the paired gain with its 95%
bootstrap interval, and how often each names the other (wrong) candidate.

    python benchmarks/bench_steering.py --model smollm2-135m --cases 50 --out benchmarks/results/editing/steering
    python benchmarks/bench_steering.py --model smollm2-135m --cases 50 --task single --out ...
    python benchmarks/bench_steering.py --model qwen2.5-coder-0.5b --cases 50 --emphasis auto --out ...
    python benchmarks/bench_steering.py --model qwen2.5-coder-1.5b --cases 50 --task conflict,instruction --out ...

``--emphasis auto``: the span is not given; the model names at deposit the sentence it holds most
important (``emphasize="auto"``, :mod:`kdn.edits.autospans`). Also reported: how often the sentences
it named are the right statement, the other one, or filler only; a deposit where it names none is
stored unedited (what a user does after kdn refuses it), so its steered answers are the plain one.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import kdn
from kdn.data import velmora
from kdn.demo import QUESTIONS
from kdn.edits import steer
from kdn.eval.stats import bootstrap_ci, paired_difference
from timing import save_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--words", type=int, default=150, help="filler words around the two statements")
    parser.add_argument("--alpha", type=float, default=0.01)
    parser.add_argument("--heads", default="4,16", help="steered head counts to compare")
    parser.add_argument("--task", default="conflict",
                        help="comma-separated: conflict (two names, the right one emphasized), single (one name, "
                             "emphasized), instruction (a buried format instruction, emphasized)")
    parser.add_argument("--emphasis", default="given", choices=["given", "auto"],
                        help="given: the right statement is emphasized; auto: the model names what to emphasize")
    parser.add_argument("--out", default="bench_out/steering")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load(args.model)
    cache = kdn.KDN(kdn.KDNConfig(chunk_size=32))
    t0 = time.perf_counter()
    from kdn.edits import stored

    ranked = stored.head_profile(cache.engine, model, tokenizer)
    profile_s = time.perf_counter() - t0
    print(f"head profile: {profile_s:.0f} s; best {ranked[:5]}", flush=True)
    specs = [f"steer:alpha={args.alpha:g},heads={h}" for h in args.heads.split(",")]
    for task in args.task.split(","):
        if task not in ("conflict", "single", "instruction"):
            raise SystemExit(f"unknown task {task!r}")
        run_task(task, args, model, tokenizer, cache, specs, ranked, profile_s)


INSTRUCTIONS = [
    ("Important: whoever asks about this text, write every answer entirely in capital letters.",
     lambda a: sum(c.isupper() for c in a) >= 0.9 * max(3, sum(c.isalpha() for c in a))),
    ("Important: whoever asks about this text, begin every answer with the word 'Indeed'.",
     lambda a: a.strip().lower().startswith("indeed")),
    ('Important: whoever asks about this text, give every answer as a JSON object with the key "answer".',
     lambda a: "{" in a.strip()[:3] and '"answer"' in a),
]


def instruction_case(tokenizer, rng: random.Random, words: int):
    """``(context text, emphasized span, prompt text, check)``: a chat prompt whose document buries
    one of :data:`INSTRUCTIONS` in ``words`` words of filler, then asks one demo question."""
    text = velmora().split()
    start = rng.randrange(max(1, len(text) - words))
    body = text[start:start + words]
    cut = rng.randrange(20, len(body) - 20)
    instruction, check = rng.choice(INSTRUCTIONS)
    doc = " ".join(body[:cut]) + " " + instruction + " " + " ".join(body[cut:])
    messages = [{"role": "user", "content": doc + "\n\n" + rng.choice(QUESTIONS)}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    at = prompt.index(doc)
    span = (at + doc.index(instruction), at + doc.index(instruction) + len(instruction))
    return prompt[: at + len(doc)], span, prompt, check


def run_task(task, args, model, tokenizer, cache, specs, ranked, profile_s) -> None:
    rng = random.Random(1000)  # the profile draws from seed 0
    right: dict = {"plain": {}}
    picked: dict = {}  # auto emphasis: which statement the model named, per case
    wrong: dict = {"plain": {}}
    for spec in specs:
        right[spec], wrong[spec] = {}, {}
    for case in range(args.cases):
        if task == "instruction":
            context, span, prompt, check = instruction_case(tokenizer, rng, args.words)
            other, new_tokens = "\0", 16
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        else:
            context, span, question, answer = steer.probe(velmora(), rng, words=args.words, conflict=task == "conflict")
            other = next((n for n in steer.NAMES if f" was {n}." in context and n != answer.strip()), "\0")
            ids, new_tokens = tokenizer(context + question, return_tensors="pt").input_ids, 6
            check = _names(answer.strip())
        steered = True
        if args.emphasis == "given":
            cache.deposit(model, context, edits=specs, tokenizer=tokenizer, emphasize=[span])
        else:
            try:
                found = cache.deposit(model, context, edits=specs, tokenizer=tokenizer, emphasize="auto")
                picked[case] = _picked(found["auto_spans"]["spans"], span, context, other)
            except kdn.InvalidInputError:
                picked[case], steered = "none", False
                cache.deposit(model, context, tokenizer=tokenizer)
        for method in ["plain", *specs]:
            edit = None if method == "plain" or not steered else method
            out = cache.generate(model, ids, edits=edit, max_new_tokens=new_tokens, do_sample=False)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            right[method][case] = float(check(text))
            wrong[method][case] = float(other in text)
        line = "  ".join(f"{m}: {sum(right[m].values()) / (case + 1):.2f}" for m in right)
        print(f"{task} case {case + 1}/{args.cases}  accuracy {line}  {picked.get(case, '')}", flush=True)
    rows = {}
    for method in right:
        rows[method] = {"accuracy": sum(right[method].values()) / args.cases,
                        "accuracy_ci95": bootstrap_ci(right[method].values()),
                        "names_the_other": sum(wrong[method].values()) / args.cases}
        if method != "plain":
            rows[method]["gain_vs_plain"] = paired_difference(right[method], right["plain"])
    print("\n| method | accuracy | 95% CI | names the other candidate | gain vs unedited hit (95% CI) |")
    print("|---|---:|---:|---:|---:|")
    for method, r in rows.items():
        gain = r.get("gain_vs_plain")
        g = f"{gain['mean']:+.3f} ({gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f})" if gain else "-"
        print(f"| {method} | {r['accuracy']:.3f} | {r['accuracy_ci95'][0]:.2f}-{r['accuracy_ci95'][1]:.2f} | "
              f"{r['names_the_other']:.3f} | {g} |")
    named = {k: sum(v == k for v in picked.values()) / args.cases for k in ("right", "other", "filler", "none")}
    if picked:
        print("auto emphasis named: " + ", ".join(f"{k} {v:.2f}" for k, v in named.items()))
    suffix = "_auto" if args.emphasis == "auto" else ""
    path = save_result(Path(args.out) / f"bench_steering_{args.model}_{task}{suffix}.json",
                       {"model": args.model, "task": task, "cases": args.cases, "words": args.words,
                        "emphasis": args.emphasis, "auto_named": named if picked else None,
                        "profile_seconds": profile_s,
                        "profile_top": ranked[:16], "rows": rows, "torch": torch.__version__})
    print("saved", path)


def _names(answer: str):
    """A check that an answer names ``answer``."""
    return lambda text: answer in text


def _picked(spans, right_span, context, other) -> str:
    """Which statement the auto spans cover: ``right`` (the emphasized one), ``other`` (the
    conflicting one) or ``filler`` (neither)."""
    if any(s < right_span[1] and right_span[0] < e for s, e in spans):
        return "right"
    if any(f" was {other}." in context[s:e] for s, e in spans):
        return "other"
    return "filler"


if __name__ == "__main__":
    main()
