"""Remote tier on Redis: get/put throughput vs raw redis-py pipelines of the same values, and
time-to-first-token from a remote hit vs a full prefill on SmolLM2-135M.

Usage: python benchmarks/bench_remote.py [--url redis://127.0.0.1:6379/0] [--lengths 1024,4096] [--repeats 5]
Without --url it starts a private redis-server on a free loopback port (needs redis-server installed)
and stops it at the end. Prints three tables with ratios and writes bench_out/bench_remote.json.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import torch

import kdn
from kdn import KDN, KDNConfig, _core
from kdn.storage.redis_transport import RedisTransport
from kdn.storage.remote import RemoteTier
from timing import save_result, timed


@contextlib.contextmanager
def private_redis():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            for _ in range(100):
                with contextlib.suppress(redis.ConnectionError):
                    client.ping()
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def bench_throughput(url, kv, fingerprint, repeats):
    raw = redis.Redis.from_url(url)
    tier = RemoteTier(url)
    # the read path before kdn's RESP reader
    through_redis_py = RemoteTier(url, transport=RedisTransport(url, 1.0, direct=False))
    rows = []
    for chunk, count in ((16, 64), (64, 16), (256, 8)):
        keys = [i.to_bytes(16, "little") for i in range(count)]
        blobs = [_core.pack_chunk(kv, (i * chunk) % (kv[0].shape[2] - chunk), chunk, fingerprint, k)
                 for i, k in enumerate(keys)]
        values = [bytes(b) for b in blobs]
        names = [f"raw:{i}" for i in range(count)]
        total = sum(len(v) for v in values) / 1e6

        def raw_set():
            pipe = raw.pipeline(transaction=False)
            for n, v in zip(names, values):
                pipe.set(n, v)
            pipe.execute()

        def raw_get():
            pipe = raw.pipeline(transaction=False)
            for n in names:
                pipe.get(n)
            pipe.execute()

        def put_through(t):
            def put():
                for i in range(0, count, 8):  # the writer thread sends batches like this
                    t._send(blobs[i:i + 8])
            return put

        def client_cpu(fn, t):  # the writer's CPU seconds (what a store costs the cores the model shares)
            return timed(fn, repeats, setup=t.clear, clock=time.process_time)

        tier_put = put_through(tier)

        raw.flushdb()
        t_raw_set = timed(raw_set, repeats)
        t_raw_get = timed(raw_get, repeats)
        t_put = timed(tier_put, repeats, setup=tier.clear)
        t_put_py = timed(put_through(through_redis_py), repeats, setup=through_redis_py.clear)
        cpu_put, cpu_put_py = client_cpu(tier_put, tier), client_cpu(put_through(through_redis_py), through_redis_py)
        t_get = timed(lambda: tier.get_many(keys), repeats)
        t_get_py = timed(lambda: through_redis_py.get_many(keys), repeats)
        assert all(b is not None for b in tier.get_many(keys))
        rows.append({"chunk_tokens": chunk, "value_mb": len(values[0]) / 1e6, "values": count,
                     "raw_set_mbs": total / t_raw_set, "kdn_put_mbs": total / t_put,
                     "raw_get_mbs": total / t_raw_get, "kdn_get_mbs": total / t_get,
                     "kdn_get_redis_py_mbs": total / t_get_py, "direct_vs_redis_py": t_get_py / t_get,
                     "kdn_put_redis_py_mbs": total / t_put_py, "put_cpu_ms": cpu_put * 1e3,
                     "put_cpu_redis_py_ms": cpu_put_py * 1e3,
                     "put_ratio": t_raw_set / t_put, "get_ratio": t_raw_get / t_get})
    raw.flushdb()
    return rows


def bench_ttft(model, tokenizer, url, lengths, repeats):
    text = kdn.demo.document()
    ids_all = tokenizer(text, return_tensors="pt").input_ids
    while ids_all.shape[1] < max(lengths) + 1:
        ids_all = torch.cat([ids_all, ids_all], dim=1)
    rows = []
    for n in lengths:
        ids = ids_all[:, : n + 1]  # n cached tokens + 1 prefilled
        cache = KDN(KDNConfig(remote_url=url))
        cache.clear()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            full = time.perf_counter() - t0
        cache.store(model, ids, out.past_key_values)
        cache.flush()

        def hit():
            kv, got = cache.retrieve(model, ids, limit=n)
            assert got == n
            with torch.inference_mode():
                return model(ids[:, got:], past_key_values=kv).logits[0, -1]

        t_hit = timed(hit, repeats, setup=cache.memory.clear)  # every time from Redis, not memory
        cache.memory.clear()
        diff = (hit() - out.logits[0, -1]).abs().max().item()
        rows.append({"tokens": n, "full_prefill_s": full, "remote_hit_s": t_hit, "speedup": full / t_hit,
                     "max_logit_diff": diff})
        cache.clear()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    import kdn.demo  # noqa: F401  (bundled document)

    model, tokenizer = kdn.models.load("smollm2-135m")
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(private_redis())
        ids = tokenizer(kdn.demo.document(), return_tensors="pt").input_ids[:, :1024]
        with torch.inference_mode():
            kv = kdn.layout.cache_to_kv_list(model(ids, use_cache=True).past_key_values)
        fingerprint = kdn.keys.model_fingerprint(model)
        thr = bench_throughput(url, kv, fingerprint, args.repeats)
        print(f"\nremote tier vs raw redis-py pipelines (SmolLM2 fp32 KV chunks, loopback, medians of {args.repeats})")
        print("| chunk | value | values | raw SET MB/s | kdn put MB/s | put ratio | raw GET MB/s | kdn get MB/s "
              "| get ratio | kdn get through redis-py MB/s | RESP reader vs redis-py |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in thr:
            print(f"| {r['chunk_tokens']} tok | {r['value_mb']:.1f} MB | {r['values']} | {r['raw_set_mbs']:.0f} | "
                  f"{r['kdn_put_mbs']:.0f} | {r['put_ratio']:.2f} | {r['raw_get_mbs']:.0f} | "
                  f"{r['kdn_get_mbs']:.0f} | {r['get_ratio']:.2f} | {r['kdn_get_redis_py_mbs']:.0f} | "
                  f"{r['direct_vs_redis_py']:.2f}x |")
        print("\nwrites: kdn's RESP client (values sent from their memory) vs the same tier through redis-py")
        print("| chunk | value | values | put MB/s | through redis-py | writer CPU per put | through redis-py |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in thr:
            print(f"| {r['chunk_tokens']} tok | {r['value_mb']:.1f} MB | {r['values']} | {r['kdn_put_mbs']:.0f} | "
                  f"{r['kdn_put_redis_py_mbs']:.0f} | {r['put_cpu_ms']:.1f} ms | {r['put_cpu_redis_py_ms']:.1f} ms |")
        ttft = bench_ttft(model, tokenizer, url, [int(x) for x in args.lengths.split(",")], args.repeats)
        print("\ntime to first token: remote hit (memory cleared before each) vs full prefill")
        print("| context | full prefill | remote hit | speedup | max logit diff |")
        print("|---:|---:|---:|---:|---:|")
        for r in ttft:
            print(f"| {r['tokens']:,} | {r['full_prefill_s'] * 1e3:.0f} ms | {r['remote_hit_s'] * 1e3:.0f} ms | "
                  f"{r['speedup']:.1f}x | {r['max_logit_diff']:.1e} |")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_remote.json", {"throughput": thr, "ttft": ttft})
    print(f"\nwrote {out_dir / 'bench_remote.json'}")


if __name__ == "__main__":
    main()
