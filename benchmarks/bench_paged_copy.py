"""The copy a vLLM hit pays on the CPU: 4K tokens of SmolLM2-shaped bf16 KV laid into vLLM's 'vec' and
'amx' blocks and gathered back (``_core.paged_copy_cpu``), beside a plain copy of the same bytes
(torch ``copy_``), interleaved in one process; best of --repeats each.

    python benchmarks/bench_paged_copy.py --out benchmarks/results/paged_copy
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kdn import _core  # noqa: E402
from kdn.engine.paged import vllm_layout  # noqa: E402
from timing import save_result  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench_out/paged_copy")
    args = parser.parse_args()
    layers, heads, dim, block = 30, 3, 64, 32  # SmolLM2-135M; blocks of 32 (what 'amx' needs)
    pool = args.tokens // block + 4
    ids = np.random.default_rng(0).permutation(pool)[: args.tokens // block].astype(np.int64)
    chunk = torch.randn(layers, 2, args.tokens, heads, dim).bfloat16()
    plain = torch.empty_like(chunk)
    rows = {"copy_": {"into_s": best(lambda: plain.copy_(chunk), args.repeats)}}
    for kernel in ("vec", "amx"):
        blocks = [torch.zeros(pool, heads, block, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
        layout = vllm_layout(blocks[0], kernel).as_dict()
        back = torch.empty_like(chunk)
        rows[kernel] = {
            "into_s": best(lambda: _core.paged_copy_cpu(blocks, ids, chunk, 0, 0, args.tokens, False, layout=layout),
                           args.repeats),
            "out_s": best(lambda: _core.paged_copy_cpu(blocks, ids, back, 0, 0, args.tokens, True, layout=layout),
                          args.repeats)}
        assert torch.equal(back, chunk), kernel
    mb = chunk.numel() * chunk.element_size() / 1e6
    for name, row in rows.items():
        row["gb_per_s_into"] = mb / row["into_s"] / 1e3
        print(f"{name:>6}: into {row['into_s'] * 1e3:6.1f} ms ({row['gb_per_s_into']:.2f} GB/s)"
              + (f", out {row['out_s'] * 1e3:6.1f} ms" if "out_s" in row else ""))
    print(f"wrote {save_result(Path(args.out) / 'bench_paged_copy.json', {'megabytes': mb, 'rows': rows})}")


if __name__ == "__main__":
    main()
