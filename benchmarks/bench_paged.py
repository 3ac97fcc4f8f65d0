"""Laying a stored prefix into vLLM's paged CPU KV blocks (kdn/paged.h) against laying it into HF's
per-layer tensors, for SmolLM2-135M-shaped fp32 KV (30 layers, 3 KV heads, head dim 64), and into
and out of every other engine layout kdn describes by strides (kdn.engine.paged: vLLM's GPU packed
layout in both stride orders, the two older shapes; CPU tensors here); a prompt's chunks sealed for
storing out of the blocks, gathered into one tensor then packed (the vLLM connector before issue 50)
against packed straight from the blocks (after), wall and CPU seconds; and the model fingerprint
from a checkpoint's files against the loaded model's.

    python benchmarks/bench_paged.py --out benchmarks/results/paged
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from kdn import KDN, KDNConfig, _core
from kdn.engine.paged import PagedLayout, vllm_layout
from kdn.engine.targets import PagedBlocks
from kdn.keys import checkpoint_fingerprint, model_fingerprint
from kdn.models.tiny import tiny_model
from timing import save_result, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out/paged")
    args = parser.parse_args()
    n = args.tokens
    model = tiny_model("llama", layers=30, heads=9, kv_heads=3, head_dim=64, vocab_size=512)
    kdn = KDN(KDNConfig(chunk_size=256))
    session = kdn.session(model)
    tokens = session.tokens(torch.randint(3, 512, (1, n)))
    kdn.engine.save(session, tokens, [torch.randn(1, 3, n, 64) for _ in range(60)])
    blobs = [kdn.memory.get(key) for key in session.prefix_keys(tokens)]
    hf = [torch.empty(1, 3, n, 64) for _ in range(60)]
    blocks = [torch.zeros(-(-n // 128) + 8, 3, 128, 128) for _ in range(30)]
    block_ids = np.arange(-(-n // 128), dtype=np.int64)[::-1].copy()  # a request's blocks, out of order
    hf_s = timed(lambda: _core.unpack_chunks(blobs, hf, n), args.repeats)
    paged_s = timed(lambda: _core.unpack_chunks_paged(blobs, blocks, block_ids, 0, n), args.repeats)
    out = torch.empty(30, 2, n, 3, 64)
    gather_s = timed(lambda: _core.gather_paged(blocks, block_ids, out), args.repeats)
    source = PagedBlocks(blocks, vllm_layout(blocks[0], "vec"), block_ids)
    chunks = [(start, min(256, n - start), key) for start, key in zip(range(0, n, 256), session.prefix_keys(tokens))]

    def gather_then_pack():
        _, kv = source.emit(0, n)
        return [_core.pack_chunk(kv, start, count, session.fingerprint, key) for start, count, key in chunks]

    stores = {name: {"wall_ms": 1e3 * timed(fn, args.repeats),
                     "cpu_ms": 1e3 * timed(fn, args.repeats, clock=time.process_time)}
              for name, fn in (("gather then pack", gather_then_pack),
                               ("pack from the blocks", lambda: source.pack(chunks, session.fingerprint)))}
    layouts = {}
    pool = -(-n // 128) + 8
    for name, layers, describe in (
            ("packed, HND order", [torch.zeros(pool, 3, 128, 128) for _ in range(30)], PagedLayout.packed),
            ("packed, NHD order", [torch.zeros(pool, 128, 3, 128).permute(0, 2, 1, 3) for _ in range(30)],
             PagedLayout.packed),
            ("(2, blocks, block, heads, dim)", [torch.zeros(2, pool, 128, 3, 64) for _ in range(30)],
             PagedLayout.kv_first),
            ("(blocks, 2, block, heads, dim)", [torch.zeros(pool, 2, 128, 3, 64) for _ in range(30)],
             PagedLayout.blocks_first)):
        layout = describe(layers[0]).as_dict()
        layouts[name] = {
            "unpack_ms": 1e3 * timed(lambda: _core.unpack_chunks_paged(blobs, layers, block_ids, 0, n, layout=layout),
                                     args.repeats),
            "gather_ms": 1e3 * timed(lambda: _core.gather_paged(layers, block_ids, out, layout=layout), args.repeats)}
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        files_s = timed(lambda: checkpoint_fingerprint(folder, torch.float32), args.repeats)
        loaded_s = timed(lambda: model_fingerprint(model, refresh=True), args.repeats)
    mib = n * 30 * 2 * 3 * 64 * 4 / 2**20
    print(f"{n} tokens, {mib:.0f} MiB of KV: into HF tensors {hf_s * 1e3:.1f} ms, into vLLM's paged blocks "
          f"{paged_s * 1e3:.1f} ms, out of them {gather_s * 1e3:.1f} ms")
    for name, t in layouts.items():
        print(f"  layout {name}: in {t['unpack_ms']:.1f} ms, out {t['gather_ms']:.1f} ms")
    for name, t in stores.items():
        print(f"  its chunks sealed for a store, {name}: {t['wall_ms']:.1f} ms ({t['cpu_ms']:.1f} ms of CPU)")
    print(f"fingerprint of a {sum(p.numel() for p in model.parameters()) * 4 / 2**20:.0f} MiB model: from its "
          f"checkpoint files {files_s * 1e3:.0f} ms, from the loaded model {loaded_s * 1e3:.0f} ms")
    print("saved", save_result(f"{args.out}/bench_paged.json", {
        "tokens": n, "kv_mib": mib, "unpack_hf_ms": hf_s * 1e3, "unpack_paged_ms": paged_s * 1e3,
        "gather_paged_ms": gather_s * 1e3, "layouts": layouts, "store_packing": stores,
        "fingerprint_files_ms": files_s * 1e3,
        "fingerprint_loaded_ms": loaded_s * 1e3}))


if __name__ == "__main__":
    main()
