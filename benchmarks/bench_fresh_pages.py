"""Sealing KV into new blobs on fresh host memory, the buffer pool's blocks on 4 KiB pages against
huge pages (its default for blocks of 2 MiB or more), alternated in one run: what a store costs
before the pool has blocks to reuse (a GPU engine's first prompts, a growing memory tier).

Llama-3-8B-shaped bf16 KV (32 layers x 8 KV heads x head dim 128), 256-token chunks (33 MB each);
the pool keeps no idle blocks during the run, so every blob is a fresh allocation.

    python benchmarks/bench_fresh_pages.py --out benchmarks/results/fresh_pages
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kdn import _core
from timing import save_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="bench_out/fresh_pages")
    args = parser.parse_args()
    layers, heads, dim, n = 32, 8, 128, args.tokens
    chunk = torch.randn(layers, 2, n, heads, dim).to(torch.bfloat16)
    kv = [chunk[i, side].transpose(0, 1).unsqueeze(0) for i in range(layers) for side in (0, 1)]
    gb = chunk.numel() * 2 / 1e9
    limit = _core.buffer_pool_stats()["limit_bytes"]
    _core.buffer_pool_set_limit(0)  # freed blobs go back to the system: every block is fresh
    seconds: dict[str, list] = {"4 KiB pages": [], "huge pages": []}
    for _ in range(args.rounds):
        for name, huge in (("4 KiB pages", False), ("huge pages", True)):
            _core.buffer_pool_huge_pages(huge)
            t0 = time.perf_counter()
            blobs = [_core.pack_chunk(kv, s, min(256, n - s), bytes(16), bytes(16)) for s in range(0, n, 256)]
            seconds[name].append(time.perf_counter() - t0)
            del blobs
    _core.buffer_pool_huge_pages(True)
    _core.buffer_pool_set_limit(limit)
    rows = {name: {"median_s": statistics.median(v), "gb_per_s": [gb / x for x in v]} for name, v in seconds.items()}
    for name, row in rows.items():
        speeds = sorted(row["gb_per_s"])
        print(f"{name:<12} median {row['median_s'] * 1e3:7.1f} ms  {gb / row['median_s']:5.2f} GB/s "
              f"(rounds {speeds[0]:.2f}-{speeds[-1]:.2f})")
    ratio = rows["4 KiB pages"]["median_s"] / rows["huge pages"]["median_s"]
    print(f"huge pages: {ratio:.2f}x faster (medians of {args.rounds} alternated rounds, {gb:.2f} GB each)")
    record = {"tokens": n, "gb": gb, "rows": rows, "ratio": ratio}
    print(f"wrote {save_result(Path(args.out) / 'bench_fresh_pages.json', record)}")


if __name__ == "__main__":
    main()
