"""Where a serving run's time goes (bench_serving.py): CPU seconds per thread of a vLLM server's
processes (from /proc: which thread paid), vLLM's own per-request phase sums (queue, prefill, decode
from its /metrics histograms), and TTFT split between the requests kdn served and those it missed."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# vLLM's request histograms (seconds, summed over the run's requests): _sum and _count on /metrics
PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds"}


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM's engine core runs in a child of the API server)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _cpu(stat: Path) -> tuple[str, float]:
    """(name, user + system CPU seconds) of a /proc stat file."""
    text = stat.read_text()
    name = text[text.index("(") + 1: text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far per thread name in the process tree of ``pid`` (kdn names its threads
    ``kdn-store`` and ``kdn-disk-write``; vLLM's engine core's compute threads are its OpenMP
    threads); ``exited`` is what threads that ended already used (short-lived copy helpers)."""
    out: dict[str, float] = {}
    for p in _descendants(pid):
        try:
            process, total = _cpu(Path(f"/proc/{p}/stat"))
            live = 0.0
            for task in Path(f"/proc/{p}/task").iterdir():
                name, seconds = _cpu(task / "stat")
                key = f"{process}/{name}"
                out[key] = out.get(key, 0.0) + seconds
                live += seconds
        except OSError:  # ended meanwhile
            continue
        out[f"{process}/exited"] = out.get(f"{process}/exited", 0.0) + max(0.0, total - live)
    return out


def phases(metrics: dict[str, float]) -> dict[str, float]:
    """vLLM's per-request phase sums (seconds) and the request count, from a server's /metrics."""
    out = {name: metrics.get(f"{prefix}_sum", 0.0) for name, prefix in PHASES.items()}
    out["requests"] = metrics.get(f"{PHASES['ttft']}_count", 0.0)
    return out


def difference(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 1e-9}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; nan for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _is_hit(r: dict, doc_tokens: int, chunk: int) -> bool:
    return r["cached_tokens"] >= doc_tokens - chunk


def _is_held(r: dict, log: list[dict], doc_tokens: int, chunk: int) -> bool:
    """Whether ``r`` waited for a miss of its document: that miss began before ``r``'s first token and
    had not answered (+2 s) when ``r`` began (requests sent together: the scheduler may take either
    first). kdn held ``r`` for that prefill (one prefill, not two): its TTFT is the rest of that
    prefill, not a tier's load."""
    return any(m is not r and m["doc"] == r["doc"] and not _is_hit(m, doc_tokens, chunk)
               and m["start"] < r["start"] + r["ttft"] and r["start"] < m["start"] + m["ttft"] + 2
               for m in log if m.get("ttft") is not None)


def by_served(log: list[dict], doc_tokens: int, chunk: int) -> dict:
    """From a docqa row's per-request log: the requests whose document was served (hits) apart from
    those prefilled (misses), and the hits that found their document stored when they started
    (``hits_not_held``: not held for a prefill of it in flight): TTFT p50 / p99 and, where the engine
    reported them per request, the mean and p99 of its queue wait, scheduled-to-first-token and
    decode seconds."""
    done = [r for r in log if r.get("ttft") is not None]
    classes = {"hits": [r for r in done if _is_hit(r, doc_tokens, chunk)],
               "misses": [r for r in done if not _is_hit(r, doc_tokens, chunk)]}
    classes["hits_not_held"] = [r for r in classes["hits"] if not _is_held(r, log, doc_tokens, chunk)]
    out = {}
    for name, mine in classes.items():
        ttfts = [r["ttft"] for r in mine]
        out[name] = {"count": len(ttfts), "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99)}
        for phase in ("queue_s", "scheduled_to_first_token_s", "decode_s"):
            values = [r[phase] for r in mine if phase in r]
            if values:
                out[name][phase] = {"mean": sum(values) / len(values), "p99": percentile(values, 0.99)}
    return out


def held_hits(log: list[dict], doc_tokens: int, chunk: int, slow: float = 5.0) -> dict:
    """From a docqa row's per-request log: the hits, those held for a prefill in flight, how many of
    each took over ``slow`` seconds to their first token, and the longest TTFT of the others."""
    hits = [r for r in log if r.get("ttft") is not None and _is_hit(r, doc_tokens, chunk)]
    held = [_is_held(r, log, doc_tokens, chunk) for r in hits]
    others = [r["ttft"] for r, h in zip(hits, held) if not h]
    return {"hits": len(hits), "held": sum(held), "slow": sum(r["ttft"] > slow for r in hits),
            "slow_held": sum(r["ttft"] > slow and h for r, h in zip(hits, held)),
            "longest_not_held_s": max(others, default=0.0)}


def chat_prefills(rows: list[dict]) -> dict:
    """Prompt tokens each chat row prefilled, beside the floor no cache can go under (tokens no session
    sent before: openings and new turns). Every row sent the same prompts; their total is what kdn
    stored (kdn stores every prompt), the tokens that returned are a row's hits over its share served."""
    chat = [r for r in rows if r["workload"] == "chat"]
    total = next(r["kdn"]["stored_tokens"] for r in chat if r["kdn"].get("stored_tokens"))
    served = next(r for r in chat if r.get("returning_served"))
    floor = total - served["hit_rate"] * total / served["returning_served"]
    return {"prompt": total, "floor": round(floor), **{r["config"]: round(total * (1 - r["hit_rate"])) for r in chat}}


def breakdown_line(row: dict) -> str:
    """One line: per-request phase means, kdn's stage seconds, the threads that used the CPU."""
    parts = []
    ph = row.get("phases") or {}
    if ph.get("requests"):
        n = ph["requests"]
        parts.append("per request: " + ", ".join(f"{k} {ph[k] / n * 1e3:.0f} ms"
                                                 for k in ("queue", "prefill", "decode")))
    kdn = row.get("kdn") or {}
    stages = [(k.removesuffix("_seconds"), v) for k, v in kdn.items() if k.endswith("_seconds") and v]
    if stages:
        parts.append("kdn " + ", ".join(f"{k} {v:.1f} s" for k, v in stages))
    cpu = row.get("cpu") or {}
    if cpu:
        top = sorted(cpu.items(), key=lambda kv: -kv[1])[:6]
        parts.append(f"CPU {sum(cpu.values()):.0f} s of {row['wall_s'] * (os.cpu_count() or 1):.0f}: "
                     + ", ".join(f"{k} {v:.0f}" for k, v in top))
    served = row.get("served")
    if served:
        def ttft(kind):
            s = served[kind]
            phases = "".join(f", {p.removesuffix('_s').replace('_', ' ')} {s[p]['mean'] * 1e3:.0f}"
                             for p in ("queue_s", "scheduled_to_first_token_s") if p in s)
            return f"{s['ttft_p50_s'] * 1e3:.0f}/{s['ttft_p99_s'] * 1e3:.0f} ms ({s['count']}{phases})"

        not_held = f", not held for a prefill {ttft('hits_not_held')}" if "hits_not_held" in served else ""
        parts.append(f"TTFT p50/p99 hits {ttft('hits')}{not_held}, misses {ttft('misses')}")
    if "of_miss_bound" in row:
        parts.append(f"{row['of_miss_bound']:.0%} of the free-hit estimate ({row['miss_bound_rps']:.3f} req/s)")
    if "of_hit_aware_bound" in row:
        each = row["replay"].get("throughput_rps_each", [])
        spread = f" (of {len(each)}: {min(each):.3f}-{max(each):.3f})" if len(each) > 1 else ""
        parts.append(f"hits alone {row['replay']['throughput_rps']:.3f} req/s{spread}: {row['of_hit_aware_bound']:.0%} "
                     f"of the serial estimate ({row['hit_aware_bound_rps']:.3f} req/s)")
    return "    " + "; ".join(parts)


if __name__ == "__main__":  # the hits held for a prefill in flight per kdn docqa row; chat's prefilled tokens
    import json
    import sys

    from kdn import KDNConfig

    record = json.loads(Path(sys.argv[1]).read_text())
    for row in record["rows"]:
        if row["config"].startswith("kdn") and "requests_log" in row:
            args = row["requests_log"], record["args"]["tokens"], KDNConfig().chunk_size
            alone = by_served(*args)["hits_not_held"]
            print(row["config"], held_hits(*args), f"hits not held: p50 {alone['ttft_p50_s']:.2f} s, "
                  f"p99 {alone['ttft_p99_s']:.2f} s")
    if any(r["workload"] == "chat" for r in record["rows"]):
        print("chat prefilled tokens", chat_prefills(record["rows"]))
