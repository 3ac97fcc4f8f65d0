"""Chunks laid straight into vLLM's paged CPU KV blocks (kdn/paged.h), against the HF-layout oracle
scattered with torch indexing into the same layout."""

import pytest
import torch

from kdn import _core, codecs

FP = bytes(16)


def vec_blocks_reference(kv, num_blocks, block_size, block_ids, start, count):
    """vLLM's CPU 'vec' layout built with torch: per layer [blocks, heads, block_size, 2 * head_dim],
    per (block, head) K transposed [head_dim, block_size] then V [block_size, head_dim]."""
    heads, dim = kv[0].shape[1], kv[0].shape[3]
    out = []
    positions = torch.arange(start, count)
    blocks = torch.tensor(block_ids)[positions // block_size]
    offsets = positions % block_size
    for i in range(len(kv) // 2):
        layer = torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=kv[0].dtype)
        flat = layer.view(num_blocks, heads, 2 * block_size * dim)
        keys = flat[:, :, : block_size * dim].view(num_blocks, heads, dim, block_size)
        values = flat[:, :, block_size * dim:].view(num_blocks, heads, block_size, dim)
        keys[blocks, :, :, offsets] = kv[2 * i][0, :, start:count].transpose(0, 1)
        values[blocks, :, offsets] = kv[2 * i + 1][0, :, start:count].transpose(0, 1)
        out.append(layer)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["raw", "lossless", "int8"])
@pytest.mark.parametrize("start,count", [(0, 96), (10, 75), (40, 41)])
def test_chunks_land_in_vllm_cpu_blocks_where_its_kernel_reads_them(dtype, codec, start, count):
    layers, heads, dim, chunk, block_size, num_blocks = 3, 2, 16, 32, 16, 11
    kv = [torch.randn(1, heads, 96, dim).to(dtype) for _ in range(2 * layers)]
    blobs = [codecs.encode(_core.pack_chunk(kv, i * chunk, chunk, FP, bytes([i]) * 16), codec) for i in range(3)]
    oracle = [torch.empty(1, heads, count, dim, dtype=dtype) for _ in kv]
    _core.unpack_chunks(blobs, oracle, count)  # the decoded KV, in HF's layout
    block_ids = [7, 2, 9, 0, 4, 10, 1]  # a request's blocks, scattered over the pool
    expected = vec_blocks_reference(oracle, num_blocks, block_size, block_ids, start, count)
    paged = [torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=dtype) for _ in range(layers)]
    _core.unpack_chunks_paged(blobs, paged, torch.tensor(block_ids).numpy(), start, count)
    for got, want in zip(paged, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("codec", ["raw", "cachegen:level=2"])
def test_layer_groups_land_alone_as_a_whole_unpack_would(codec):
    """Layer-wise delivery into vLLM's blocks: each layer group unpacked on its own."""
    layers, heads, dim, block_size, num_blocks = 5, 2, 16, 16, 8
    kv = [torch.randn(1, heads, 64, dim) for _ in range(2 * layers)]
    blobs = [codecs.encode(_core.pack_chunk(kv, i * 32, 32, FP, bytes([i]) * 16), codec) for i in range(2)]
    block_ids = torch.tensor([3, 0, 6, 1]).numpy()
    whole = [torch.zeros(num_blocks, heads, block_size, 2 * dim) for _ in range(layers)]
    _core.unpack_chunks_paged(blobs, whole, block_ids, 5, 60)
    grouped = [torch.zeros_like(t) for t in whole]
    for first, end in ((0, 2), (2, 4), (4, 5)):
        _core.unpack_chunks_paged(blobs, grouped[first:end], block_ids, 5, 60, first, layers)
    assert all(torch.equal(a, b) for a, b in zip(grouped, whole))
    with pytest.raises(ValueError, match="layer range"):
        _core.unpack_chunks_paged(blobs, grouped[3:], block_ids, 5, 60, 4, layers)


def test_positions_beyond_the_blocks_given_are_refused_before_any_write():
    kv = [torch.randn(1, 2, 32, 8) for _ in range(2)]
    blob = _core.pack_chunk(kv, 0, 32, FP, bytes(16))
    paged = [torch.zeros(4, 2, 16, 16)]
    with pytest.raises(ValueError, match="need more than the 1 blocks"):
        _core.unpack_chunks_paged([blob], paged, torch.tensor([0]).numpy(), 0, 32)
    with pytest.raises(ValueError, match="outside"):
        _core.unpack_chunks_paged([blob], paged, torch.tensor([0, 9]).numpy(), 0, 32)
    assert all(not t.any() for t in paged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_requests_kv_gathered_out_of_the_blocks_is_what_was_laid_in(dtype):
    """What vLLM computed into its blocks comes back in the canonical layout (what kdn stores)."""
    layers, heads, dim, block_size = 2, 3, 16, 16
    kv = [torch.randn(1, heads, 40, dim).to(dtype) for _ in range(2 * layers)]
    blob = _core.pack_chunk(kv, 0, 40, FP, bytes(16))
    block_ids = torch.tensor([3, 0, 5]).numpy()
    paged = [torch.zeros(6, heads, block_size, 2 * dim, dtype=dtype) for _ in range(layers)]
    _core.unpack_chunks_paged([blob], paged, block_ids, 0, 40)
    out = torch.empty(layers, 2, 40, heads, dim, dtype=dtype)
    _core.gather_paged(paged, block_ids, out)
    assert torch.equal(out, codecs.decode(blob))
    with pytest.raises(ValueError, match="out must be"):
        _core.gather_paged(paged, block_ids, torch.empty(layers, 2, 40, heads, dim + 1, dtype=dtype))
