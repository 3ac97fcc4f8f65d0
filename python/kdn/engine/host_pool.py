"""The process' pooled host buffers (kdn/buffer_pool.h) made ready for a model serving on a device.

On a CUDA device the pool page-locks its blocks, so that a hit's raw chunks go up by DMA straight
from the tiers' blobs. Page-locking memory costs the driver more than filling it (an H200 machine's
first 2.15 GB of pinned staging took 1.5 s, 0.15 s warm: `benchmarks/results/gpu/VLLM.md`), so a
hit read from disk, the node or a remote tier should land in blocks locked once and reused: the pool
keeps idle blocks for one hit of the longest prompt the engine takes (its default cap, 1 GiB, is
half of one 16K-token Llama-3-8B hit; the other half was made and locked afresh at every such hit).

Example:
    >>> import torch
    >>> from kdn.engine.host_pool import prepare_for
    >>> prepare_for(torch.device("cpu"), pin=True, hit_bytes=4 << 30)   # a CPU model: nothing to lock
"""

from __future__ import annotations

import os

from kdn import _core

SLACK = 16  # blocks are rounded up to 64 KiB and blobs carry headers: 1/16 more than the KV's bytes


def prepare_for(device, pin: bool, hit_bytes: int = 0) -> None:
    """For a model computing on ``device`` (a ``torch.device``): on a CUDA device with ``pin``
    (``KDNConfig.pin_host_memory``), page-lock every pooled block from now on and keep idle blocks
    for one hit of ``hit_bytes`` (the pool's cap raised to it, never lowered, at most a quarter of
    the machine's memory; a cap set by ``KDN_BUFFER_POOL_BYTES`` is the user's and stays)."""
    if device.type != "cuda" or not pin:
        return
    _core.buffer_pool_lock_pages(True)
    if hit_bytes <= 0 or "KDN_BUFFER_POOL_BYTES" in os.environ:
        return
    wanted = idle_cap_for(hit_bytes)
    if wanted > _core.buffer_pool_stats()["limit_bytes"]:
        _core.buffer_pool_set_limit(wanted)


def idle_cap_for(hit_bytes: int) -> int:
    """The pool's idle cap that holds one hit of ``hit_bytes`` of KV: its blocks' bytes, at most a
    quarter of the machine's memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(hit_bytes + hit_bytes // SLACK, memory // 4)
