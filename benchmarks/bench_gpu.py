"""Retrieve onto a CUDA device: chunks decoded and laid out on the GPU (kdn's path for a model on a
GPU) against decoding on the host then copying (the path before it), per codec and context length.

A SmolLM2-135M-shaped model (30 layers, 9 heads, 3 KV heads, head dim 64) with random weights: the
KV bytes and the work are those of SmolLM2, the values do not matter for timing.

    python benchmarks/bench_gpu.py --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse

import torch

from kdn import KDN, KDNConfig, codecs
from kdn.engine import HFTarget
from kdn.models.tiny import tiny_model
from timing import save_result, timed


def synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--codecs", default="raw,lossless,int4,cachegen")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out/gpu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device")
    dtype = getattr(torch, args.dtype)
    model = tiny_model("llama", layers=30, heads=9, kv_heads=3, head_dim=64, vocab_size=512, dtype=dtype).to("cuda")
    rows = []
    for n in map(int, args.lengths.split(",")):
        ids = torch.randint(3, 512, (1, n), device="cuda")
        with torch.inference_mode():
            prefill_s = timed(synced(lambda: model(ids, use_cache=True)), args.repeats)
            cache = model(ids, use_cache=True).past_key_values
        for spec in args.codecs.split(","):
            lossy = codecs.parse(spec).lossy
            kdn = KDN(KDNConfig(chunk_size=256, memory_codec=spec, accept_codecs=(spec,) if lossy else ()))
            kdn.store(model, ids, cache)
            session = kdn.session(model)
            tokens = session.tokens(ids)
            def host_then_copy():
                return [t.to("cuda") for t in kdn.engine.load(session, tokens, n, HFTarget("cpu")).result]

            host = timed(synced(host_then_copy), args.repeats)
            device = timed(synced(lambda: kdn.engine.load(session, tokens, n, HFTarget("cuda")).result), args.repeats)
            kv_mb = session.layout.bytes_per_token() * n / 2**20
            rows.append({"tokens": n, "codec": spec, "kv_MiB": round(kv_mb, 1), "prefill_ms": prefill_s * 1e3,
                         "host_then_copy_ms": host * 1e3, "on_device_ms": device * 1e3,
                         "speedup": host / device})
            print(f"{n:6d} {spec:10s} KV {kv_mb:7.1f} MiB  prefill {prefill_s * 1e3:8.2f} ms  host+copy "
                  f"{host * 1e3:8.2f} ms  on device {device * 1e3:8.2f} ms  x{host / device:5.2f}", flush=True)
    out = save_result(f"{args.out}/bench_gpu.json", {"device": torch.cuda.get_device_name(0), "dtype": args.dtype,
                                                     "rows": rows})
    print("saved", out)


if __name__ == "__main__":
    main()
