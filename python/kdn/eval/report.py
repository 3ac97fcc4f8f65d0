"""Evaluation reports: per-sample JSONL, summary JSON and CSV, a Markdown table, a PNG plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

COLUMNS = ["method", "available", "n", "quality", "quality_ci95", "exact_match", "vs_full", "ttft_mean_s",
           "ttft_median_s", "prefill_tokens_mean",
           "prompt_tokens_mean", "inject_s_mean", "stored_bytes_mean", "identical_to_full", "miss_overhead_mean",
           "reason"]


def markdown_table(result: dict) -> str:
    """The summary in the spirit of CacheGen's Table 1: knowledge injection, compute per request,
    response delay and quality, per method."""
    lines = [f"**{result['dataset']}** on {result['model']} ({result['metric']}, "
             f"{max((s.get('n', 0) for s in result['summary'].values()), default=0)} samples, "
             f"greedy, {result['max_new_tokens']} new tokens, chunk {result['chunk_size']})", "",
             "| method | time to inject the knowledge | compute per request (prefilled tokens) | "
             "response delay (TTFT, mean / median) | quality [95% CI] | vs full (paired) | stored | "
             "same answers as full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in result["summary"].items():
        if not s["available"]:
            lines.append(f"| {name} | n/a | n/a | n/a | n/a | n/a | n/a | not available: {s['reason']} |")
            continue
        same = "-" if s["identical_to_full"] is None else f"{s['identical_to_full']:.0%}"
        inject = f"{s['inject_s_mean']:.2f} s" if s["inject_s_mean"] else "- (none stored)"
        low, high = s.get("quality_ci95") or (float("nan"), float("nan"))
        em = f", EM {s['exact_match']:.3f}" if s.get("exact_match") is not None else ""
        vs = s.get("vs_full")
        paired = f"{vs['mean']:+.3f} [{vs['ci95'][0]:+.3f}, {vs['ci95'][1]:+.3f}]" if vs else "-"
        lines.append(f"| {name} | {inject} | {s['prefill_tokens_mean']:.0f} of {s['prompt_tokens_mean']:.0f} | "
                     f"{s['ttft_mean_s'] * 1e3:.0f} / {s['ttft_median_s'] * 1e3:.0f} ms | "
                     f"{s['quality']:.3f} [{low:.3f}, {high:.3f}]{em} | {paired} | "
                     f"{s['stored_bytes_mean'] / 2**20:.1f} MiB | {same} |")
    misses = {name: s["miss_overhead_mean"] for name, s in result["summary"].items()
              if s["available"] and s.get("miss_overhead_mean") is not None}
    if misses:
        lines += ["", "A miss (the context prefilled, then stored) costs " +
                  ", ".join(f"{name} {value:+.1%}" for name, value in misses.items()) +
                  " over its prefill alone (storing; a codec's encoding included)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Quality vs mean TTFT per method (left) and bytes stored per sample (right)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in result["summary"].items() if v["available"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, s in ran.items():
        left.scatter(s["ttft_mean_s"], s["quality"], s=60)
        left.annotate(name, (s["ttft_mean_s"], s["quality"]), textcoords="offset points", xytext=(6, 4))
    left.set_xscale("log")
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("time to first token, mean (s, log scale)")
    left.set_ylim(-0.05, 1.05)  # every metric is a fraction
    left.set_ylabel(f"quality ({result['metric']})")
    left.set_title(f"{result['dataset']} on {result['model']}")
    left.grid(alpha=0.3)
    right.bar(list(ran), [s["stored_bytes_mean"] / 2**20 for s in ran.values()], color="tab:gray")
    right.set_ylabel("KV stored per sample (MiB)")
    right.set_title("bytes stored")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(result: dict, out_dir: Path) -> dict[str, Path]:
    """Writes samples.jsonl, summary.json, summary.csv, summary.md and quality_vs_ttft.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in
             ("samples.jsonl", "summary.json", "summary.csv", "summary.md", "quality_vs_ttft.png")}
    save_jsonl(result["samples"], paths["samples.jsonl"])
    paths["summary.json"].write_text(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    with open(paths["summary.csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for name, s in result["summary"].items():
            writer.writerow({"method": name, **s})
    paths["summary.md"].write_text(markdown_table(result))
    plot(result, paths["quality_vs_ttft.png"])
    return paths


def save_jsonl(records: list[dict], path: Path) -> None:
    """One JSON record per line, written whole or not at all (a run stopped mid-write keeps the last)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    partial.replace(path)


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
