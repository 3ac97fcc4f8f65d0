"""Where verified chunks are laid out: HF per-layer KV tensors on the CPU (the oracle) or on a CUDA device."""

from __future__ import annotations

import numpy as np
import torch

from kdn import _core
from kdn.engine.session import ModelSession
from kdn.layout import ModelLayout, empty_kv_list

_BLOB_HEADER_BYTES = 80  # kdn/blob.h: kBlobHeaderBytes
_GPU_DECODED_CODECS = (2, 3)  # int* (KIVI) and cachegen have CUDA decoders (kernels/codec.cu)


class HFTarget:
    """Decodes chunks into HF's per-layer KV tensors (``2 * layers`` of ``[1, kv_heads, n, head_dim]``,
    K then V per layer) on ``device``.

    On the CPU the C++ core decodes and copies in its worker threads (the reference path). On a CUDA
    device each chunk goes to the device as it is stored, and is decoded and laid out there:
    int*/cachegen chunks are decoded by the CUDA decoders, raw chunks are staged through pinned host
    memory (torch's pinned pool) and copied, lossless chunks are decoded on the CPU first; then the
    CUDA layout kernel scatters the canonical chunk into the per-layer tensors. Nothing but the
    finished tensors is ever allocated on the device for the whole prefix.

    Example:
        >>> kv = HFTarget("cuda").receive(session, blobs, num_tokens)   # [k0, v0, k1, v1, ...] on the GPU
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")

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
    shape = (2 * layout.layers, 1, layout.kv_heads, num_tokens, layout.head_dim)
    kv = list(torch.empty(shape, dtype=layout.torch_dtype, device=device).unbind(0))
    stream = torch.cuda.current_stream(device).cuda_stream
    pos = 0
    for blob in blobs:
        if pos >= num_tokens:
            break
        h = _core.blob_parse(blob, verify_checksum=False)  # the reader verified it already
        tokens = h["tokens"]
        chunk = torch.empty((layout.layers, 2, tokens, layout.kv_heads, layout.head_dim), dtype=layout.torch_dtype,
                            device=device)
        if h["codec"] in _GPU_DECODED_CODECS:
            _core.codec_decode_cuda(blob, chunk, stream)
        else:
            raw = blob if h["codec"] == 0 else _core.transcode(blob, 0, 0, verify_checksum=False)
            nbytes = chunk.numel() * chunk.element_size()
            staged = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            staged.numpy()[:] = np.frombuffer(raw, dtype=np.uint8, count=nbytes, offset=_BLOB_HEADER_BYTES)
            chunk.view(-1).view(torch.uint8).copy_(staged, non_blocking=True)
        count = min(tokens, num_tokens - pos)
        _core.kv_copy_cuda(kv, chunk, tokens, pos, count, False, stream)
        pos += count
    return kv
