"""Paged copies on a CUDA device (kernels/paged.cu): a 7B-shaped KV chunk (32 layers x 8 KV heads x
head dim 128, fp16, 4K tokens by default, random values) laid into vLLM's GPU blocks and gathered
back, in each layout kdn describes by strides, against the device's own copy bandwidth (a
``torch`` copy of the same bytes in the same run). Issue 24's target: >= 50% of that bandwidth.

    python benchmarks/bench_gpu_paged.py --out benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import torch

from kdn import _core
from kdn.engine.paged import PagedLayout
from timing import save_result, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench_out/gpu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_paged: no CUDA device")
    layers, heads, dim, n, size = 32, 8, 128, args.tokens, args.block_size
    blocks = 2 * (-(-n // size))
    ids = np.random.default_rng(0).permutation(blocks)[: -(-n // size)].astype(np.int64)  # scattered blocks
    chunk = torch.randn(layers, 2, n, heads, dim, dtype=torch.float16, device="cuda")
    moved = 2 * chunk.numel() * chunk.element_size()  # each copy reads and writes the KV once
    stream = torch.cuda.current_stream().cuda_stream

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    def on_device(fn) -> float:
        """Median seconds the GPU spent in fn's kernels (the profiler's device time, no host overhead)."""
        times = []
        for _ in range(5):
            with warnings.catch_warnings(), torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                warnings.simplefilter("ignore")
                fn()
            times.append(sum(getattr(e, "device_time_total", 0.0) for e in profile.key_averages()) / 1e6)
        return float(np.median(times))

    other = torch.empty_like(chunk)
    copy_s = timed(synced(lambda: other.copy_(chunk)), args.repeats)
    copy_kernel_s = on_device(synced(lambda: other.copy_(chunk)))
    rows = {"device copy": {"seconds": copy_s, "gb_per_s": moved / copy_s / 1e9,
                            "kernel_gb_per_s": moved / copy_kernel_s / 1e9}}
    shapes = {
        "packed HND [blocks, heads, block, K||V]":
            lambda: [torch.zeros(blocks, heads, size, 2 * dim, dtype=torch.float16, device="cuda")
                     for _ in range(layers)],
        "packed NHD (blocks, block, heads, K||V) viewed":
            lambda: [torch.zeros(blocks, size, heads, 2 * dim, dtype=torch.float16, device="cuda").permute(0, 2, 1, 3)
                     for _ in range(layers)],
        "(2, blocks, block, heads, dim)":
            lambda: [torch.zeros(2, blocks, size, heads, dim, dtype=torch.float16, device="cuda")
                     for _ in range(layers)],
    }
    describe = {0: PagedLayout.packed, 1: PagedLayout.packed, 2: PagedLayout.kv_first}
    for i, (name, make) in enumerate(shapes.items()):
        paged = make()
        layout = describe[i](paged[0]).as_dict()
        into = timed(synced(lambda: _core.paged_copy_cuda(paged, ids, chunk, 0, 0, n, False, layout=layout,
                                                          stream=stream)), args.repeats)
        out = timed(synced(lambda: _core.paged_copy_cuda(paged, ids, other, 0, 0, n, True, layout=layout,
                                                         stream=stream)), args.repeats)
        into_kernel = on_device(synced(lambda: _core.paged_copy_cuda(paged, ids, chunk, 0, 0, n, False,
                                                                     layout=layout, stream=stream)))
        out_kernel = on_device(synced(lambda: _core.paged_copy_cuda(paged, ids, other, 0, 0, n, True,
                                                                    layout=layout, stream=stream)))
        assert torch.equal(other, chunk)
        rows[name] = {"into_s": into, "out_s": out, "into_gb_per_s": moved / into / 1e9,
                      "out_gb_per_s": moved / out / 1e9,
                      "into_vs_device_copy": copy_s / into, "out_vs_device_copy": copy_s / out,
                      "kernel_into_gb_per_s": moved / into_kernel / 1e9,
                      "kernel_out_gb_per_s": moved / out_kernel / 1e9,
                      "kernel_into_vs_device_copy": copy_kernel_s / into_kernel,
                      "kernel_out_vs_device_copy": copy_kernel_s / out_kernel}
    print(f"{n} tokens, {chunk.numel() * 2 / 2**20:.0f} MiB of fp16 KV (32 x 8 x 128), blocks of {size}")
    for name, r in rows.items():
        if "gb_per_s" in r:
            print(f"  {name}: {r['gb_per_s']:.0f} GB/s a call, {r['kernel_gb_per_s']:.0f} GB/s on the device")
        else:
            print(f"  {name}: a call (host and launch included): in {r['into_gb_per_s']:.0f} GB/s "
                  f"({r['into_vs_device_copy']:.0%} of the device copy), out {r['out_gb_per_s']:.0f} GB/s "
                  f"({r['out_vs_device_copy']:.0%}); kernel alone: in {r['kernel_into_gb_per_s']:.0f} GB/s "
                  f"({r['kernel_into_vs_device_copy']:.0%}), out {r['kernel_out_gb_per_s']:.0f} GB/s "
                  f"({r['kernel_out_vs_device_copy']:.0%})")
    print("saved", save_result(f"{args.out}/bench_gpu_paged.json", {"tokens": n, "block_size": size, "rows": rows}))


if __name__ == "__main__":
    main()
