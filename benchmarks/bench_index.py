"""The store at scale: memory and disk tiers holding 10^3 ... 10^6 chunk entries (small synthetic
blobs, each a valid kdn chunk of one token). Per size and tier: insert rate, the lookup of a
32K-token prompt (128 chained chunk keys, ``count_prefix``: p50 / p99 over random stored prompts),
insert under eviction (the tier full), the disk index rebuilt at start-up, and the memory tier's
RSS per entry beyond its blob bytes. The lookup p99 should stay flat (<= 2x from 10^3 to 10^6).
With ``--redis URL`` the remote tier too, on a Redis server of its own (the benchmark empties it):
insert through its write queue, the 32K lookup (the 128 EXISTS of one pipelined round trip) and
the server's memory per entry.

    python benchmarks/bench_index.py --sizes 1000,10000,100000,1000000 --disk-max 100000 \
        --out benchmarks/results/index
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kdn import _core  # noqa: E402
from kdn.storage import DiskTier, MemoryTier  # noqa: E402
from kdn.storage.remote import RemoteTier  # noqa: E402
from timing import save_result  # noqa: E402

PROMPT_CHUNKS = 128  # 32K tokens in chunks of 256
KV = [np.zeros((1, 1, 1, 8), dtype=np.float32) for _ in range(2)]  # one layer, one head, one token
FINGERPRINT = b"F" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def blob(i: int):
    return _core.pack_chunk(KV, 0, 1, FINGERPRINT, key(i))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def lookups(tier, n: int, repeats: int, rng) -> dict:
    """count_prefix of PROMPT_CHUNKS stored keys from random starts: p50/p99 in microseconds."""
    times = []
    for _ in range(repeats):
        start = int(rng.integers(0, max(1, n - PROMPT_CHUNKS)))
        keys = [key(i) for i in range(start, min(n, start + PROMPT_CHUNKS))]
        t0 = time.perf_counter()
        found = tier.count_prefix(keys)
        times.append(time.perf_counter() - t0)
        assert found == len(keys), (found, len(keys))
    times.sort()
    return {"p50_us": 1e6 * statistics.median(times), "p99_us": 1e6 * times[int(0.99 * (len(times) - 1))]}


def fill(tier, first: int, count: int, batch: int = 50_000) -> float:
    """Seconds to put ``count`` entries (blobs made beforehand, a batch at a time, untimed) and flush."""
    seconds = 0.0
    for lo in range(first, first + count, batch):
        items = [(key(i), blob(i)) for i in range(lo, min(first + count, lo + batch))]
        t0 = time.perf_counter()
        for k, b in items:
            tier.put(k, b)
        seconds += time.perf_counter() - t0
    t0 = time.perf_counter()
    tier.flush()
    return seconds + time.perf_counter() - t0


def bench_memory(n: int, blob_bytes: int, repeats: int, rng) -> dict:
    gc.collect()
    before = rss_bytes()
    tier = MemoryTier(capacity_bytes=n * blob_bytes)
    seconds = fill(tier, 0, n)
    index_bytes = (rss_bytes() - before - n * blob_bytes) / n
    row = {"entries": n, "insert_per_s": n / seconds, "rss_beyond_blobs_per_entry": index_bytes,
           **lookups(tier, n, repeats, rng)}
    extra = max(1, n // 10)  # full: every insert evicts
    row["insert_evicting_per_s"] = extra / fill(tier, n, extra)
    tier.clear()
    return row


def bench_disk(n: int, repeats: int, rng, root: Path, fsync: bool) -> dict:
    folder = root / f"disk-{n}"
    tier = DiskTier(str(folder), capacity_bytes=2 * n * 4096, fsync=fsync)
    seconds = fill(tier, 0, n)
    tier.close()
    del tier
    gc.collect()
    t0 = time.perf_counter()
    tier = DiskTier(str(folder), capacity_bytes=2 * n * 4096)  # a restart: the index is rebuilt from the files
    rebuild = time.perf_counter() - t0
    row = {"entries": n, "insert_per_s": n / seconds, "rebuild_s": rebuild, **lookups(tier, n, repeats, rng)}
    tier.close()
    shutil.rmtree(folder, ignore_errors=True)
    return row


def bench_remote(n: int, url: str, repeats: int, rng) -> dict:
    import redis

    server = redis.Redis.from_url(url)
    server.flushdb()
    before = server.info("memory")["used_memory"]
    tier = RemoteTier(url, timeout=30.0)
    seconds = 0.0
    for lo in range(0, n, 50_000):  # a batch at a time through the write queue, then drained
        items = [(key(i), blob(i)) for i in range(lo, min(n, lo + 50_000))]
        t0 = time.perf_counter()
        for k, b in items:
            tier.put(k, b)
        tier.flush()
        seconds += time.perf_counter() - t0
    dropped = tier.stats().get("dropped", 0)
    assert dropped == 0, f"{dropped} puts dropped"
    row = {"entries": n, "insert_per_s": n / seconds,
           "server_bytes_per_entry": (server.info("memory")["used_memory"] - before) / n,
           **lookups(tier, n, repeats, rng)}
    server.flushdb()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--disk-max", type=int, default=100000, help="largest disk tier built (one file per entry)")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--no-fsync", action="store_true", help="build disk tiers without fsync per file (faster)")
    parser.add_argument("--dir", default=None, help="where disk tiers are built (default: a temporary folder)")
    parser.add_argument("--redis", default=None, help="a Redis URL: the remote tier too (the server is emptied)")
    parser.add_argument("--out", default="bench_out/index")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    blob_bytes = len(blob(0))
    root = Path(args.dir or tempfile.mkdtemp(prefix="kdn-index-"))
    rows = {"memory": [], "disk": [], "remote": []}
    for n in [int(s) for s in args.sizes.split(",")]:
        row = bench_memory(n, blob_bytes, args.repeats, rng)
        rows["memory"].append(row)
        print(f"memory {n:>8}: insert {row['insert_per_s']:>9.0f}/s, 32K lookup p50 {row['p50_us']:.0f} us "
              f"p99 {row['p99_us']:.0f} us, evicting insert {row['insert_evicting_per_s']:.0f}/s, "
              f"RSS beyond blobs {row['rss_beyond_blobs_per_entry']:.0f} B/entry", flush=True)
        if n <= args.disk_max:
            row = bench_disk(n, args.repeats, rng, root, not args.no_fsync)
            rows["disk"].append(row)
            print(f"disk   {n:>8}: insert {row['insert_per_s']:>9.0f}/s, 32K lookup p50 {row['p50_us']:.0f} us "
                  f"p99 {row['p99_us']:.0f} us, index rebuild {row['rebuild_s']:.2f} s", flush=True)
        if args.redis:
            row = bench_remote(n, args.redis, args.repeats, rng)
            rows["remote"].append(row)
            print(f"remote {n:>8}: insert {row['insert_per_s']:>9.0f}/s, 32K lookup p50 {row['p50_us']:.0f} us "
                  f"p99 {row['p99_us']:.0f} us, server {row['server_bytes_per_entry']:.0f} B/entry", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    for tier, table in rows.items():
        if len(table) > 1:
            print(f"{tier}: lookup p99 at {table[-1]['entries']} / at {table[0]['entries']} entries = "
                  f"{table[-1]['p99_us'] / table[0]['p99_us']:.2f}x")
    result = {"blob_bytes": blob_bytes, "prompt_chunks": PROMPT_CHUNKS, "fsync": not args.no_fsync, "tiers": rows,
              "load_average": os.getloadavg()}
    print("wrote", save_result(Path(args.out) / "bench_index.json", result))


if __name__ == "__main__":
    main()
