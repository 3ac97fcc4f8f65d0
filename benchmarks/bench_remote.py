"""Remote tier on Redis and on Mooncake Store: get/put throughput vs raw redis-py pipelines of the
same values, the tier's own throughput on each store, and time-to-first-token from a remote hit on
each store vs a full prefill on SmolLM2-135M, all in one run (the prompt: a context of each length,
then a real question the hit computes; both keep only the last position's logits).

Usage: python benchmarks/bench_remote.py [--url redis://127.0.0.1:6379/0] [--stores redis,mooncake]
       [--lengths 1024,4096] [--repeats 5]
Without --url it starts a private redis-server on a free loopback port (needs redis-server installed);
``mooncake`` starts a private mooncake_master and a mooncake_client lending 2 GB (pip install
'kdn[mooncake]'); both are stopped at the end. Prints four tables with ratios and writes
bench_out/bench_remote.json.
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
from timing import question_ids, save_result, timed


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


@contextlib.contextmanager
def private_mooncake():
    """A mooncake_master (with its HTTP metadata server) and a mooncake_client lending 2 GB, on loopback."""
    ports = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    rpc, http, metrics, client = ports
    metadata = f"http://127.0.0.1:{http}/metadata"
    import mooncake  # its pip package ships the servers

    servers = Path(mooncake.__file__).parent
    procs = [subprocess.Popen([str(servers / "mooncake_master"), f"--rpc_port={rpc}", f"--metrics_port={metrics}",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        time.sleep(1.5)
        procs.append(subprocess.Popen([str(servers / "mooncake_client"), f"--master_server_address=127.0.0.1:{rpc}",
                                       f"--metadata_server={metadata}", "--host=127.0.0.1", f"--port={client}",
                                       "--global_segment_size=2GB"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.5)
        yield f"mooncake://127.0.0.1:{rpc}", {"metadata_server": metadata}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def bench_tier(stores, kv, fingerprint, repeats):
    """The remote tier's own put (sent, waited for) and get (verified blobs) on each store, same values."""
    rows = []
    for chunk, count in ((64, 16), (256, 8)):
        keys = [(1000 + i).to_bytes(16, "little") for i in range(count)]
        blobs = [_core.pack_chunk(kv, (i * chunk) % (kv[0].shape[2] - chunk), chunk, fingerprint, k)
                 for i, k in enumerate(keys)]
        total = sum(len(b) for b in blobs) / 1e6
        row = {"chunk_tokens": chunk, "value_mb": len(blobs[0]) / 1e6, "values": count}
        for name, (url, options) in stores.items():
            tier = RemoteTier(url, options=options)

            def put(tier=tier):
                for k, b in zip(keys, blobs):
                    tier.put(k, b)
                assert tier.flush(30)

            def forget(tier=tier):  # each put writes: the tier skips a value the store holds
                for k in keys:
                    tier.remove(k)

            row[f"{name}_put_mbs"] = total / timed(put, repeats, setup=forget)
            row[f"{name}_get_mbs"] = total / timed(lambda tier=tier: tier.get_many(keys), repeats)
            assert all(b is not None for b in tier.get_many(keys))
            for k in keys:
                tier.remove(k)
        rows.append(row)
    return rows


def bench_throughput(url, kv, fingerprint, repeats):
    raw = redis.Redis.from_url(url)
    tier = RemoteTier(url)
    # the read path before kdn's RESP reader
    through_redis_py = RemoteTier(url, transport=RedisTransport(url, 1.0, RedisTransport.Options(direct=False)))
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


def bench_ttft(model, tokenizer, stores, lengths, repeats):
    text = kdn.demo.document()
    ids_all = tokenizer(text, return_tensors="pt").input_ids
    while ids_all.shape[1] < max(lengths) + 1:
        ids_all = torch.cat([ids_all, ids_all], dim=1)
    rows, question = [], question_ids(tokenizer)
    for n in lengths:
        context = ids_all[:, :n]
        ids = torch.cat([context, question], dim=1)  # n cached tokens, then a real question computed
        with torch.inference_mode():
            full = timed(lambda: model(ids, use_cache=True, logits_to_keep=1), repeats)
            reference = model(ids, logits_to_keep=1).logits[0, -1]
            stored = model(context, use_cache=True).past_key_values  # what a miss of the context stores
        row = {"tokens": n, "question_tokens": question.shape[1], "full_prefill_s": full}
        for name, (url, options) in stores.items():
            cache = KDN(KDNConfig(remote_url=url, remote_options=options))
            cache.clear()
            cache.store(model, context, stored)
            cache.flush()

            def hit(cache=cache):
                kv, got = cache.retrieve(model, ids, limit=n)
                assert got == n
                with torch.inference_mode():
                    return model(ids[:, got:], past_key_values=kv, logits_to_keep=1).logits[0, -1]

            t_hit = timed(hit, repeats, setup=cache.memory.clear)  # every time from the store, not memory
            cache.memory.clear()
            served = cache.stats()["remote"]["hits"]
            row.update({f"{name}_hit_s": t_hit, f"{name}_speedup": full / t_hit,
                        f"{name}_max_logit_diff": (hit() - reference).abs().max().item()})
            assert cache.stats()["remote"]["hits"] > served, f"the {name} hit was not served by the store"
            cache.clear()
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url")
    parser.add_argument("--stores", default="redis,mooncake", help="remote stores to time: redis, mooncake")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    import kdn.demo  # noqa: F401  (bundled document)

    model, tokenizer = kdn.models.load("smollm2-135m")
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(private_redis())
        stores = {"redis": (url, None)}
        if "mooncake" in args.stores.split(","):
            stores["mooncake"] = stack.enter_context(private_mooncake())
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
        tier = bench_tier(stores, kv, fingerprint, args.repeats)
        print("\nthe remote tier on each store (put: sent and acknowledged; get: verified blobs), same values")
        print("| chunk | value | values | " + " | ".join(f"{s} put MB/s | {s} get MB/s" for s in stores) + " |")
        print("|---:|---:|---:|" + "---:|---:|" * len(stores))
        for r in tier:
            print(f"| {r['chunk_tokens']} tok | {r['value_mb']:.1f} MB | {r['values']} | "
                  + " | ".join(f"{r[s + '_put_mbs']:.0f} | {r[s + '_get_mbs']:.0f}" for s in stores) + " |")
        ttft = bench_ttft(model, tokenizer, stores, [int(x) for x in args.lengths.split(",")], args.repeats)
        print("\ntime to first token: a hit from each store (memory cleared before each) vs full prefill, "
              f"medians of {args.repeats}")
        print("| context | full prefill | " + " | ".join(f"{s} hit | speedup | max logit diff" for s in stores) + " |")
        print("|---:|---:|" + "---:|---:|---:|" * len(stores))
        for r in ttft:
            print(f"| {r['tokens']:,} | {r['full_prefill_s'] * 1e3:.0f} ms | " + " | ".join(
                f"{r[s + '_hit_s'] * 1e3:.0f} ms | {r[s + '_speedup']:.1f}x | {r[s + '_max_logit_diff']:.1e}"
                for s in stores) + " |")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_remote.json", {"throughput": thr, "tier": tier, "ttft": ttft})
    print(f"\nwrote {out_dir / 'bench_remote.json'}")


if __name__ == "__main__":
    main()
