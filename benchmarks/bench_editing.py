"""KV editing at deposit: kvzip pruning at several keep ratios, alone and with a codec, each stored
context asked several different questions (greedy answers, the same prompts for every config).

Tasks: ``demo`` (the demo's document, its 5 questions) and ``lines`` (LongChat line retrieval: each
record cut to its first ``--lines`` lines, ``--questions`` lines asked per record, the gold being
the line's number). Every record is prefilled and scored once (one deposit with every keep ratio,
raw); each configuration (codec x edit) gets a store of its own holding that deposit's blobs for
its edit, put through its tiers (coded as a deposit into it would be): what one configuration's
questions store is never served to another's. The reference is the exact hit (``full``), checked
against a true full prefill on the first ``--full-check`` questions of each record.

``kvtc`` codes pruned chunks only under per-head bases (``--per-head``, the default): the deposit
then files every chunk in the masked layout (a kvtc disk tier beside the raw memory tier, as a
user's store would), so every codec's store holds that layout; ``--joint`` calibrates joint bases
(exact chunks only: a kvzip deposit with them is refused).

Per config: stored bytes (masks + rows, as coded) vs the fp16 size of the exact KV, accuracy with
its 95% bootstrap interval and the paired difference to ``full``, answers identical to ``full``'s,
deposit seconds per 1K tokens, hit TTFT.

The JSON is written after every record; ``--resume`` continues a run that stopped (same command
plus ``--resume``): the records its JSON holds are kept, answers rescored, and the earlier run's
provenance kept under ``earlier_runs``; hit TTFT then covers the records this process timed.

    python benchmarks/bench_editing.py --model qwen2.5-coder-1.5b --task lines --records 6 \
        --keeps 0.5,0.3,0.2 --codecs raw,int4,kvtc:ratio=8 --out benchmarks/results/editing/qwen15
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kdn  # noqa: E402
from kdn import KDN, KDNConfig, kvtc  # noqa: E402
from kdn.demo import QUESTIONS, document, prompt_ids  # noqa: E402
from kdn.edits import kvzip, parse, stored  # noqa: E402
from kdn.engine.session import ROOT  # noqa: E402
from kdn.eval.stats import bootstrap_ci, paired_difference  # noqa: E402
from timing import save_result  # noqa: E402

DEMO_GOLD = ["1312", "Priya Lund", "40 minutes", "December", "233"]
LINES = Path(__file__).resolve().parents[1] / "tests" / "data" / "LongChat" / "lines" / "200_lines.jsonl"
SHARED_LINES = Path(__file__).resolve().parents[2] / "shared" / "data" / "LongChat" / "lines" / "200_lines.jsonl"


def line_records(count: int, lines: int, questions: int, skip: int = 0) -> list[tuple[str, list, list]]:
    """``(context, questions, golds)`` per LongChat lines record: the record's first ``lines`` lines,
    ``questions`` of them asked (chosen with a fixed seed)."""
    path = SHARED_LINES if SHARED_LINES.exists() else LINES
    out = []
    for n, line in enumerate(path.read_text().splitlines()[skip:skip + count]):
        prompt = json.loads(line)["prompt"]
        head, body = prompt.split("Now the record start:", 1)
        rows = [r for r in body.split("Now the record is over.")[0].strip().splitlines() if r.startswith("line ")]
        rows = rows[:lines]
        context = head + "Now the record start:\n\n" + "\n".join(rows) + "\n\nNow the record is over."
        asked = random.Random(skip + n).sample(rows, questions)
        names = [re.match(r"line (\S+):", r).group(1) for r in asked]
        golds = [re.search(r"<(\d+)>", r).group(1) for r in asked]
        out.append((context, [f"Tell me what is the <REGISTER_CONTENT> in line {x}? I need the number." for x in names],
                    golds))
    return out


def shared_context(prompts: list) -> list[int]:
    """The tokens every prompt ``[1, n]`` of a record starts with: the context a deposit stores."""
    shared = 0
    while all(p.shape[1] > shared and p[0, shared] == prompts[0][0, shared] for p in prompts):
        shared += 1
    return prompts[0][0, :shared].tolist()


def copy_into(src: KDN, dst: KDN, model, context: list[int], specs: list[str]) -> None:
    """Put the exact chunks (the partial last one too, with the pointers filed under the probes of
    its tokens) and every edit's masks and rows of ``context`` from ``src`` into ``dst``'s tiers
    (``dst`` codes them as its own deposit would)."""
    session = src.session(model)
    full = src.chunk_keys(model, context)
    tokens = session.tokens(context)
    every = session.prefix_keys(tokens, include_partial=True)
    addresses = list(every)
    if len(every) > len(full):
        probes = session.probe_keys(full[-1] if full else ROOT, tokens[len(full) * session.chunk_size:])
        addresses += [p for p in probes if src.engine.holds(p)]
    for spec in specs:
        edit = parse(spec)
        for key in full:
            payload = src.engine.sidecars.read(session, edit.address(key))
            addresses += [edit.address(key), kvzip.rows_address(edit.address(key), payload)]
    assert src.engine.copy_to(dst.engine, addresses) == len(addresses), "a deposited blob is missing"


RESUMED_ARGS = ("model", "task", "first", "lines", "questions", "keeps", "codecs", "calibration_records", "joint",
                "full_check", "max_new_tokens")


def resumed(args, records, configs) -> tuple[dict, list, list, int, list]:
    """What an earlier run of the same command left in ``--out``: (results, deposits, full checks,
    records done, earlier runs' provenance), each config's answers rescored against ``records``' golds.
    The earlier run's arguments are read back from the command its record holds."""
    results = {c: {"answers": {}, "correct": {}, "ttft": [], "stored": 0, "fp16": 0} for c in configs}
    path = Path(args.out) / "bench_editing.json"
    if not args.resume or not path.exists():
        return results, [], [], 0, []
    earlier = json.loads(path.read_text())
    before = arguments().parse_args(shlex.split(earlier["run"]["command"])[2:])
    changed = {a: getattr(before, a) for a in RESUMED_ARGS if getattr(before, a) != getattr(args, a)}
    if changed:
        raise SystemExit(f"bench_editing --resume: {path} was written with other arguments {changed}; "
                         "use another --out")
    for row in earlier["rows"]:
        into = results[(row["codec"], row["edit"])]
        into.update(stored=row["stored_bytes"], fp16=row["fp16_bytes"], answers=dict(row["answers"]),
                    ttft=list(row.get("ttft_s", [])))
        for key, text in row["answers"].items():
            r, q = map(int, key.split("."))
            into["correct"][key] = float(records[r][2][q].lower() in text.lower())
    right, checked = map(int, earlier["exact_hit_equals_full_prefill"].split("/"))
    runs = [*earlier.get("earlier_runs", []), earlier["run"]]
    return results, list(earlier["deposits"]), [True] * right + [False] * (checked - right), earlier["records"], runs


def exact_bytes(cache: KDN, model, context: list[int]) -> int:
    return sum(cache.engine.stored_bytes(key) for key in cache.chunk_keys(model, context))


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", choices=["demo", "lines"], default="demo")
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--first", type=int, default=0, help="lines: the first record evaluated")
    parser.add_argument("--lines", type=int, default=100)
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--keeps", default="0.5,0.3,0.2")
    parser.add_argument("--codecs", default="raw,int4")
    parser.add_argument("--calibration-records", type=int, default=2, help="kvtc: records after the evaluated ones")
    parser.add_argument("--joint", action="store_true", help="kvtc: joint bases (default: per-head)")
    parser.add_argument("--full-check", type=int, default=1, help="questions per record also run as a full prefill")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", default="bench_out/editing")
    parser.add_argument("--replot", action="store_true", help="only redraw --out's plot from its JSON")
    parser.add_argument("--resume", action="store_true", help="keep the records --out's JSON holds (the same "
                        "command, stopped), run the rest")
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.replot:
        plot(json.loads((Path(args.out) / "bench_editing.json").read_text()), Path(args.out) / "accuracy_vs_size.png")
        return
    model, tokenizer = kdn.models.load(args.model)
    if args.task == "demo":
        records = [(document(), list(QUESTIONS), DEMO_GOLD)]
    else:
        records = line_records(args.records, args.lines, args.questions, skip=args.first)
    specs = [parse(f"kvzip:keep={float(k):g}").spec for k in args.keeps.split(",")]
    codecs = args.codecs.split(",")
    if any(c.startswith("kvtc") for c in codecs):
        extra = line_records(args.calibration_records, args.lines, 1, skip=args.first + args.records) \
            if args.task == "lines" \
            else [(QUESTIONS[0] * 40, [], [])]
        calib = [prompt_ids(tokenizer, c, "")[0].tolist() for c, _, _ in extra]
        kvtc.load(kvtc.calibrate(model, calib, per_head=not args.joint))
    kvtc_disk = next((c for c in codecs if c.startswith("kvtc")), None) if not args.joint else None
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    configs = [(codec, spec) for codec in codecs for spec in [None, *specs]]
    results, deposits, full_checks, done, earlier_runs = resumed(args, records, configs)
    for r, (context_text, questions, golds) in enumerate(records):
        if r < done:
            continue
        prompts = [prompt_ids(tokenizer, context_text, q) for q in questions]
        context = shared_context(prompts)
        shared = len(context)
        raw = KDN(KDNConfig(memory_bytes=8 << 30, disk_codec=kvtc_disk or "raw",
                            disk_dir=tempfile.mkdtemp(prefix="kdn-bench-") if kvtc_disk else None))
        t0 = time.perf_counter()
        report = raw.deposit(model, context, edits=specs, tokenizer=tokenizer)
        deposits.append({"tokens": shared, "seconds": time.perf_counter() - t0,
                         "prefill_seconds": report["prefill_seconds"],
                         "edit_seconds": {s: e["seconds"] for s, e in report["edits"].items()}})
        session = raw.session(model)
        fp16 = len(raw.chunk_keys(model, context)) * session.chunk_size * session.layout.bytes_per_token() \
            // session.layout.torch_dtype.itemsize * 2
        print(f"record {r}: {shared} context tokens, deposit {deposits[-1]['seconds']:.0f} s "
              f"(prefill {report['prefill_seconds']:.0f} s)", flush=True)
        for codec in codecs:
            for spec in [None, *specs]:
                # a store of its own per configuration, holding the deposit alone: what one configuration's
                # questions store is never served to another's
                cache = KDN(KDNConfig(memory_bytes=8 << 30, memory_codec=codec))
                copy_into(raw, cache, model, context, [spec] if spec else [])
                row = results[(codec, spec)]
                row["stored"] += exact_bytes(cache, model, context) if spec is None else \
                    stored.stored_bytes(cache.engine, model, context, spec)
                row["fp16"] += fp16
                for q, (p, gold) in enumerate(zip(prompts, golds)):
                    out = cache.generate(model, p, edits=spec, **gen)
                    stats = cache.last_generate
                    assert stats["hit_tokens"] > 0 and stats.get("edit") == spec, f"{codec} {spec}: not served"
                    text = tokenizer.decode(out[0, p.shape[1]:], skip_special_tokens=True)
                    row["answers"][f"{r}.{q}"] = text
                    row["correct"][f"{r}.{q}"] = float(gold.lower() in text.lower())
                    row["ttft"].append(stats.get("ttft_seconds", float("nan")))
                ok = sum(row["correct"][f"{r}.{q}"] for q in range(len(prompts)))
                print(f"  {codec:>14} {spec or 'exact':>22}: {ok:.0f}/{len(prompts)} right "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        for q in range(min(args.full_check, len(prompts))):
            with torch.inference_mode():
                out = model.generate(prompts[q], **gen)
            text = tokenizer.decode(out[0, prompts[q].shape[1]:], skip_special_tokens=True)
            full_checks.append(text == results[(codecs[0], None)]["answers"][f"{r}.{q}"])
        write_report(args, results, configs, codecs, records[:r + 1], deposits, full_checks, earlier_runs)


def write_report(args, results, configs, codecs, records, deposits, full_checks, earlier_runs=()) -> None:
    """Print and write the table and the JSON of what has run so far (after every record: a long run
    that stops early keeps its records)."""
    reference = results[("raw", None)] if "raw" in codecs else results[configs[0]]
    rows = []
    for (codec, spec), row in results.items():
        n = len(row["correct"])
        diff = paired_difference(row["correct"], reference["correct"])
        rows.append({"codec": codec, "edit": spec, "questions": n, "accuracy": sum(row["correct"].values()) / n,
                     "ci95": bootstrap_ci(list(row["correct"].values())), "vs_full": diff,
                     "identical_to_full": sum(row["answers"][k] == reference["answers"][k] for k in row["answers"]) / n,
                     "stored_bytes": row["stored"], "fp16_bytes": row["fp16"],
                     "x_smaller_than_fp16": row["fp16"] / row["stored"],
                     "ttft_median_s": sorted(row["ttft"])[len(row["ttft"]) // 2], "ttft_s": row["ttft"],
                     "answers": row["answers"]})
    rows.sort(key=lambda x: x["x_smaller_than_fp16"])
    tokens = sum(d["tokens"] for d in deposits)
    summary = {**({"earlier_runs": list(earlier_runs)} if earlier_runs else {}),
               "model": args.model, "task": args.task, "records": len(records), "deposits": deposits,
               "deposit_s_per_1k_tokens": sum(d["seconds"] for d in deposits) / tokens * 1000,
               "exact_hit_equals_full_prefill": f"{sum(full_checks)}/{len(full_checks)}", "rows": rows}
    lines = [f"**{args.task}** on {args.model}: {len(records)} contexts, {rows[0]['questions']} questions per config "
             f"(greedy); exact hit = full prefill on {summary['exact_hit_equals_full_prefill']} checked; deposit "
             f"{summary['deposit_s_per_1k_tokens']:.1f} s per 1K tokens (prefill + scoring + every keep)", "",
             "| codec | edit | x smaller than fp16 | accuracy [95% CI] | vs full (paired) [95% CI] "
             "| same answer as full | hit TTFT |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for x in rows:
        d = x["vs_full"]
        lines.append(f"| {x['codec']} | {x['edit'] or 'none'} | {x['x_smaller_than_fp16']:.1f} | {x['accuracy']:.3f} "
                     f"[{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}] | "
                     f"{d['mean']:+.3f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}] | "
                     f"{x['identical_to_full']:.0%} | {x['ttft_median_s'] * 1e3:.0f} ms |")
    print("\n".join(lines))
    out = Path(args.out)
    path = save_result(out / "bench_editing.json", summary)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(summary, out / "accuracy_vs_size.png")
    print(f"wrote {path}")


def plot(summary: dict, path: Path) -> None:
    """Accuracy (with its 95% interval) against x smaller than fp16, a line per codec through its
    keep ratios (exact first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for codec in dict.fromkeys(r["codec"] for r in summary["rows"]):
        rows = sorted((r for r in summary["rows"] if r["codec"] == codec), key=lambda r: r["x_smaller_than_fp16"])
        x = [r["x_smaller_than_fp16"] for r in rows]
        y = [r["accuracy"] for r in rows]
        err = [[r["accuracy"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["accuracy"] for r in rows]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=codec)
        for r in rows:
            ax.annotate("exact" if r["edit"] is None else r["edit"].split(",")[0].replace("kvzip:", ""),
                        (r["x_smaller_than_fp16"], r["accuracy"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.axvline(20, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("x smaller than fp16 KV (stored bytes)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{summary['task']} on {summary['model']}: {summary['rows'][0]['questions']} questions per point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
