"""How fast ``kvtc`` chunks decode on the CPU: GB/s of fp16-equivalent KV out of
``_core.unpack_chunks`` (the CPU read path: coded chunks -> per-layer tensors), with ``int4`` beside
it, and the reconstruction's bound: MKL's sgemm (torch, one thread per core kdn uses) on the same
dense products (per plane: 256 rows x the live components, from the coder's report, x channels),
and the same products in bf16 (oneDNN's AVX512-BF16 dot products where the CPU has them): what a
reconstruction from a bf16 basis could reach.

kdn's reconstruction is its own blocked AVX2 microkernel, not a BLAS call: the CUDA decoder must
give the same bits, which needs every output summed over components in ascending order with one
fused multiply-add per step; a BLAS does not promise a summation order.

    python benchmarks/bench_kvtc.py --model smollm2-135m --tokens 1024 --out benchmarks/results/kvtc
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kdn  # noqa: E402
from kdn import _core, codecs, kvtc  # noqa: E402
from kdn.engine.layout import empty_kv_list  # noqa: E402
from timing import samples, save_result  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "README.md"


def seconds(fn, repeats: int) -> list[float]:
    fn()  # warm: tables, pages
    return samples(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1024, help="decoded per repeat (chunks of 256)")
    parser.add_argument("--ratio", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="bench_out/kvtc")
    args = parser.parse_args()
    model, tokenizer = kdn.models.load(args.model)
    ids = tokenizer(TEXT.read_text() * 4, return_tensors="pt").input_ids
    calibration, context = ids[0, :1024].tolist(), ids[:, 1024:1024 + args.tokens]
    kvtc.load(kvtc.calibrate(model, [calibration[:512], calibration[512:]], progress=False))
    cache = kdn.KDN(kdn.KDNConfig(chunk_size=256))
    with torch.inference_mode():
        cache.store(model, context, model(context, use_cache=True).past_key_values)
    blobs = [cache.memory.get(k) for k in cache.chunk_keys(model, context)]
    session = cache.session(model)
    n = len(blobs) * 256
    layout = session.layout
    fp16_bytes = 2 * layout.layers * 2 * n * layout.kv_heads * layout.head_dim
    rows = {}
    kvtc_spec = f"kvtc:ratio={args.ratio}"
    for spec in ("int4", kvtc_spec):
        coded = [codecs.encode(b, spec) for b in blobs]
        kv = empty_kv_list(layout, n)
        times = seconds(lambda coded=coded, kv=kv: _core.unpack_chunks(coded, kv, n), args.repeats)
        reference = codecs.decode(blobs[0]).float()
        error = (codecs.decode(coded[0]).float() - reference).norm() / reference.norm()
        rows[spec] = {"gb_per_s": fp16_bytes / statistics.median(times) / 1e9,
                      "gb_per_s_best": fp16_bytes / min(times) / 1e9, "ms": 1e3 * statistics.median(times),
                      "ratio_vs_fp16": fp16_bytes / len(blobs) / statistics.mean(len(c) for c in coded),
                      "rel_l2": float(error)}
    # the bound of the reconstruction: the same dense products through MKL, one thread per core used
    channels = layout.kv_heads * layout.head_dim
    planes = len(blobs) * layout.layers * 2
    symbols = sum(codecs.encode(b, kvtc_spec, report=True)[1]["symbols"] for b in blobs)
    coded_rows = (n - 4) * layout.layers * 2  # every token but the 4 exact sinks, in every plane
    live = symbols / coded_rows  # entropy-coded components per row (the all-zero ones are left out)
    components = round(live)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, os.cpu_count() or 1))
    a, b = torch.randn(256, components), torch.randn(components, channels)
    gemm = statistics.median(seconds(lambda: [torch.mm(a, b) for _ in range(planes)], 5))
    a16, b16 = a.bfloat16(), b.bfloat16()
    gemm_bf16 = statistics.median(seconds(lambda: [torch.mm(a16, b16) for _ in range(planes)], 5))
    torch.set_num_threads(threads)
    result = {"model": args.model, "tokens": n, "fp16_bytes": fp16_bytes, "codecs": rows, "kvtc_symbols": symbols,
              "live_components_per_row": live, "channels": channels,
              "mkl_sgemm_ms_all_planes": 1e3 * gemm,
              "bf16_gemm_ms_all_planes": 1e3 * gemm_bf16, "mkl_shape": [256, components, channels], "planes": planes,
              "load_average": os.getloadavg()}
    for spec, row in rows.items():
        print(f"{spec:14s} {row['gb_per_s']:.3f} GB/s fp16-equivalent (best {row['gb_per_s_best']:.3f}), "
              f"{row['ms']:.1f} ms for {n} tokens, {row['ratio_vs_fp16']:.2f}x vs fp16, rel L2 {row['rel_l2']:.3f}")
    print(f"{kvtc_spec}: {symbols / 1e6:.2f} M symbols, {live:.1f} of {channels} components live per row")
    print(f"MKL sgemm on {planes} planes of 256x{components}x{channels} (the live components): {1e3 * gemm:.1f} ms "
          f"({torch.get_num_threads()} threads); in bf16 {1e3 * gemm_bf16:.1f} ms ({gemm / gemm_bf16:.2f}x); "
          f"load average {os.getloadavg()[0]:.2f}")
    print("wrote", save_result(Path(args.out) / "bench_kvtc.json", result))


if __name__ == "__main__":
    main()
