"""The before/after table of this folder's runs (old-<round>/ and new-<round>/ bench_serving.json):
python benchmarks/results/house/serving-before-after/table.py"""
import json
from pathlib import Path

here = Path(__file__).parent
ROUNDS = (1, 2, 3, 4)  # 1-2: before ran first in each round (ab.sh); 3-4: after ran first (ab2.sh, kdn-disk only)
runs = {(side, r): json.loads((here / f"{side}-{r}" / "bench_serving.json").read_text())
        for side in ("old", "new") for r in ROUNDS if (here / f"{side}-{r}" / "bench_serving.json").exists()}
rows = {}
for (side, r), d in runs.items():
    for row in d["rows"]:
        rows.setdefault((row["config"], row["workload"]), {})[(side, r)] = row
print("| configuration | workload | req/s before, round 1 / 2 / 3 / 4 | after | after / before, pair by pair "
      "| TTFT p50 before | after | hit rate before | after |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for (config, workload), by in rows.items():
    def f(key, fmt, scale=1.0):
        return {k: fmt.format(v[key] * scale) for k, v in by.items()}
    rps, p50, hit = f("throughput_rps", "{:.3f}"), f("ttft_p50_s", "{:,.0f}", 1000), f("hit_rate", "{:.0%}")
    pairs = " / ".join(f"{by[('new', r)]['throughput_rps'] / by[('old', r)]['throughput_rps']:.2f}"
                       for r in ROUNDS if ("new", r) in by and ("old", r) in by)
    both = lambda m, side: " / ".join(m[(side, r)] for r in ROUNDS if (side, r) in m)  # noqa: E731
    print(f"| {config} | {workload} | {both(rps, 'old')} | {both(rps, 'new')} | {pairs} | {both(p50, 'old')} ms "
          f"| {both(p50, 'new')} ms | {both(hit, 'old')} | {both(hit, 'new')} |")
