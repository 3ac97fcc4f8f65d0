"""How fast ``kvtc`` chunks decode on a CUDA device (kernels/kvtc.cu) against the host decoder on
the same machine: GB/s of fp16-equivalent KV out, on synthetic KV shaped like Qwen2.5-1.5B's (28 layers
x 2 KV heads x 128 by default; each plane a low-rank part plus noise, keys RoPE-rotated), calibrated
by ``kvtc.fit`` on rows disjoint from the decoded ones. Issue 28's GPU target: >= 50 GB/s. (A
7B-shaped plane of 1,024 channels takes ~7 s to calibrate here: the bit allocation's dynamic program
grows with the square of the channels.)

    python benchmarks/bench_gpu_kvtc.py --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kdn import _core, codecs, kvtc  # noqa: E402
from timing import samples, save_result  # noqa: E402

FP = b"G" * 16
CHUNK = 256


def planes(layers: int, channels: int, rows: int, rank: int, seed: int) -> list[np.ndarray]:
    """Rows of each of 2 * layers planes: a shared low-rank structure per plane plus noise."""
    g, mix = np.random.default_rng(seed), np.random.default_rng(0).normal(size=(2 * layers, rank, channels))
    return [(g.normal(size=(rows, rank)) @ mix[p] + 0.1 * g.normal(size=(rows, channels))).astype(np.float32)
            for p in range(2 * layers)]


def rotated(x: torch.Tensor, inv_freq: torch.Tensor, start: int) -> torch.Tensor:
    """Keys [1, heads, tokens, dim] turned post-RoPE (rotate-half) at positions start.."""
    angle = torch.arange(start, start + x.shape[2], dtype=torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def synced_upload(payload: torch.Tensor):
    def run():
        payload.to("cuda")
        torch.cuda.synchronize()
    return run


def timeline(fn) -> list[tuple[float, float, str]]:
    """(start ms, duration ms, name) of every host call and device activity the profiler records in
    one run of ``fn``, from the run's start: where a batched call's wall time goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profile:
        with torch.profiler.record_function("batched call"):
            fn()
    events = [(e.time_range.start, e.time_range.end, e.name) for e in profile.events()]
    start = min(t0 for t0, _, name in events if name == "batched call")
    return sorted(((t0 - start) / 1e3, (t1 - t0) / 1e3, name[:48]) for t0, t1, name in events if t0 >= start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096, help="decoded per repeat (chunks of 256)")
    parser.add_argument("--rank", type=int, default=64, help="rank of each plane's structure")
    parser.add_argument("--ratio", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeline", action="store_true", help="print where one batched call's time goes")
    parser.add_argument("--out", default="bench_out/gpu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_kvtc: no CUDA device")
    layers, heads, dim, n = args.layers, args.heads, args.dim, args.tokens
    channels = heads * dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    calibration = kvtc.fit(planes(layers, channels, 2048, args.rank, 1), FP, dim, inv_freq=inv_freq.numpy(),
                           ratios=(args.ratio,))
    kvtc.load(calibration)
    spec = f"kvtc:ratio={args.ratio}"
    rows = planes(layers, channels, n, args.rank, 2)  # pre-RoPE; keys rotated to what a model caches
    kv = [torch.from_numpy(r).view(1, n, heads, dim).transpose(1, 2).contiguous() for r in rows]
    kv = [rotated(t, inv_freq, 0) if p % 2 == 0 else t for p, t in enumerate(kv)]
    kv = [t.half() for t in kv]
    coded = []
    for start in range(0, n, CHUNK):
        blob = _core.pack_chunk(kv, start, CHUNK, FP, start.to_bytes(16, "little"))
        coded.append(codecs.encode(blob, spec))
    fp16_bytes = 2 * layers * 2 * n * channels
    shape = codecs.decode(coded[0]).shape
    outs = [torch.empty(shape, dtype=torch.float16, device="cuda") for _ in coded]
    stream = torch.cuda.current_stream().cuda_stream

    def one_by_one():
        for blob, out in zip(coded, outs):
            _core.codec_decode_cuda(blob, out, stream=stream)
        torch.cuda.synchronize()

    def batched():
        _core.codec_decode_cuda_many(coded, outs, stream=stream)
        torch.cuda.synchronize()

    one_by_one()
    single = samples(one_by_one, args.repeats)
    batched()
    gpu = samples(batched, args.repeats)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        batched()
    kernels = {e.key: getattr(e, "device_time_total", 0.0) / 1e3 for e in profile.key_averages()}
    kernels = {k: ms for k, ms in sorted(kernels.items(), key=lambda kv: -kv[1]) if ms > 0}
    if args.timeline:
        for at, took, name in timeline(batched):
            print(f"  {at:7.3f} ms +{took:6.3f} ms  {name}")
    # the host side of a batched call, in parts: the blobs' checksums (one thread), the same bytes'
    # pageable upload alone; the rest of wall - device time is parsing the planes
    checksums = samples(lambda: [_core.blob_parse(b, True) for b in coded], args.repeats)
    payload = torch.frombuffer(bytearray(b"".join(coded)), dtype=torch.uint8)
    upload = samples(synced_upload(payload), args.repeats)
    host = samples(lambda: [codecs.decode(b) for b in coded], max(3, args.repeats // 3))
    cpu_first = codecs.decode(coded[0])
    assert all(torch.equal(o.cpu(), codecs.decode(b)) for o, b in zip(outs, coded)), "CUDA decoder != CPU decoder"
    reference = torch.stack([torch.stack([kv[2 * li][0, :, :CHUNK], kv[2 * li + 1][0, :, :CHUNK]])
                             for li in range(layers)]).transpose(2, 3).float()  # [layers, 2, tokens, heads, dim]
    error = float((cpu_first.float() - reference).norm() / reference.norm())
    symbols = sum(codecs.encode(_core.pack_chunk(kv, s, CHUNK, FP, b"k" * 16), spec, report=True)[1]["symbols"]
                  for s in range(0, n, CHUNK))
    result = {"layers": layers, "kv_heads": heads, "head_dim": dim, "tokens": n, "rank": args.rank, "spec": spec,
              "fp16_bytes": fp16_bytes, "coded_bytes": sum(len(c) for c in coded),
              "gpu_s": statistics.median(gpu), "host_s": statistics.median(host),
              "gpu_one_by_one_s": statistics.median(single),
              "gpu_one_by_one_gb_per_s": fp16_bytes / statistics.median(single) / 1e9,
              "gpu_gb_per_s": fp16_bytes / statistics.median(gpu) / 1e9,
              "host_gb_per_s": fp16_bytes / statistics.median(host) / 1e9,
              "checksums_s": statistics.median(checksums), "pageable_upload_s": statistics.median(upload),
              "live_components_per_row": symbols / (2 * layers * (n - 4 * len(coded))), "rel_l2": error,
              "device_ms_by_kernel": kernels, "host_threads": os.cpu_count(),
              "device": torch.cuda.get_device_name()}
    print(f"{spec} on {layers} x {heads} x {dim} synthetic KV (rank {args.rank}), {n} tokens in chunks of {CHUNK}: "
          f"{fp16_bytes / result['coded_bytes']:.1f}x vs fp16, rel L2 {error:.3f}, "
          f"{result['live_components_per_row']:.0f} of {channels} components live per row")
    print(f"  CUDA decoder, all chunks in one launch pair: {1e3 * result['gpu_s']:.2f} ms, "
          f"{result['gpu_gb_per_s']:.1f} GB/s fp16-equivalent")
    print(f"  CUDA decoder, a call per chunk: {1e3 * result['gpu_one_by_one_s']:.2f} ms, "
          f"{result['gpu_one_by_one_gb_per_s']:.1f} GB/s")
    print("  on the device (one batched call):", ", ".join(f"{k[:40]} {ms:.2f} ms" for k, ms in kernels.items()))
    print(f"  host side, in parts: checksums {1e3 * result['checksums_s']:.2f} ms (one thread), the payloads' pageable "
          f"upload alone {1e3 * result['pageable_upload_s']:.2f} ms")
    print(f"  host decoder: {1e3 * result['host_s']:.1f} ms, {result['host_gb_per_s']:.2f} GB/s "
          f"({os.cpu_count()} CPUs)")
    print("saved", save_result(f"{args.out}/bench_gpu_kvtc.json", result))
    _core.kvtc_unload_all()


if __name__ == "__main__":
    main()
