"""Where verified chunks are laid out (targets) and where stored KV comes from (sources): HF per-layer
tensors (whole, or a layer group at a time) and an engine's paged blocks.

Contract of a target (what :class:`kdn.engine.ChunkIO` and :mod:`kdn.delivery` call):

* ``device``: where the KV ends up (a ``torch.device``).
* ``receive(session, blobs, num_tokens)``: lay the first ``num_tokens`` tokens of the verified,
  consecutive chunk ``blobs`` (the prompt's first chunk first) out in the target's layout, decoding
  coded ones; return what the caller hands on (tensors, or the token count). Raises ``BlobError``
  when a payload cannot be decoded: the caller drops the chunk and serves a miss, never wrong KV.
* ``receive_layers(blobs, first, end, num_tokens, layers)``: the same for layers ``[first, end)``
  of the blobs' ``layers`` only (layer-wise delivery: groups arrive while the model computes).

A source (the save side) adds ``emit(start, end) -> (first, kv)``: the KV of tokens ``[first, end)``
(``first`` = ``start`` rounded down to what the layout can give) as HF per-layer tensors; and
``pack(chunks, fingerprint)``: sealed raw blobs of ``chunks`` (``(start, count, key)`` each), what
:meth:`kdn.engine.ChunkIO.pack` files (then stored under the one rule of :mod:`kdn.engine.served`).
"""

from __future__ import annotations

import collections
import threading
from typing import Protocol

import numpy as np
import torch

from kdn import _core, codecs
from kdn._core import InvalidInputError
from kdn.engine.layout import ModelLayout, empty_kv_list
from kdn.engine.paged import PagedLayout
from kdn.engine.session import ModelSession


class Target(Protocol):
    device: torch.device

    def receive(self, session: ModelSession, blobs: list, num_tokens: int): ...

    def receive_layers(self, blobs: list, first: int, end: int, num_tokens: int, layers: int) -> None: ...


class HFTarget:
    """Decodes chunks into HF's per-layer KV tensors (``2 * layers`` of ``[1, kv_heads, n, head_dim]``,
    K then V per layer) on ``device``.

    On the CPU the C++ core decodes and copies in its worker threads (the reference path). On a CUDA
    device the chunks go to the device in their canonical layout and are laid out there: int*
    chunks travel coded and are decoded by the CUDA decoder; the others are copied (raw) or
    decoded (lossless, cachegen) by the host threads straight into pinned memory (torch's pinned
    pool) and copied over; then the CUDA layout kernel scatters each chunk into the per-layer
    tensors. The device holds the canonical chunks and the finished tensors until it returns.

    Example:
        >>> cache = kdn.KDN(kdn.KDNConfig(chunk_size=16))
        >>> stored = cache.store(model, ids, model(ids, use_cache=True).past_key_values)
        >>> key = cache.chunk_keys(model, ids)[0]; blob = cache.memory.get(key)   # a stored chunk
        >>> session = cache.session(model)
        >>> kv = HFTarget("cpu").receive(session, [blob], 10)   # [k0, v0, k1, v1, ...]; "cuda": on the GPU
        >>> len(kv), tuple(kv[0].shape)
        (10, (1, 4, 10, 8))
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def receive_layers(self, blobs: list, first: int, end: int, num_tokens: int, layers: int) -> None:
        raise NotImplementedError("HFTarget lays out whole hits; layer-wise delivery uses HFLayers")

    def receive(self, session: ModelSession, blobs: list, num_tokens: int) -> list[torch.Tensor]:
        """The first ``num_tokens`` tokens of the verified ``blobs`` in this target's layout.
        Raises BlobError when a coded payload cannot be decoded (the caller drops the chunk)."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return _receive_cuda(session.layout, blobs, num_tokens, self.device)
        kv = empty_kv_list(session.layout, num_tokens)
        _core.unpack_chunks(blobs, kv, num_tokens)  # decodes coded chunks; BlobError if one cannot be
        if self.device.type != "cpu":
            kv = [t.to(self.device, non_blocking=True) for t in kv]
        return kv


def _receive_cuda(layout: ModelLayout, blobs: list, num_tokens: int, device: torch.device) -> list[torch.Tensor]:
    chunks = _device_chunks(blobs, num_tokens, layout.layers, layout.kv_heads, layout.head_dim, layout.torch_dtype,
                            device)
    shape = (2 * layout.layers, 1, layout.kv_heads, num_tokens, layout.head_dim)
    kv = list(torch.empty(shape, dtype=layout.torch_dtype, device=device).unbind(0))
    stream, pos = torch.cuda.current_stream(device).cuda_stream, 0
    for chunk in chunks:
        count = min(chunk.shape[2], num_tokens - pos)
        _core.kv_copy_cuda(kv, chunk, chunk.shape[2], pos, count, False, stream)
        pos += count
    return kv


def _device_chunks(blobs: list, num_tokens: int, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> list[torch.Tensor]:
    """The chunks holding the first ``num_tokens`` tokens of ``blobs``, decoded on ``device`` in the
    canonical layout ``[layers, 2, tokens, kv_heads, head_dim]`` (views of one slab), on torch's
    current stream: raw chunks in page-locked memory (a tier's blobs once the buffer pool locks its
    blocks, :func:`kdn._core.buffer_pool_lock_pages`) copied straight from the blob, int* decoded
    by the CUDA decoder, the others by the host threads into pinned memory, then one copy each."""
    headers = _needed(blobs, num_tokens)
    blobs = blobs[: len(headers)]
    per_token = layers * 2 * kv_heads * head_dim
    sizes = [h["tokens"] * per_token for h in headers]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tolist()
    slab = torch.empty(offsets[-1], dtype=dtype, device=device)  # canonical chunks, back to back
    stream = torch.cuda.current_stream(device).cuda_stream
    direct = [False] * len(blobs)
    if any(h["codec"] == 0 for h in headers):  # raw chunks a tier holds page-locked: one DMA each, from the blob
        direct = _core.upload_raw_chunks_cuda(blobs, slab, stream)
        if any(direct):
            _hold_until_uploaded(blobs, torch.cuda.current_stream(device))
    on_host = [i for i, h in enumerate(headers) if not direct[i] and h["codec"] not in codecs.DEVICE_DECODED]
    if on_host:  # decoded (or copied) by the host threads straight into pinned memory, then one copy each
        staged = torch.empty(sum(sizes[i] for i in on_host), dtype=dtype, pin_memory=True)
        _core.decode_chunks([blobs[i] for i in on_host], staged)
        at = 0
        for i in on_host:
            slab[offsets[i]:offsets[i + 1]].copy_(staged[at:at + sizes[i]], non_blocking=True)
            at += sizes[i]
    chunks = [slab[offsets[i]:offsets[i + 1]].view(layers, 2, h["tokens"], kv_heads, head_dim)
              for i, h in enumerate(headers)]
    on_device = [i for i, h in enumerate(headers) if h["codec"] in codecs.DEVICE_DECODED]
    if on_device:  # decoded by the CUDA decoders (kvtc chunks all in one launch pair)
        _core.codec_decode_cuda_many([blobs[i] for i in on_device], [chunks[i] for i in on_device], stream)
    return chunks


def _needed(blobs: list, num_tokens: int) -> list[dict]:
    """The headers of the leading ``blobs`` that hold the first ``num_tokens`` tokens."""
    headers, used = [], 0
    for blob in blobs:
        if used >= num_tokens:
            break
        headers.append(_core.blob_parse(blob, verify_checksum=False))  # the reader verified them already
        used += headers[-1]["tokens"]
    return headers


_uploading: collections.deque = collections.deque()  # (event, blobs): DMAs from blobs still running
_uploading_lock = threading.Lock()


def _hold_until_uploaded(blobs: list, stream: torch.cuda.Stream) -> None:
    """Keep ``blobs`` alive until ``stream`` has run the uploads queued from them so far: a blob freed
    earlier would return its block to the pool, to be refilled while the DMA still reads it."""
    event = torch.cuda.Event()
    event.record(stream)
    with _uploading_lock:
        while _uploading and _uploading[0][0].query():
            _uploading.popleft()
        _uploading.append((event, list(blobs)))


class HFLayers:
    """A layer-wise target: HF's per-layer tensors on the CPU (``kv``, ``2 * layers`` of ``[1,
    kv_heads, tokens, head_dim]``), filled a layer group at a time (:mod:`kdn.delivery`)."""

    device = torch.device("cpu")

    def __init__(self, session: ModelSession, tokens: int):
        self.kv = empty_kv_list(session.layout, tokens)

    def receive(self, session: ModelSession, blobs: list, num_tokens: int) -> list[torch.Tensor]:
        _core.unpack_chunks(blobs, self.kv, num_tokens)
        return self.kv

    def receive_layers(self, blobs: list, first: int, end: int, num_tokens: int, layers: int) -> None:
        _core.unpack_chunks(blobs, self.kv[2 * first:2 * end], num_tokens, first, layers)


class HostSpan:
    """Sequence positions ``[first, ...)`` of a request's KV in host memory (``kv``: HF per-layer
    tensors, :meth:`PagedBlocks.copy_out`): a source whose ``pack`` seals chunks anywhere, e.g. on a
    store thread after the engine has reused the blocks the span came from."""

    def __init__(self, first: int, kv: list[torch.Tensor]):
        self.first, self.kv = first, kv

    def pack(self, chunks: list, fingerprint: bytes) -> list:
        """Sealed raw blobs of ``chunks`` (``(start, count, key)``, within the span), named by their
        sequence positions (one call: a store thread takes the GIL back once, not once per chunk)."""
        return _core.pack_chunks(self.kv, chunks, fingerprint, self.first) if chunks else []


NULL_BLOCK = 0  # vLLM's null block: what a sliding layer's block table names outside its window


class PagedBlocks:
    """One request's KV in an engine's paged blocks (``layers``: one tensor per layer, read and
    written by ``layout``, :mod:`kdn.engine.paged`): a target from sequence position ``start`` on,
    and a source of what the engine computed into them. kdn's C++ core decodes chunks straight into
    the blocks and gathers them back out.

    ``block_ids`` is the request's block table, or with ``layer_groups`` (each layer's KV cache group:
    vLLM's hybrid KV cache manager) one table per group. There a table names :data:`NULL_BLOCK` for
    the positions its layers no longer keep (before a sliding window): a load lays those layers out
    from the first block they keep (the window), and nothing is ever gathered from a null block."""

    def __init__(self, layers: list[torch.Tensor], layout: PagedLayout, block_ids: list, start: int = 0,
                 layer_groups: tuple | None = None):
        self.layers, self.layout, self.start = layers, layout, start
        self.grouped = layer_groups is not None
        # runs of consecutive layers of one group: [first layer, end layer, block table, first position kept]
        if not self.grouped:
            self.runs = [[0, len(layers), np.asarray(block_ids, dtype=np.int64), 0]]
        else:
            tables = [np.asarray(t, dtype=np.int64) for t in block_ids]
            self.runs = []
            for layer, group in enumerate(layer_groups):
                if self.runs and layer_groups[layer - 1] == group:
                    self.runs[-1][1] += 1
                    continue
                nulls = np.flatnonzero(tables[group] == NULL_BLOCK)
                kept = (int(nulls[-1]) + 1) * layout.block_size if len(nulls) else 0
                self.runs.append([layer, layer + 1, tables[group], kept])
        self.device = layers[0].device
        self._decoded = None  # (blobs, tokens, device chunks) of the last load on a GPU
        self.decodes = 0  # how many times chunks were decoded onto the GPU (once per load)
        # on a GPU, every copy goes on the stream current where the target was made (the engine's),
        # whichever thread delivers a layer group: the engine's kernels after it are ordered after it
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def kept_from(self) -> int:
        """The first sequence position every layer's blocks still hold (0 but for windowed layers)."""
        return max(run[3] for run in self.runs)

    def layer_tokens(self, num_tokens: int) -> int:
        """Positions a load of ``num_tokens`` tokens lays out, summed over layers (a windowed layer's
        only those its blocks keep)."""
        return sum((hi - lo) * max(0, num_tokens - start) for lo, hi, _, start in self._runs(0, len(self.layers)))

    def _runs(self, first: int, end: int):
        """``(lo, hi, block table, first position to lay out)`` of the layers in ``[first, end)``."""
        for a, b, ids, kept in self.runs:
            if max(a, first) < min(b, end):
                yield max(a, first), min(b, end), ids, max(self.start, kept)

    def unread_chunks(self, chunk_size: int) -> int:
        """How many leading chunks of a hit this target lays nothing from: those before the first
        position any layer takes (``start``: what the engine computed or holds itself; a sliding
        window's first kept block), whole blocks only. A reader need not fetch them: :meth:`receive`
        takes the chunks from there on (each blob says its position)."""
        first = min(start for _, _, _, start in self._runs(0, len(self.layers)))
        skip = first // chunk_size
        while skip and skip * chunk_size % self.layout.block_size:
            skip -= 1
        return skip

    def chunk_layers(self, start: int, end: int) -> list[tuple[int, int]] | None:
        """The layers a load lays positions [start, end) of its hit into, as ranges ``(first, end)``
        (a sliding layer takes nothing before its window): what a reader need read of the chunk
        there; None when every layer takes them, or on a GPU (which decodes whole chunks)."""
        if self.device.type != "cpu" or not self.grouped:
            return None
        spans: list = []
        for lo, hi, _, first in self._runs(0, len(self.layers)):
            if first < end:
                if spans and spans[-1][1] == lo:
                    spans[-1] = (spans[-1][0], hi)
                else:
                    spans.append((lo, hi))
        return None if spans == [(0, len(self.layers))] else spans

    def receive(self, session: ModelSession, blobs: list, num_tokens: int) -> int:
        self.receive_layers(blobs, 0, len(self.layers), num_tokens, len(self.layers))
        return num_tokens

    def receive_layers(self, blobs: list, first: int, end: int, num_tokens: int, layers: int) -> None:
        """Lay layers [first, end) of the chunks ``blobs`` (a prefix's chunks from the first one's
        position on: all, or from :meth:`unread_chunks`) up to ``num_tokens`` into the blocks."""
        origin = _core.blob_parse(blobs[0], verify_checksum=False)["position"] if blobs else 0
        if self.device.type == "cuda":
            self._receive_cuda(blobs, first, end, num_tokens, origin)
            return
        skipped = origin // self.layout.block_size
        if skipped * self.layout.block_size != origin:
            raise InvalidInputError(f"chunks from position {origin} do not start a block of {self.layout.block_size}")
        # the blocks from the first chunk's on: positions relative to it
        runs = [(lo, hi, ids[skipped:], start - origin) for lo, hi, ids, start in self._runs(first, end)]
        if runs:  # every run (an engine's KV cache groups) in one call: the GIL taken back once
            _core.unpack_chunks_paged_runs(blobs, self.layers, runs, num_tokens - origin, layers,
                                           layout=self.layout.as_dict())

    def _receive_cuda(self, blobs: list, first: int, end: int, num_tokens: int, origin: int = 0) -> None:
        """Sequence positions [start, num_tokens) of layers [first, end) on the GPU (``blobs``: the
        chunks from position ``origin`` on): the chunks decoded on the device once per ``blobs``
        (layer groups of one load reuse them), then the CUDA twin of the paged copy lays each into
        the blocks, all on the target's stream."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # a load's layer groups each pass a new list of the same chunk objects: decoded once, not per group
            held = self._decoded
            if held is None or held[1] < num_tokens or len(held[0]) != len(blobs) or any(
                    a is not b for a, b in zip(held[0], blobs)):
                shape = (len(self.layers), self.layout.kv_heads, self.layout.head_dim, self.layers[0].dtype)
                self._decoded = (list(blobs), num_tokens, _device_chunks(blobs, num_tokens, *shape, self.device))
                self.decodes += 1
            for lo_layer, hi_layer, ids, start in self._runs(first, end):
                copies, pos = [], origin
                for chunk in self._decoded[2]:
                    tokens = chunk.shape[2]
                    lo, hi = max(pos, start), min(pos + tokens, num_tokens)
                    if hi > lo:
                        copies.append((chunk[lo_layer:hi_layer], lo - pos, lo, hi - lo))
                    pos += tokens
                # in one call: a delivery thread takes the GIL back once, not once per chunk (each time a
                # switch interval while vLLM's loop runs Python), and waits once for all the copies
                if copies:
                    _core.paged_copy_chunks_cuda(self.layers[lo_layer:hi_layer], ids, copies, False,
                                                 layout=self.layout.as_dict(), stream=self.stream.cuda_stream)

    def pack(self, chunks: list, fingerprint: bytes) -> list:
        """Sealed raw blobs of ``chunks`` (``(start, count, key)``: sequence positions [start, start +
        count)): on the CPU gathered straight from the blocks into each blob (one copy); on a GPU
        gathered to pinned host memory first (:meth:`emit`)."""
        if not chunks:
            return []
        if self.device.type == "cpu" and not self.grouped:
            return _core.pack_chunks_paged(self.layers, self.runs[0][2], chunks, fingerprint,
                                           layout=self.layout.as_dict())
        return self.copy_out(chunks).pack(chunks, fingerprint)

    def copy_out(self, chunks: list) -> HostSpan:
        """The span of sequence positions ``chunks`` (``(start, count, key)``) cover, copied out of the
        blocks (on a GPU to pinned host memory, in one device-to-host copy): what a store seals
        later, from another thread, once the blocks are the engine's again. Only that span: a
        served prompt stores its new tail, not what it was served."""
        if not chunks:
            return HostSpan(0, [])
        return HostSpan(*self.emit(min(start for start, _, _ in chunks),
                                   max(start + count for start, count, _ in chunks)))

    def lay(self, kv: list[torch.Tensor], start: int, end: int) -> None:
        """Write positions [start, end) of ``kv`` (HF per-layer ``[1, kv_heads, >= end, head_dim]``, the
        sequence from position 0) into the blocks (one block table: blending's KV, never a windowed model's)."""
        if self.grouped:
            raise InvalidInputError("blended KV is laid into one block table, not per KV cache group")
        if end <= start:
            return
        chunk = torch.stack([torch.stack([kv[2 * i][0, :, start:end], kv[2 * i + 1][0, :, start:end]])
                             for i in range(len(self.layers))]).transpose(2, 3).contiguous().to(self.layers[0].dtype)
        ids = np.ascontiguousarray(self.runs[0][2])
        if self.device.type == "cuda":
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                _core.paged_copy_cuda(self.layers, ids, chunk, 0, start, end - start, False,
                                      layout=self.layout.as_dict(), stream=self.stream.cuda_stream)
        else:
            _core.paged_copy_cpu(self.layers, ids, chunk, 0, start, end - start, False, layout=self.layout.as_dict())

    def emit(self, start: int, end: int) -> tuple[int, list[torch.Tensor]]:
        """``(first, kv)``: tokens ``[first, end)`` (``first``: ``start`` rounded down to a block) as HF
        per-layer tensors ``[1, kv_heads, end - first, head_dim]`` (views of one gathered chunk)."""
        size, layout = self.layout.block_size, self.layout
        first = start // size * size
        chunk = torch.empty(len(self.layers), 2, end - first, layout.kv_heads, layout.head_dim,
                            dtype=self.layers[0].dtype, device=self.device)
        for lo, hi, table, _ in self.runs:
            ids = np.ascontiguousarray(table[first // size: -(-end // size)])
            if self.grouped and (len(ids) < -(-end // size) - first // size or (ids == NULL_BLOCK).any()):
                raise InvalidInputError(f"layers {lo}-{hi - 1} no longer keep positions [{first}, {end}) "
                                        "(they are outside their window)")
            if self.device.type == "cuda":  # gathered by the CUDA twin
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    _core.paged_copy_cuda(self.layers[lo:hi], ids, chunk[lo:hi], 0, 0, end - first, True,
                                          layout=layout.as_dict(), stream=self.stream.cuda_stream)
            else:
                _core.gather_paged(self.layers[lo:hi], ids, chunk[lo:hi], layout=layout.as_dict())
        if self.device.type == "cuda":  # then one copy into pinned host memory
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                host = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True)
                host.copy_(chunk, non_blocking=True)
                self.stream.synchronize()  # the blocks are the engine's to reuse once this returns
                chunk = host
        return first, [chunk[i, side].transpose(0, 1).unsqueeze(0) for i in range(len(self.layers)) for side in (0, 1)]
