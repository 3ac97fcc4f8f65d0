"""Encryption at rest: what a 4K-token remote hit costs when the store holds ciphertext.

A SmolLM2-135M (fp32) prompt of --tokens tokens is stored in a private redis-server by three
configurations, and each is timed on its own hit (memory cleared before every hit: read from Redis,
verified, decoded, a real question's forward: 35 tokens after the context) in one run, configurations
interleaved per repeat:

* ``plain``: no secret (checksums only);
* ``keyed``: ``secret=`` (keyed BLAKE3 tags, names derived from the secret);
* ``encrypted``: ``secret=`` + ``encrypt=True`` (AES-256-GCM, a key per chunk).

All three read values whole (``delivery="whole"``: sealed values cannot be read in ranges); the
plain layer-wise hit is printed beside them. Also times AES-GCM alone over the hit's stored bytes.

Usage: python benchmarks/bench_encrypt.py [--tokens 4096] [--repeats 7] [--out results/trust/encrypt]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import torch

import kdn
import kdn.demo
from bench_remote import private_redis
from kdn import KDN, KDNConfig
from timing import question_ids, save_result

CONFIGS = {
    "plain": dict(delivery="whole"),
    "keyed": dict(delivery="whole", secret="bench secret"),
    "encrypted": dict(delivery="whole", secret="bench secret", encrypt=True),
    "plain layer-wise": dict(delivery="layerwise"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load("smollm2-135m")
    context = tokenizer(kdn.demo.document(), return_tensors="pt").input_ids
    while context.shape[1] < args.tokens:
        context = torch.cat([context, context], dim=1)
    context = context[:, : args.tokens]
    ids = torch.cat([context, question_ids(tokenizer)], dim=1)  # a hit computes a real question
    with torch.inference_mode():
        out = model(context, use_cache=True)  # what a miss of the context stores
        reference = model(ids, logits_to_keep=1).logits[0, -1]
    times = {name: [] for name in CONFIGS}
    diffs, stored_bytes = {}, {}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(private_redis())
        caches = {name: KDN(KDNConfig(remote_url=url, **settings)) for name, settings in CONFIGS.items()}
        next(iter(caches.values())).remote.clear()
        for name, cache in caches.items():
            cache.store(model, context, out.past_key_values)
            cache.flush()
            tier = cache.remote
            stored_bytes[name] = sum(len(v) for v in tier.transport.get(
                [tier.redis_key(k) for k in cache.chunk_keys(model, ids)]) if v is not None)

        def hit(cache):
            kv, got = cache.retrieve(model, ids, limit=args.tokens)
            assert got == args.tokens, got
            with torch.inference_mode():
                return model(ids[:, got:], past_key_values=kv, logits_to_keep=1).logits[0, -1]

        for _ in range(args.repeats):
            for name, cache in caches.items():
                cache.memory.clear()  # every hit from Redis
                t0 = time.perf_counter()
                logits = hit(cache)
                times[name].append(time.perf_counter() - t0)
                diffs[name] = (logits - reference).abs().max().item()
        plaintext = bytes(caches["plain"].remote.transport.get([caches["plain"].remote.redis_key(
            caches["plain"].chunk_keys(model, ids)[0])])[0])
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, nonce = AESGCM(os.urandom(32)), os.urandom(12)
    sealed = aead.encrypt(nonce, plaintext, b"name")
    per_chunk = statistics.median(_time(lambda: aead.decrypt(nonce, sealed, b"name")) for _ in range(20))
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [{"config": name, "median_s": med[name], "min_s": min(times[name]), "max_s": max(times[name]),
             "vs_plain": med[name] / med["plain"], "stored_mb": stored_bytes[name] / 1e6,
             "gb_per_s": stored_bytes[name] / med[name] / 1e9, "max_logit_diff": diffs[name]} for name in CONFIGS]
    print(f"\n{args.tokens}-token remote hit on SmolLM2-135M fp32 (retrieve + a 35-token question's forward; memory "
          f"cleared before each; medians of {args.repeats}, configurations interleaved; load {os.getloadavg()[0]:.2f})")
    print("| configuration | hit (median) | range | vs plain | stored | GB/s | max logit diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['median_s'] * 1e3:.0f} ms | {r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f} | "
              f"{r['vs_plain']:.2f}x | {r['stored_mb']:.0f} MB | {r['gb_per_s']:.2f} | {r['max_logit_diff']:.1e} |")
    print(f"\nAES-256-GCM decrypt alone: {len(plaintext) / per_chunk / 1e9:.2f} GB/s "
          f"({len(plaintext) / 1e6:.1f} MB chunk, one thread)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_result(out_dir / "bench_encrypt.json", {"tokens": args.tokens, "repeats": args.repeats, "rows": rows,
                                                  "times": times,
                                                  "aes_gcm_decrypt_gbs": len(plaintext) / per_chunk / 1e9})
    print(f"\nwrote {out_dir / 'bench_encrypt.json'}")


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
