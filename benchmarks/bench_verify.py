"""What verified reuse costs on HF hits: the time of a kdn hit (KDN.generate, one new token) with no
verification and with every hit verified (verify_fraction=1), interleaved in one run, and the cost
that implies at a fraction f (f x the per-check cost, relative to a hit).

    python benchmarks/bench_verify.py --tokens 2000 --hits 8 --out benchmarks/results/verify
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import kdn
from kdn import KDN, KDNConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--hits", type=int, default=8)
    parser.add_argument("--out", default="bench_out/verify")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load(args.model)
    text = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()
    doc = tokenizer(text).input_ids[: args.tokens]
    caches = {0.0: KDN(KDNConfig(verify_fraction=0.0)), 1.0: KDN(KDNConfig(verify_fraction=1.0))}
    full = []
    for cache in caches.values():  # each stores the document once (a miss, timed as the full prefill)
        t0 = time.perf_counter()
        cache.generate(model, torch.tensor([doc]), max_new_tokens=1)
        full.append(time.perf_counter() - t0)
    times: dict = {0.0: [], 1.0: []}
    for i in range(args.hits):
        question = tokenizer(f" Question {i}: what happened on day {i}?").input_ids
        for fraction, cache in caches.items():
            t0 = time.perf_counter()
            cache.generate(model, torch.tensor([doc + question]), max_new_tokens=1)
            times[fraction].append(time.perf_counter() - t0)
    plain, checked = statistics.median(times[0.0]), statistics.median(times[1.0])
    per_check = checked - plain
    result = {"model": args.model, "tokens": args.tokens, "hits": args.hits, "full_prefill_s": min(full),
              "hit_s": plain, "verified_hit_s": checked, "per_check_s": per_check,
              "cost_at_0.01": 0.01 * per_check / plain, "cost_at_1": per_check / plain,
              "mismatches": caches[1.0].stats()["integrity"]["mismatches"],
              "checks": caches[1.0].stats()["integrity"]["checks"], "load_average": os.getloadavg()}
    print(f"{args.model}, {args.tokens}-token document: full prefill {min(full) * 1e3:.0f} ms, "
          f"hit {plain * 1e3:.0f} ms, verified hit {checked * 1e3:.0f} ms -> "
          f"one check costs {per_check / plain:.1%} of a hit; "
          f"verify_fraction=0.01 costs {result['cost_at_0.01']:.2%} ({result['checks']} checks, "
          f"{result['mismatches']} mismatches; load average {os.getloadavg()[0]:.1f})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_verify.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
