"""Storage tiers on real KV: memory-tier put/get vs a plain copy, disk tier vs torch.save and safetensors,
and the hit rate of the eviction policies on a skewed trace with a scan.

Usage: python benchmarks/bench_tiers.py [--model smollm2-135m|stories260k] [--tokens 2048] [--repeats 5]
Prints three tables with ratios and writes bench_out/bench_tiers.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import kdn
from kdn import KDN, KDNConfig, _core
from timing import save_result, timed


def real_kv(model_name: str, tokens: int):
    model, tokenizer = kdn.models.load(model_name)
    ids = tokenizer(kdn.demo.document(), return_tensors="pt").input_ids
    while ids.shape[1] < tokens:
        ids = torch.cat([ids, ids], dim=1)
    ids = ids[:, :tokens]
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    kv = kdn.layout.cache_to_kv_list(cache)
    return model, ids, [t.contiguous() for t in kv]


# -- memory tier ------------------------------------------------------------------------------
def bench_memory(kv, repeats):
    rows = []
    n = kv[0].shape[2]
    for chunk in (16, 64, 256):
        if chunk > n:
            continue
        blob = _core.pack_chunk(kv, 0, chunk, b"F" * 16, b"K" * 16)
        src = np.frombuffer(blob, dtype=np.uint8)
        dst = np.empty_like(src)
        store = _core.MemoryStore(4 * len(blob))
        put = timed(lambda: store.put(b"K" * 16, src), repeats)          # copies into a new tier buffer
        plain_alloc_copy = timed(lambda: src.copy(), repeats)              # numpy: new array + copy
        get = timed(lambda: np.copyto(dst, np.frombuffer(store.get(b"K" * 16), dtype=np.uint8)), repeats)
        plain_copy = timed(lambda: np.copyto(dst, src), repeats)
        gb = len(blob) / 1e9
        rows.append({"chunk_tokens": chunk, "blob_mb": len(blob) / 1e6,
                     "put_gbs": gb / put, "numpy_copy_alloc_gbs": gb / plain_alloc_copy,
                     "get_gbs": gb / get, "numpy_copyto_gbs": gb / plain_copy,
                     "put_ratio": plain_alloc_copy / put, "get_ratio": plain_copy / get})
    return rows


def bench_pool(kv, repeats):
    """Packing a document's KV into new blobs: system-fresh pages (pool limit 0; 4 KiB pages and huge
    pages, the pool's default, alternated) vs the buffer pool's reused blocks."""
    chunks = kv[0].shape[2] // 256

    def pack_all():
        return [_core.pack_chunk(kv, i * 256, 256, b"F" * 16, i.to_bytes(16, "little")) for i in range(chunks)]

    limit = _core.buffer_pool_stats()["limit_bytes"]
    _core.buffer_pool_set_limit(0)  # freed blobs go back to the system allocator
    small = []  # fresh 4 KiB pages vs fresh huge pages (the pool's default), alternated
    huge = []
    for _ in range(repeats):
        for on, into in ((False, small), (True, huge)):
            _core.buffer_pool_huge_pages(on)
            into.append(timed(pack_all, 1))
    fresh = statistics.median(huge)
    _core.buffer_pool_set_limit(limit)
    pack_all()  # fills the pool with this size class
    pooled = timed(pack_all, repeats)
    mb = chunks * len(_core.pack_chunk(kv, 0, 256, b"F" * 16, bytes(16))) / 1e6
    return {"mb": mb, "fresh_s": fresh, "fresh_small_pages_s": statistics.median(small), "pooled_s": pooled}


# -- disk tier --------------------------------------------------------------------------------
def drop_from_page_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def bench_disk(model, ids, kv, repeats, fsync: bool):
    """Store+load of a whole document's KV; kdn store = pack + write chunk files, load = read + verify +
    copy into per-layer tensors (what a retrieve does)."""
    results = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("KDN_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        def kdn_methods(name: str, secret: str | None):
            """(store, load, reset, files) of a kdn disk tier; ``secret``: keyed BLAKE3 tags on the files."""
            cfg = KDNConfig(chunk_size=256, disk_dir=str(tmp / name), disk_fsync=fsync, write_policy="write-through",
                            secret=secret)
            cache = KDN(cfg)
            info = cache.session(model)
            keys = info.prefix_keys(info.tokens(ids[:, :n]))
            lay = info.layout
            disk = cache.disk.store

            def kdn_store():
                for i, key in enumerate(keys):
                    disk.put(key, _core.pack_chunk(kv, i * 256, 256, info.fingerprint, key))

            def kdn_load():
                blobs = disk.get_many(keys)
                n_ok, err = _core.verify_chunks(blobs, keys, info.fingerprint, lay.dtype, lay.layers, lay.kv_heads,
                                                lay.head_dim, 256)
                assert n_ok == len(keys), err
                dst = [torch.empty(1, lay.kv_heads, n, lay.head_dim, dtype=lay.torch_dtype) for _ in kv]
                _core.unpack_chunks(blobs, dst, n)
                return dst

            return kdn_store, kdn_load, disk.clear, lambda: [disk.path_of(k) for k in keys]

        n = (ids.shape[1] // 256) * 256
        kdn_plain, kdn_keyed = kdn_methods("kdn", None), kdn_methods("kdn-keyed", "bench-secret-123")
        kdn_load = kdn_plain[1]
        kv_n = [t[:, :, :n].contiguous() for t in kv]
        torch_path, st_path = tmp / "kv.pt", tmp / "kv.safetensors"

        def torch_store():
            torch.save(kv_n, torch_path)
            if fsync:
                fsync_file(torch_path)

        def st_store():
            save_file({str(i): t for i, t in enumerate(kv_n)}, st_path)
            if fsync:
                fsync_file(st_path)

        methods = {"kdn": kdn_plain, "kdn keyed (secret=)": kdn_keyed,
                   "torch.save": (torch_store, lambda: torch.load(torch_path), None, lambda: [torch_path]),
                   "safetensors": (st_store, lambda: st_load(st_path), None, lambda: [st_path])}
        for name, (store, load, reset, files) in methods.items():
            t_store = timed(store, repeats, setup=reset)
            t_warm = timed(load, repeats)
            t_cold = timed(load, repeats, setup=lambda f=files: drop_from_page_cache(f()))
            results[name] = {"store_s": t_store, "load_warm_s": t_warm, "load_cold_s": t_cold}
        loaded = kdn_load()
        assert all(torch.equal(a, b) for a, b in zip(loaded, kv_n)), "kdn load differs from the stored KV"
        results["bytes"] = sum(t.numel() * t.element_size() for t in kv_n)
    return results


def st_load(path):
    """safetensors' load_file maps the file lazily; clone so the bytes are really read, as torch.load does."""
    return {k: v.clone() for k, v in load_file(path).items()}


# -- eviction policies ------------------------------------------------------------------------
def skewed_trace(universe=2000, length=60_000, scan_every=15_000, scan_len=3000, seed=0):
    """80/20 reuse: 80% of requests go to 20% of the keys; every scan_every requests a scan of scan_len new keys."""
    rng = random.Random(seed)
    hot = universe // 5
    trace, next_scan_key = [], 10**9
    for step in range(length):
        if step and step % scan_every == 0:
            trace.extend(range(next_scan_key, next_scan_key + scan_len))
            next_scan_key += scan_len
        trace.append(rng.randrange(hot) if rng.random() < 0.8 else rng.randrange(hot, universe))
    return trace


def bench_policies():
    trace = skewed_trace()
    rows = []
    for fraction in (0.05, 0.1, 0.2):
        row = {"cache_fraction": fraction}
        for policy in ("lru", "s3fifo"):
            store = _core.MemoryStore(int(2000 * fraction) * 64, policy)
            hits = 0
            for k in trace:
                key = k.to_bytes(16, "little")
                if store.get(key) is not None:
                    hits += 1
                else:
                    store.put(key, b"x" * 64)
            row[policy] = hits / len(trace)
        rows.append(row)
    return rows, len(trace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    import kdn.demo  # noqa: F401  (bundled document)

    model, ids, kv = real_kv(args.model, args.tokens)
    mem = bench_memory(kv, args.repeats)
    print(f"\nmemory tier ({args.model} fp32 KV chunks; medians of {args.repeats})")
    print("| chunk | blob | put GB/s | numpy copy GB/s | put/copy | get+copy-out GB/s | numpy copyto GB/s | get/copy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in mem:
        print(f"| {r['chunk_tokens']} tok | {r['blob_mb']:.1f} MB | {r['put_gbs']:.2f} | "
              f"{r['numpy_copy_alloc_gbs']:.2f} | {r['put_ratio']:.2f} | {r['get_gbs']:.2f} | "
              f"{r['numpy_copyto_gbs']:.2f} | {r['get_ratio']:.2f} |")

    pool = bench_pool(kv, args.repeats)
    print(f"\npack {pool['mb']:.0f} MB of KV into new blobs: fresh 4 KiB pages "
          f"{pool['fresh_small_pages_s'] * 1e3:.1f} ms, "
          f"fresh huge pages {pool['fresh_s'] * 1e3:.1f} ms ({pool['fresh_small_pages_s'] / pool['fresh_s']:.1f}x "
          f"faster), pooled buffers {pool['pooled_s'] * 1e3:.1f} ms ({pool['fresh_s'] / pool['pooled_s']:.1f}x)")

    disk = {fs: bench_disk(model, ids, kv, args.repeats, fs) for fs in (True, False)}
    mb = disk[True]["bytes"] / 1e6
    print(f"\ndisk tier: store + load of {mb:.0f} MB of KV ({args.tokens} tokens; cold = page cache dropped "
          "with posix_fadvise)")
    print("| fsync | method | store s | load warm s | load cold s | store+load warm s | kdn speedup (warm) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for fs, res in disk.items():
        ours = res["kdn"]["store_s"] + res["kdn"]["load_warm_s"]
        for name in ("kdn", "kdn keyed (secret=)", "torch.save", "safetensors"):
            r = res[name]
            total = r["store_s"] + r["load_warm_s"]
            print(f"| {'on' if fs else 'off'} | {name} | {r['store_s']:.3f} | {r['load_warm_s']:.3f} | "
                  f"{r['load_cold_s']:.3f} | {total:.3f} | {total / ours:.2f}x |")

    policies, length = bench_policies()
    print(f"\neviction hit rate: 80/20 reuse over 2,000 keys, 4 scans of 3,000 one-shot keys, {length:,} requests")
    print("| cache size | lru | s3fifo | s3fifo - lru |")
    print("|---:|---:|---:|---:|")
    for r in policies:
        print(f"| {r['cache_fraction']:.0%} | {r['lru']:.3f} | {r['s3fifo']:.3f} | {r['s3fifo'] - r['lru']:+.3f} |")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_tiers.json", {"model": args.model, "tokens": args.tokens, "memory": mem, "pool": pool,
                                               "disk": {str(k): v for k, v in disk.items()}, "policies": policies})
    print(f"\nwrote {out_dir / 'bench_tiers.json'}")


if __name__ == "__main__":
    main()
