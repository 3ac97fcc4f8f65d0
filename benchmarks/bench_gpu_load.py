"""What a kdn hit costs on the host and the link before vLLM's GPU forward can use it, step by step,
at a Llama-3-8B shape (32 layers x 8 KV heads x head dim 128, bf16, raw chunks of 256 tokens, as
a memory tier holds them), beside the device's own host-to-device copies of the same bytes, all in
one run: the breakdown of the 8B TTFT in ``results/gpu/VLLM.md``.

Rows (median seconds over ``--repeats``, each ended by a device synchronize): a pageable and a
pinned ``torch`` host-to-device copy of the KV's bytes; the chunks decoded on the host into pinned
memory (``_core.decode_chunks``); a whole load into vLLM's packed GPU blocks (``PagedBlocks.receive``:
staging, copy, paged copy), cold (its first: the pinned staging is allocated) and warm; the same
blobs copied into the buffer pool's page-locked blocks (what a CUDA engine's tiers hold: the
locking's cost), on 4 KiB and on huge pages, their DMAs alone and whole loads from there (one DMA
per chunk, no host copy; also on a thread while the main thread is idle or spins in Python, as an
async load runs beside vLLM's engine loop), and the paged copies alone (one call; a call per chunk
before; each also on a thread beside a Python loop); int8 and int4 chunks
(decoded by the CUDA decoder; GB/s of the KV they decode to), their coded bytes' DMA alone, and the
link speed below which each beats the raw page-locked hit (:func:`coded_wins_below`); a disk hit
(its reads alone and its whole load) with the pool's idle cap at 1 GiB and holding one hit, by 4
and by 16 reader threads; a layer-wise
load (each layer group a new list of the same chunks, as the stream hands them; its device decodes
counted); a store's gather of the last chunk (a served prompt's new tail) and of the whole prompt.

    python benchmarks/bench_gpu_load.py --out benchmarks/results/gpu
    python benchmarks/bench_gpu_load.py --device cpu --tokens 1024 --out /tmp/rehearsal   # the CPU paths
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench_gil import on_a_thread
from kdn import _core, codecs
from kdn.engine.paged import vllm_layout
from kdn.engine.targets import PagedBlocks
from timing import save_result, timed

LAYERS, HEADS, DIM, CHUNK, BLOCK = 32, 8, 128, 256, 16
FINGERPRINT = bytes(16)


def coded_wins_below(raw_s: float, raw_dma_s: float, raw_bytes: int, coded_s: float, coded_dma_s: float,
                     coded_bytes: int) -> float:
    """The link speed (GB/s) below which a coded hit is faster than the raw one, from one run's whole
    loads and their DMAs alone: each load is its DMA (bytes / link) plus what does not scale with the
    link (decode, paged copies, host work: its time less its DMA's), DMA and the rest in series as the
    load runs them; ``inf`` where the coded load's fixed part is no larger (it wins on every link).

    Example:
        >>> round(coded_wins_below(0.080, 0.040, 2_000_000_000, 0.070, 0.020, 1_000_000_000), 1)
        100.0
    """
    fixed_raw, fixed_coded = raw_s - raw_dma_s, coded_s - coded_dma_s
    if fixed_coded <= fixed_raw:
        return float("inf")
    return (raw_bytes - coded_bytes) / (fixed_coded - fixed_raw) / 1e9


def crossover(rows: dict, spec: str, raw_bytes: int, coded_bytes: int) -> None:
    """Print and keep (``coded_wins_below_gb_s`` in the coded load's row) the link speed below which
    ``spec``'s hit beats the raw page-locked one, from this run's rows; nothing where a row is missing."""
    names = ("whole load into the blocks, page-locked raw chunks (huge pages)", "  their DMAs alone (huge pages)",
             f"whole load into the blocks, {spec} chunks", f"  their DMA alone ({spec}, pinned)",
             "torch copy, pinned host -> device")
    if not all(name in rows for name in names):
        return
    raw, raw_dma, coded, coded_dma, link = (rows[name]["seconds"] for name in names)
    wins = coded_wins_below(raw, raw_dma, raw_bytes, coded, coded_dma, coded_bytes)
    rows[names[2]]["coded_wins_below_gb_s"] = wins
    print(f"  the {spec} hit beats the raw hit on links slower than "
          f"{'any' if wins == float('inf') else f'{wins:.1f} GB/s'} (this link: {raw_bytes / link / 1e9:.1f} GB/s)",
          flush=True)


def disk_hits(args, blobs: list, layers: list, layout, ids: list, synced, row) -> None:
    """A disk hit's reads (a warm page cache) and its whole load into the blocks: with the buffer
    pool's idle cap at its default 1 GiB and holding one hit (what a CUDA engine now keeps:
    ``kdn.engine.host_pool``; under the default, a hit larger than the cap has the rest of its blocks
    made, and page-locked on a device, afresh at every hit), by the tier's default 4 reader threads and
    by 16 (an 8B disk hit in a new engine read at 2.4-3.2 GB/s at every length on the H200 machine,
    VLLM.md)."""
    import shutil
    import tempfile

    from kdn.engine.host_pool import idle_cap_for
    from kdn.storage.disk import DiskTier

    folder = tempfile.mkdtemp(prefix="kdn-bench-disk-")
    try:
        writer = DiskTier(folder, 1 << 40, fsync=False)
        keys = [_core.blob_parse(b, verify_checksum=False)["key"] for b in blobs]  # each file under its own key
        for key, blob in zip(keys, blobs):
            writer.put(key, blob, wait=True)
        hit = sum(len(b) for b in blobs)
        limit = _core.buffer_pool_stats()["limit_bytes"]
        for name, cap, threads in (("the pool's idle cap 1 GiB, 4 readers", 1 << 30, 4),
                                   ("the cap holding one hit, 4 readers", idle_cap_for(hit), 4),
                                   ("the cap holding one hit, 16 readers", idle_cap_for(hit), 16)):
            tier = DiskTier(folder, 1 << 40, fsync=False, read_threads=threads)

            def load(tier=tier) -> None:
                PagedBlocks(layers, layout, ids).receive(None, tier.get_many(keys), args.tokens)

            _core.buffer_pool_trim()
            _core.buffer_pool_set_limit(cap)  # idle_cap_for: what a CUDA engine sets (locking on already)
            synced(load)()  # its first: the blocks made
            row(f"disk hit, reads alone, {name}", timed(lambda tier=tier: tier.get_many(keys), args.repeats),
                pool=_core.buffer_pool_stats())  # the blobs freed at once: their blocks back to the pool
            row(f"disk hit, whole load into the blocks, {name}", timed(synced(load), args.repeats))
        _core.buffer_pool_set_limit(limit)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer-group", type=int, default=3)
    parser.add_argument("--codecs", default="int8,int4", help="coded chunks' whole loads too ('' for none)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default="bench_out/gpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_load: no CUDA device")
    nbytes = 2 * LAYERS * HEADS * DIM * args.tokens * 2
    info = {"tokens": args.tokens, "bytes": nbytes, "shape": [LAYERS, HEADS, DIM], "dtype": "bfloat16",
            "device": args.device}
    if args.device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
    rows: dict[str, dict] = {}
    # a device call is one try: the rows measured before a failure, or before .ci/gpu's `timeout`
    # stops the run (SIGTERM), are kept, with what stopped it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_gpu_load: stopped (SIGTERM)"))
    try:
        measure(args, rows)
    except BaseException as e:
        info["error"] = repr(e)
        raise
    finally:
        print(f"wrote {save_result(Path(args.out) / 'bench_gpu_load.json', {**info, 'rows': rows})}")


def measure(args, rows: dict[str, dict]) -> None:
    """Every row of the module docstring into ``rows``, in order, each printed as it is measured."""
    n, device = args.tokens, torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(1, HEADS, n, DIM, generator=gen).to(torch.bfloat16) for _ in range(2 * LAYERS)]
    blobs = [_core.pack_chunk(kv, s, min(CHUNK, n - s), FINGERPRINT, s.to_bytes(16, "little"))
             for s in range(0, n, CHUNK)]
    nbytes = 2 * LAYERS * HEADS * DIM * n * 2
    del kv
    num_blocks = -(-n // BLOCK)
    # vLLM's FLASH_ATTN blocks as connectors get them: [blocks, heads, block, K||V]
    layers = [torch.zeros(num_blocks + 1, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16, device=device)
              for _ in range(LAYERS)]
    layout = vllm_layout(layers[0], "gpu")
    ids = list(np.random.default_rng(0).permutation(num_blocks + 1)[:num_blocks])

    def synced(fn):
        def run():
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    def row(name: str, seconds: float, moved: int = nbytes, **extra) -> None:
        rows[name] = {"seconds": seconds, "gb_per_s": moved / seconds / 1e9, **extra}
        print(f"{name:<44} {seconds * 1e3:9.1f} ms  {moved / seconds / 1e9:7.2f} GB/s", flush=True)

    if device.type == "cuda":
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        row("torch copy, pageable host -> device", timed(synced(lambda: on_device.copy_(pageable)), args.repeats))
        row("torch copy, pinned host -> device", timed(synced(lambda: on_device.copy_(pinned, non_blocking=True)),
                                                      args.repeats))
        del pageable, on_device
        staged = pinned.view(torch.bfloat16)
    else:
        staged = torch.empty(nbytes // 2, dtype=torch.bfloat16)
    where = "pinned host" if device.type == "cuda" else "host"
    row(f"decode_chunks, raw chunks -> {where}", timed(lambda: _core.decode_chunks(blobs, staged), args.repeats))
    staged = None  # freed (the lambda above holds the name)

    def receive() -> None:
        PagedBlocks(layers, layout, ids).receive(None, blobs, n)

    t0 = time.perf_counter()
    synced(receive)()
    row("whole load into the blocks, first", time.perf_counter() - t0)
    row("whole load into the blocks, warm", timed(synced(receive), args.repeats))
    if device.type == "cuda":  # what a CUDA engine's tiers hold (pin_host_memory): blobs in page-locked blocks
        _core.buffer_pool_lock_pages(True)
        slab = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.current_stream().cuda_stream
        for pages, huge in (("4 KiB", False), ("huge", True)):  # the pool's blocks on either kind of page
            _core.buffer_pool_huge_pages(huge)
            t0 = time.perf_counter()
            locked = [_core.buffer_join([b]) for b in blobs]  # a copy each, into blocks locked as they are handed out
            row(f"blobs copied into page-locked pool blocks ({pages} pages)", time.perf_counter() - t0,
                locked=sum(_core.host_memory_locked(b) for b in locked), pool=_core.buffer_pool_stats())
            row(f"  their DMAs alone ({pages} pages)",
                timed(synced(lambda: _core.upload_raw_chunks_cuda(locked, slab, stream)), args.repeats))

            def receive_locked() -> None:
                PagedBlocks(layers, layout, ids).receive(None, locked, n)

            synced(receive_locked)()
            row(f"whole load into the blocks, page-locked raw chunks ({pages} pages)",
                timed(synced(receive_locked), args.repeats))
            if huge:  # an async load: on kdn's thread while vLLM's engine loop runs Python (bench_gil.py)
                for mode in ("idle", "python"):
                    row(f"  the same on a thread, the main thread {'spinning in Python' if mode == 'python' else mode}",
                        statistics.median(on_a_thread(synced(receive_locked), mode) for _ in range(args.repeats)))
            del locked
        chunks = list(slab.split(CHUNK * LAYERS * 2 * HEADS * DIM))
        chunks = [c.view(LAYERS, 2, -1, HEADS, DIM) for c in chunks]

        block_ids = np.asarray(ids, dtype=np.int64)
        copies = [(c, 0, i * CHUNK, c.shape[2]) for i, c in enumerate(chunks)]

        def paged_copies() -> None:  # what a whole load does after its DMAs: the chunks' paged copies, one call
            _core.paged_copy_chunks_cuda(layers, block_ids, copies, False, layout=layout.as_dict(), stream=stream)

        def paged_copy_each() -> None:  # before: a call per chunk (ids uploaded and the stream waited for each)
            for copy in copies:
                _core.paged_copy_cuda(layers, block_ids, *copy, False, layout=layout.as_dict(), stream=stream)

        row(f"  the paged copies alone ({len(chunks)} chunks, device to device, one call)",
            timed(synced(paged_copies), args.repeats))
        row("  the same, a call per chunk (before)", timed(synced(paged_copy_each), args.repeats))
        for name, fn in (("one call", paged_copies), ("a call per chunk", paged_copy_each)):
            row(f"  the paged copies, {name}, on a thread while the main thread spins in Python",
                statistics.median(on_a_thread(synced(fn), "python") for _ in range(args.repeats)))
        del slab, chunks
    for spec in args.codecs.split(",") if args.codecs else []:  # coded chunks: fewer bytes over the link
        coded = [codecs.encode(b, spec) for b in blobs]
        moved = sum(len(b) for b in coded)

        def receive_coded(coded=coded) -> None:
            PagedBlocks(layers, layout, ids).receive(None, coded, n)

        synced(receive_coded)()  # its first: staging allocated
        row(f"whole load into the blocks, {spec} chunks", timed(synced(receive_coded), args.repeats), moved=nbytes,
            coded_bytes=moved)
        if device.type == "cuda":  # the link's share of it: the coded bytes' DMA alone, from pinned memory
            host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
            landed = torch.empty(moved, dtype=torch.uint8, device=device)
            row(f"  their DMA alone ({spec}, pinned)", timed(synced(lambda: landed.copy_(host, non_blocking=True)),
                                                             args.repeats), moved=moved)
            del host, landed
            crossover(rows, spec, nbytes, moved)
    disk_hits(args, blobs, layers, layout, ids, synced, row)
    groups = [(g, min(g + args.layer_group, LAYERS)) for g in range(0, LAYERS, args.layer_group)]
    decodes = []

    def layerwise() -> None:
        target = PagedBlocks(layers, layout, ids)
        for first, end in groups:
            target.receive_layers(list(blobs), first, end, n, LAYERS)
        decodes.append(target.decodes)

    row(f"layer-wise load ({len(groups)} groups)", timed(synced(layerwise), args.repeats),
        device_decodes_per_load=decodes[-1])
    tail = n - CHUNK
    source = PagedBlocks(layers, layout, ids)
    row("store gather, the last chunk", timed(lambda: source.pack([(tail, n - tail, bytes(16))], FINGERPRINT),
                                             args.repeats), moved=nbytes * (n - tail) // n)
    whole = [(s, min(CHUNK, n - s), bytes(16)) for s in range(0, n, CHUNK)]
    row("store gather, the whole prompt", timed(lambda: source.pack(whole, FINGERPRINT), args.repeats))
    row("  of which the blocks to host (emit)", timed(lambda: source.emit(0, n), args.repeats))


if __name__ == "__main__":
    main()
