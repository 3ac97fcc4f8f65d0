"""Figures the docs derive from existing records and data rather than from a new run: each
subcommand prints one, from the files it names, so the prose that quotes it can be checked.

    python benchmarks/record_facts.py serial-estimate     # kdn rows over their serial estimate
    python benchmarks/record_facts.py editing-whole-doc   # the edited store's ratio with each document's tail
    python benchmarks/record_facts.py hits-held           # hits-first: hits over 2 s and 5 s, held or not
    python benchmarks/record_facts.py calibration-overlap # 8-word runs the old calibrations shared
    python benchmarks/record_facts.py miss-price          # a miss priced by vLLM alone's sample and by the prefix cache
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def serial_estimate() -> None:
    """Every recorded kdn serving row with a hits-only replay, against its serial estimate."""
    over = total = 0
    for path in sorted(glob.glob(str(RESULTS / "serving" / "**" / "bench_serving.json"), recursive=True)):
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("of_hit_aware_bound") is not None:
                total += 1
                over += row["of_hit_aware_bound"] > 1
                print(f"{Path(path).parent.name:20} {row['config']:24} {row['of_hit_aware_bound']:.0%}")
    print(f"{over} of {total} rows exceed their serial estimate")


def editing_whole_doc(record: str = "editing/qwen15_100q_isolated/bench_editing.json",
                      fp16_per_token: int = 28 * 2 * 2 * 128 * 2) -> None:
    """Qwen2.5-1.5B (28 layers, 2 KV heads of 128, fp16): each row's ratio over the full chunks the
    record counts, and over the whole documents with each one's partial last chunk at fp16."""
    data = json.loads((RESULTS / record).read_text())
    tokens = sum(d["tokens"] for d in data["deposits"])
    full = data["rows"][0]["fp16_bytes"] // fp16_per_token
    print(f"full-chunk tokens {full:,} of {tokens:,} ({full / tokens:.0%})")
    for r in data["rows"]:
        whole = tokens * fp16_per_token / (r["stored_bytes"] + (tokens - full) * fp16_per_token)
        edit = r["edit"] or "none"
        print(f"{r['codec']:16} {edit:24} {r['x_smaller_than_fp16']:.1f}x full chunks, {whole:.1f}x whole")


def hits_held(record: str = "serving/hits-first/bench_serving.json") -> None:
    """Per kdn row: hits, those held for their document's prefill, and how many over 2 s and 5 s were."""
    from kdn import KDNConfig
    from serving_costs import by_served, held_hits

    data = json.loads((RESULTS / record).read_text())
    for row in data["rows"]:
        if row["config"].startswith("kdn") and "requests_log" in row:
            args = row["requests_log"], data["args"]["tokens"], KDNConfig().chunk_size
            counts = {slow: held_hits(*args, slow=slow) for slow in (2.0, 5.0)}
            served = by_served(*args)
            print(f"{row['config']:22} hits {counts[2.0]['hits']}, held {counts[2.0]['held']}; over 2 s "
                  f"{counts[2.0]['slow_held']} of {counts[2.0]['slow']} held, over 5 s {counts[5.0]['slow_held']} of "
                  f"{counts[5.0]['slow']}; p99 not held {served['hits_not_held']['ttft_p99_s']:.2f} s "
                  f"({served['hits_not_held']['count']}), all hits {served['hits']['ttft_p99_s']:.2f} s")


def calibration_overlap() -> None:
    """The share of the old calibrations' 8-word runs of content that the evaluated samples hold: the
    MuSiQue run's (samples 30-31, kept by passage hash, 30 evaluated) and bench_codecs' by index
    (pool items 20-27 against the first 20). Needs the full datasets ($KDN_SHARED/data)."""
    from bench_codecs import pool
    from kdn.eval import load_dataset
    from kdn.eval.runner import _digest, _held, _runs_of, runs, units

    every = load_dataset("musique")
    evaluated, seen = every[:30], _held(every[:30])
    kept = [u for s in every[30:32] for seg in s.segments for u in units(seg) if _digest(u) not in seen]
    held, ev_runs = set().union(*map(runs, kept)), _runs_of(evaluated)
    worst = max((len(runs(u) & runs(seg)) / max(1, len(runs(u))), i) for u in kept
                for i, s in enumerate(evaluated) for seg in s.segments)
    print(f"musique calibration (hash rule): {len(held & ev_runs) / len(held):.0%} of its runs in the evaluated "
          f"passages; one passage {worst[0]:.0%} in question {worst[1]}'s")
    items = pool()
    ev = _runs_of(items[:20])
    for s in items[20:28]:
        own = _runs_of([s])
        print(f"bench_codecs by index: {s.id:14} {len(own & ev) / max(1, len(own)):.0%} of its runs evaluated")


def miss_price() -> None:
    """A miss's price two ways in each serving run with both rows: vLLM alone's sampled requests (1 /
    its req/s: the free-hit estimate's price) and the same run's prefix-cache misses (its whole run's
    seconds over the documents it prefilled, its hits counted free: at most what a miss cost it); and
    each kdn row's share of the free-hit estimate (and of the serial estimate, where a replay priced
    its hits) under either price (the lower price, the higher estimate). A row whose step caps
    (``+lpT``) the run has no prefix-cache row for is left out."""
    from bench_serving import miss_s_from_prefix

    for path in sorted(glob.glob(str(RESULTS / "serving" / "**" / "bench_serving.json"), recursive=True)):
        rows = json.loads(Path(path).read_text())["rows"]
        for row in rows:
            if not (row["config"].startswith("kdn") and row.get("miss_bound_rps")):
                continue
            same = [r for r in rows if (r["workload"], r["n"], r["concurrency"]) ==
                    (row["workload"], row["n"], row["concurrency"])]
            suffix = row["config"][row["config"].find("+"):] if "+" in row["config"] else ""
            alone = next((r for r in same if r["config"] == "vllm" + suffix), None)
            prefix = next((r for r in same if r["config"] == "vllm-prefix" + suffix), None)
            if alone is None or prefix is None or not prefix.get("docs_prefilled"):
                continue
            sampled = 1 / alone["throughput_rps"]
            from_misses = miss_s_from_prefix(prefix)
            low = min(sampled, from_misses)
            share = row["throughput_rps"] * row["docs_prefilled"] * low / row["requests"]
            serial, replay = "", row.get("replay")
            if row.get("of_hit_aware_bound") is not None:  # the serial estimate, its misses at either price
                hits = (row["requests"] - row["docs_prefilled"]) / replay["throughput_rps"]
                at_low = row["throughput_rps"] * (row["docs_prefilled"] * low + hits) / row["requests"]
                serial = f"; of the serial estimate {row['of_hit_aware_bound']:.0%} sampled, {at_low:.0%} at the lower"
            print(f"{Path(path).parent.name:20} {row['config']:24} miss {sampled:.2f} s sampled ({alone['requests']} "
                  f"requests), <= {from_misses:.2f} s from the prefix cache's {prefix['docs_prefilled']} misses "
                  f"({from_misses / sampled - 1:+.0%}); of the free-hit estimate {row['of_miss_bound']:.0%} "
                  f"sampled, {share:.0%} at the lower price" + serial)


if __name__ == "__main__":
    facts = {"serial-estimate": serial_estimate, "editing-whole-doc": editing_whole_doc,
             "hits-held": hits_held, "calibration-overlap": calibration_overlap,
             "miss-price": miss_price}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fact", choices=facts)
    facts[parser.parse_args().fact]()
