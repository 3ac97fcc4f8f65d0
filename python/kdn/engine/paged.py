"""Engines' paged KV layouts described by numbers: where token p's K and V of each head sit in a layer's blocks.

kdn's C++ core copies chunks in and out of any layout given as element strides (``kdn/paged.h``;
FlashInfer's ``paged_kv_t`` is the model): element (block, head, offset, dim) of K is at
``k.base + block * k.block + head * k.head + offset * k.token + dim * k.dim`` from the layer
tensor's data pointer, V likewise; a plane may also cut the token and dim indices in tiles (vLLM's
CPU ``amx`` kernel). :class:`PagedLayout` derives those numbers from the tensors an engine hands
over; a new engine layout is one more constructor here, not new C++.

Example:
    >>> from kdn.engine.paged import PagedLayout
    >>> blocks = torch.zeros(8, 4, 16, 2 * 64)               # vLLM on a GPU: [blocks, heads, block, K||V]
    >>> PagedLayout.packed(blocks).k, PagedLayout.packed(blocks).v
    ((0, 8192, 2048, 128, 1), (64, 8192, 2048, 128, 1))
    >>> nhd = torch.zeros(8, 16, 4, 128).permute(0, 2, 1, 3)  # the same, stored in the NHD stride order
    >>> PagedLayout.packed(nhd).k
    (0, 8192, 128, 512, 1)
"""

from __future__ import annotations

import dataclasses

import torch

from kdn._core import InvalidInputError

# (base, block, head, token, dim) element strides, optionally followed by tiles (token_tile,
# token_tile_stride, dim_tile, dim_tile_stride): token t then sits at
# (t // token_tile) * token_tile_stride + (t % token_tile) * token, a dim index likewise
Plane = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """One engine layout: sizes, and the strides of K and V within a layer tensor (in elements)."""

    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    k: Plane
    v: Plane
    name: str = ""

    def as_dict(self) -> dict:
        """What ``_core.unpack_chunks_paged`` / ``gather_paged`` take as ``layout``."""
        return {"kv_heads": self.kv_heads, "head_dim": self.head_dim, "block_size": self.block_size,
                "num_blocks": self.num_blocks, "k": self.k, "v": self.v}

    @classmethod
    def vllm_cpu_vec(cls, layer: torch.Tensor) -> PagedLayout:
        """vLLM's CPU ``vec`` attention kernel: a contiguous ``[blocks, heads, block_size, 2 * head_dim]``
        tensor whose every (block, head) page holds K transposed, ``[head_dim, block_size]``, then V,
        ``[block_size, head_dim]`` (measured against HF's cache in tests/test_vllm.py)."""
        _expect(layer, 4, "[blocks, kv_heads, block_size, 2 * head_dim]")
        if not layer.is_contiguous() or layer.shape[3] % 2:
            raise InvalidInputError(f"vLLM CPU 'vec' layout: a contiguous tensor with an even last dimension "
                                    f"is expected, got {tuple(layer.shape)} with strides {layer.stride()}")
        blocks, heads, size, both = layer.shape
        dim, page = both // 2, size * both
        return cls(heads, dim, size, blocks, (0, heads * page, page, 1, size),
                   (size * dim, heads * page, page, dim, 1), "vllm-cpu-vec")

    @classmethod
    def vllm_cpu_amx(cls, layer: torch.Tensor) -> PagedLayout:
        """vLLM's CPU ``amx`` attention kernel (bf16 on CPUs with AMX): the ``vec`` kernel's tensor and
        pages (K then V per (block, head)), each packed for AMX tiles of 64-byte rows. K holds 16-token
        groups, in each every token's dims in pairs, pair after pair: (t, d) at
        ``(t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2``; V holds 16-dim groups, in
        each token pairs: ``(d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2`` (vLLM's
        ``cpu_attn_reshape_and_cache`` writes exactly these, tests/test_vllm.py)."""
        _expect(layer, 4, "[blocks, kv_heads, block_size, 2 * head_dim]")
        blocks, heads, size, both = layer.shape
        dim = both // 2
        if not layer.is_contiguous() or layer.element_size() != 2 or size % 16 or dim % 16:
            raise InvalidInputError(f"vLLM CPU 'amx' layout: a contiguous 16-bit tensor with block_size and "
                                    f"head_dim multiples of 16 is expected, got {tuple(layer.shape)} "
                                    f"{layer.dtype} with strides {layer.stride()}")
        page = size * both
        return cls(heads, dim, size, blocks, (0, heads * page, page, 2, 1, 16, 16 * dim, 2, 32),
                   (size * dim, heads * page, page, 1, 2, 2, 32, 16, 16 * size), "vllm-cpu-amx")

    @classmethod
    def packed(cls, layer: torch.Tensor) -> PagedLayout:
        """vLLM's GPU backends since RFC #42082: a ``[blocks, kv_heads, block_size, K||V]`` view (K and
        V packed in the last dimension) over any physical stride order (``LBHNC``, ``LBNHC``, ...): the
        view's own strides say where everything is."""
        _expect(layer, 4, "[blocks, kv_heads, block_size, 2 * head_dim]")
        blocks, heads, size, both = layer.shape
        if both % 2:
            raise InvalidInputError(f"packed layout: the last dimension holds K then V, got {both} (odd)")
        sb, sh, st, sd = layer.stride()
        return cls(heads, both // 2, size, blocks, (0, sb, sh, st, sd), (both // 2 * sd, sb, sh, st, sd), "packed")

    @classmethod
    def kv_first(cls, layer: torch.Tensor) -> PagedLayout:
        """Older vLLM FLASH_ATTN: ``(2, blocks, block_size, kv_heads, head_dim)``."""
        _expect(layer, 5, "(2, blocks, block_size, kv_heads, head_dim)")
        if layer.shape[0] != 2:
            raise InvalidInputError(f"(2, blocks, ...) layout: the first dimension must be 2, got {tuple(layer.shape)}")
        _, blocks, size, heads, dim = layer.shape
        s2, sb, st, sh, sd = layer.stride()
        return cls(heads, dim, size, blocks, (0, sb, sh, st, sd), (s2, sb, sh, st, sd), "kv-first")

    @classmethod
    def blocks_first(cls, layer: torch.Tensor) -> PagedLayout:
        """Older vLLM FLASHINFER / TRITON_ATTN: ``(blocks, 2, block_size, kv_heads, head_dim)``."""
        _expect(layer, 5, "(blocks, 2, block_size, kv_heads, head_dim)")
        if layer.shape[1] != 2:
            raise InvalidInputError(f"(blocks, 2, ...) layout: the second dimension must be 2, "
                                    f"got {tuple(layer.shape)}")
        blocks, _, size, heads, dim = layer.shape
        sb, s2, st, sh, sd = layer.stride()
        return cls(heads, dim, size, blocks, (0, sb, sh, st, sd), (s2, sb, sh, st, sd), "blocks-first")


    @classmethod
    def latent(cls, layer: torch.Tensor) -> PagedLayout:
        """vLLM's MLA caches: ``[blocks, block_size, latent]`` (the GPU MLA backends) or ``[blocks, 1,
        block_size, latent]`` (CPU_MLA), one latent vector per token; its first half is kdn's K plane,
        its second half the V plane, of one head (:class:`kdn.engine.layout.ModelLayout` ``latent``)."""
        if layer.dim() == 4 and layer.shape[1] == 1:
            layer = layer[:, 0]
        _expect(layer, 3, "[blocks, block_size, latent] or [blocks, 1, block_size, latent]")
        blocks, size, width = layer.shape
        if width % 2:
            raise InvalidInputError(f"MLA layout: a latent of {width} values (odd) is not supported")
        sb, st, sd = layer.stride()
        return cls(1, width // 2, size, blocks, (0, sb, 0, st, sd), (width // 2 * sd, sb, 0, st, sd), "mla")


def vllm_layout(layer: torch.Tensor, kernel: str) -> PagedLayout:
    """The layout of one of vLLM's per-layer KV tensors, as vLLM hands them to a KV connector.

    ``kernel`` is the attention kernel that owns the blocks: ``"mla"`` (an MLA model's latent cache,
    CPU or GPU), ``"vec"`` or ``"amx"`` (vLLM's CPU
    kernels kdn reads; ``"amx"`` is bf16 on CPUs with AMX) or ``"gpu"`` (FLASH_ATTN, FLASHINFER, TRITON_ATTN: the packed
    ``[blocks, heads, block, K||V]`` view since RFC #42082, or the older 5-D shapes, told apart by
    where their 2 is). Anything else is an :class:`InvalidInputError` that says what was found.

    Example:
        >>> from kdn.engine.paged import vllm_layout
        >>> vllm_layout(torch.zeros(8, 16, 4, 128).permute(0, 2, 1, 3), "gpu").name
        'packed'
        >>> vllm_layout(torch.zeros(2, 8, 16, 4, 64), "gpu").name
        'kv-first'
    """
    if kernel == "mla":
        return PagedLayout.latent(layer)
    if kernel == "vec":
        return PagedLayout.vllm_cpu_vec(layer)
    if kernel == "amx":
        return PagedLayout.vllm_cpu_amx(layer)
    if kernel != "gpu":
        raise InvalidInputError(f"vLLM attention kernel {kernel!r}: kdn reads the CPU 'vec' and 'amx' kernels' "
                                "blocks and the GPU backends' (FLASH_ATTN, FLASHINFER, TRITON_ATTN)")
    if layer.dim() == 4:
        return PagedLayout.packed(layer)
    if layer.dim() == 5 and (layer.shape[0] == 2) != (layer.shape[1] == 2):
        return PagedLayout.kv_first(layer) if layer.shape[0] == 2 else PagedLayout.blocks_first(layer)
    raise InvalidInputError(f"vLLM GPU KV tensor {tuple(layer.shape)}: expected [blocks, heads, block, K||V], "
                            "(2, blocks, block, heads, dim) or (blocks, 2, block, heads, dim)")


def _expect(layer: torch.Tensor, ndim: int, shape: str) -> None:
    if layer.dim() != ndim:
        raise InvalidInputError(f"paged layout {shape}: got a {layer.dim()}-D tensor {tuple(layer.shape)}")
