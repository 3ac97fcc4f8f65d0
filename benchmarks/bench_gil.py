"""What kdn's background threads pay for the GIL while the serving engine's loop runs Python: a thread
that releases the GIL around a C++ call waits a switch interval (5 ms by default) to take it back
whenever another thread holds it, so a loop of short calls (one per chunk) costs ~5 ms a chunk.

An async load's paged copies, a GPU store's sealing and its filing all run on kdn's threads while
vLLM's engine loop spins in Python. Each row times one such job on a thread while the main thread
is idle, spins in Python (holds the GIL, as vLLM's loop does), or spins in C without the GIL (the
same CPU taken, no GIL held): the last two differ by the GIL's hand-backs alone. Jobs, one run
(Llama-3-8B-shaped bf16 KV on 8 layers, 256-token chunks, on the CPU):

  seal        the chunks of a span (what a GPU store's thread does): a ``pack_chunk`` call per chunk
              (before) against one ``pack_chunks`` call
  lay         chunks into paged blocks (what a GPU load's copies do, here on the CPU twin): a
              ``paged_copy_cpu`` call per chunk (before) against one ``paged_copy_chunks_cpu`` call
  file        sealed chunks into a memory tier (``Engine.save``; the tier keeps the GIL in ``put``)

    python benchmarks/bench_gil.py --out benchmarks/results/gil
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kdn import _core
from kdn.engine.paged import PagedLayout
from kdn.storage.memory import MemoryTier
from timing import save_result

LAYERS, HEADS, DIM, CHUNK, BLOCK = 8, 8, 128, 256, 16
FINGERPRINT = bytes(16)
MODES = ("idle", "python", "c")


def on_a_thread(job, mode: str) -> float:
    """Seconds ``job`` takes on a thread while this (the main) thread does ``mode``."""
    stop, took = threading.Event(), []

    def spin() -> None:
        if mode == "python":
            while not stop.is_set():
                pass
        else:  # sha256 of a large buffer releases the GIL: a busy CPU that leaves the GIL free
            data = b"x" * (1 << 20)
            while not stop.is_set():
                hashlib.sha256(data).digest()

    spinner = threading.Thread(target=spin) if mode != "idle" else None
    if spinner:
        spinner.start()
        time.sleep(0.02)

    def run() -> None:
        t0 = time.perf_counter()
        job()
        took.append(time.perf_counter() - t0)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    stop.set()
    if spinner:
        spinner.join()
    return took[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_out/gil")
    args = parser.parse_args()
    n = args.tokens // CHUNK * CHUNK
    kv = [torch.randn(1, HEADS, n, DIM).to(torch.bfloat16) for _ in range(2 * LAYERS)]
    todo = [(s, CHUNK, s.to_bytes(16, "little")) for s in range(0, n, CHUNK)]
    blobs = _core.pack_chunks(kv, todo, FINGERPRINT)
    chunks = [torch.stack([torch.stack([kv[2 * i][0, :, s:s + CHUNK].transpose(0, 1),
                                        kv[2 * i + 1][0, :, s:s + CHUNK].transpose(0, 1)]) for i in range(LAYERS)])
              .contiguous() for s in range(0, n, CHUNK)]
    blocks = [torch.zeros(n // BLOCK + 1, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    layout = PagedLayout.packed(blocks[0]).as_dict()
    ids = np.arange(1, n // BLOCK + 1, dtype=np.int64)
    copies = [(c, 0, i * CHUNK, CHUNK) for i, c in enumerate(chunks)]

    def file() -> None:
        tier = MemoryTier(1 << 40)
        for (_, _, key), blob in zip(todo, blobs):
            tier.put(key, blob)

    jobs = {
        "seal, a call per chunk": lambda: [_core.pack_chunk(kv, s, c, FINGERPRINT, k) for s, c, k in todo],
        "seal, one call": lambda: _core.pack_chunks(kv, todo, FINGERPRINT),
        "lay, a call per chunk": lambda: [_core.paged_copy_cpu(blocks, ids, *copy, False, layout=layout)
                                          for copy in copies],
        "lay, one call": lambda: _core.paged_copy_chunks_cpu(blocks, ids, copies, False, layout=layout),
        "file": file,
    }
    seconds = {job: {mode: [] for mode in MODES} for job in jobs}
    for _ in range(args.rounds):  # rounds alternate every job and mode: the machine's drift hits all alike
        for job, fn in jobs.items():
            for mode in MODES:
                seconds[job][mode].append(on_a_thread(fn, mode))
    print(f"{len(todo)} chunks ({n} tokens, {sum(len(b) for b in blobs) / 1e6:.0f} MB), switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms; median of {args.rounds} rounds [range]", flush=True)
    rows = {}
    for job, by_mode in seconds.items():
        med = {mode: statistics.median(v) for mode, v in by_mode.items()}
        rows[job] = {"seconds": by_mode, "median": med, "gil_handbacks_s": med["python"] - med["c"],
                     "python_over_c": med["python"] / med["c"]}
        print(f"{job:<24} " + "  ".join(f"{mode} {1e3 * med[mode]:7.1f} ms [{1e3 * min(by_mode[mode]):.0f}-"
                                        f"{1e3 * max(by_mode[mode]):.0f}]" for mode in MODES)
              + f"   Python-spin / C-spin {med['python'] / med['c']:.2f}x", flush=True)
    for job in ("seal", "lay"):
        before, after = rows[f"{job}, a call per chunk"]["median"], rows[f"{job}, one call"]["median"]
        print(f"{job}: one call vs a call per chunk while the loop runs Python: "
              f"{before['python'] / after['python']:.2f}x faster", flush=True)
    record = {"tokens": n, "chunks": len(todo), "switch_interval_s": sys.getswitchinterval(), "rows": rows}
    print(f"wrote {save_result(Path(args.out) / 'bench_gil.json', record)}")


if __name__ == "__main__":
    main()
