"""Chunks laid straight into vLLM's paged CPU KV blocks (kdn/paged.h), against the HF-layout oracle
scattered with torch indexing into the same layout."""

import pytest
import torch
from kdn._core import InvalidInputError

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


def coded_chunks(dtype, codec, count, layers=3, heads=2, dim=16, chunk=32):
    """Three stored chunks of 96 random tokens in ``codec`` and the first ``count`` tokens they
    decode to, in HF's per-layer layout (what every paged layout must hold)."""
    kv = [torch.randn(1, heads, 96, dim).to(dtype) for _ in range(2 * layers)]
    blobs = [codecs.encode(_core.pack_chunk(kv, i * chunk, chunk, FP, bytes([i]) * 16), codec) for i in range(3)]
    decoded = [torch.empty(1, heads, count, dim, dtype=dtype) for _ in kv]
    _core.unpack_chunks(blobs, decoded, count)
    return blobs, decoded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["raw", "lossless", "int8"])
@pytest.mark.parametrize("start,count", [(0, 96), (10, 75), (40, 41)])
def test_chunks_land_in_vllm_cpu_blocks_where_its_kernel_reads_them(dtype, codec, start, count):
    layers, heads, dim, block_size, num_blocks = 3, 2, 16, 16, 11
    blobs, oracle = coded_chunks(dtype, codec, count)  # the decoded KV, in HF's layout
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


# -- every engine layout, described by strides (kdn.engine.paged), against vLLM's own indexing ---------

def engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype, device="cpu"):
    """Per-layer tensors as an engine allocates them: one pool for all layers, viewed per layer."""
    if kind in ("vec", "amx"):
        return [torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=dtype, device=device) for _ in range(layers)]
    if kind == "packed-LBHNC":  # [layers, blocks, heads, block, K||V] in memory
        pool = torch.zeros(layers, num_blocks, heads, block_size, 2 * dim, dtype=dtype, device=device)
        return [pool[i] for i in range(layers)]
    if kind == "packed-LBNHC":  # the old NHD order in memory, seen as [blocks, heads, block, K||V]
        pool = torch.zeros(layers, num_blocks, block_size, heads, 2 * dim, dtype=dtype, device=device)
        return [pool[i].permute(0, 2, 1, 3) for i in range(layers)]
    if kind == "kv-first":
        return [torch.zeros(2, num_blocks, block_size, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
    # blocks-first, layers inside
    pool = torch.zeros(num_blocks, layers, 2, block_size, heads, dim, dtype=dtype, device=device)
    return [pool[:, i] for i in range(layers)]


def describe_layout(kind, layer):
    """The layout the vLLM connector derives from a layer tensor (its kernel: 'vec' or 'amx' on the CPU,
    else 'gpu')."""
    from kdn.engine.paged import vllm_layout

    return vllm_layout(layer, kind if kind in ("vec", "amx") else "gpu")


def element_type(kind, dtype=torch.float32):
    """``dtype``, or bf16 where the layout holds 16-bit KV only (the 'amx' kernel's)."""
    return torch.bfloat16 if kind == "amx" and dtype.itemsize != 2 else dtype


def test_vllm_tensors_kdn_cannot_tell_apart_or_read_are_refused_with_what_was_found():
    from kdn._core import InvalidInputError

    from kdn.engine.paged import vllm_layout

    for kind in KINDS:  # each engine layout is recognised as itself
        expected = {"vec": "vllm-cpu-vec", "amx": "vllm-cpu-amx", "kv-first": "kv-first",
                    "blocks-first": "blocks-first"}.get(kind, "packed")
        assert describe_layout(kind, engine_layers(kind, 2, 4, 2, 16, 32, element_type(kind))[1]).name == expected
    with pytest.raises(InvalidInputError, match=r"\(2, 2, 16, 2, 8\)"):  # 2 blocks: which 2 is K/V?
        vllm_layout(torch.zeros(2, 2, 16, 2, 8), "gpu")
    with pytest.raises(InvalidInputError, match="'vec16'"):
        vllm_layout(torch.zeros(4, 2, 16, 16), "vec16")
    with pytest.raises(InvalidInputError, match="16-bit"):  # the 'amx' kernel's tiles hold bf16 pairs
        vllm_layout(torch.zeros(4, 2, 16, 64), "amx")
    with pytest.raises(InvalidInputError, match="multiples of 16"):
        vllm_layout(torch.zeros(4, 2, 16, 40, dtype=torch.bfloat16), "amx")
    with pytest.raises(InvalidInputError, match=r"\(4, 16, 16\)"):
        vllm_layout(torch.zeros(4, 16, 16), "gpu")


def read_like_vllm(kind, layer, blocks, offsets, dim):
    """K and V [tokens, heads, dim] of (block, offset) pairs, read the way vLLM's kernels and its
    reference connector index each layout."""
    if kind == "vec":
        num_blocks, heads, size, _ = layer.shape
        flat = layer.reshape(num_blocks, heads, 2 * size * dim)
        keys = flat[:, :, : size * dim].reshape(num_blocks, heads, dim, size)
        values = flat[:, :, size * dim:].reshape(num_blocks, heads, size, dim)
        return keys[blocks, :, :, offsets], values[blocks, :, offsets]
    if kind == "amx":  # the pages vLLM's cpu_attn_reshape_and_cache packs for AMX tiles, unpacked with views
        num_blocks, heads, size, _ = layer.shape
        flat = layer.reshape(num_blocks, heads, 2 * size * dim)
        # K: [16-token groups, dim pairs, 16 tokens, 2 dims]; V: [16-dim groups, token pairs, 16 dims, 2 tokens]
        keys = flat[:, :, : size * dim].reshape(num_blocks, heads, size // 16, dim // 2, 16, 2)
        values = flat[:, :, size * dim:].reshape(num_blocks, heads, dim // 16, size // 2, 16, 2)
        keys = keys.permute(0, 1, 2, 4, 3, 5).reshape(num_blocks, heads, size, dim)
        values = values.permute(0, 1, 3, 5, 2, 4).reshape(num_blocks, heads, size, dim)
        return keys[blocks, :, offsets], values[blocks, :, offsets]
    if kind.startswith("packed"):
        both = layer[blocks, :, offsets]  # [tokens, heads, K||V]
        return both[..., :dim], both[..., dim:]
    if kind == "kv-first":
        return layer[0, blocks, offsets], layer[1, blocks, offsets]
    return layer[blocks, 0, offsets], layer[blocks, 1, offsets]


KINDS = ["vec", "amx", "packed-LBHNC", "packed-LBNHC", "kv-first", "blocks-first"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("start,count", [(0, 96), (10, 75), (40, 41)])
def test_every_engine_layout_gets_each_token_where_the_engine_reads_it(kind, dtype, codec, start, count):
    if element_type(kind, dtype) != dtype:
        pytest.skip(f"the {kind!r} layout holds 16-bit KV")
    layers, heads, dim, block_size, num_blocks = 3, 2, 16, 16, 11
    blobs, decoded = coded_chunks(dtype, codec, count)  # the decoded KV, in HF's layout
    block_ids = [7, 2, 9, 0, 4, 10, 1]  # a request's blocks, scattered over the pool
    paged = engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype)
    layout = describe_layout(kind, paged[0]).as_dict()
    _core.unpack_chunks_paged(blobs, paged, torch.tensor(block_ids).numpy(), start, count, layout=layout)
    positions = torch.arange(count)
    blocks, offsets = torch.tensor(block_ids)[positions // block_size], positions % block_size
    for i, layer in enumerate(paged):
        keys, values = read_like_vllm(kind, layer, blocks, offsets, dim)
        assert torch.equal(keys[start:], decoded[2 * i][0, :, start:].transpose(0, 1))
        assert torch.equal(values[start:], decoded[2 * i + 1][0, :, start:].transpose(0, 1))
        assert not keys[:start].any() and not values[:start].any()  # positions before start untouched
    written = sum(int(t.count_nonzero()) for t in paged)  # nothing else was written anywhere
    zeros = sum(int((d[0, :, start:] == 0).sum()) for d in decoded)
    assert written == 2 * layers * heads * dim * (count - start) - zeros
    # and out again: what the engine holds comes back in the canonical layout kdn stores
    out = torch.empty(layers, 2, count, heads, dim, dtype=dtype)
    _core.gather_paged(paged, torch.tensor(block_ids).numpy(), out, layout=layout)
    for i in range(layers):
        for j in range(2):
            assert torch.equal(out[i, j, start:], decoded[2 * i + j][0, :, start:].transpose(0, 1))


def test_a_layout_that_reaches_beyond_the_tensor_is_refused_before_any_write():
    from kdn.engine.paged import PagedLayout

    layer = torch.zeros(4, 2, 16, 32)
    layout = PagedLayout.packed(layer).as_dict()
    kv = [torch.randn(1, 2, 32, 16) for _ in range(2)]
    blob = _core.pack_chunk(kv, 0, 32, FP, bytes(16))
    too_many = {**layout, "num_blocks": 5}
    with pytest.raises(ValueError, match="beyond"):
        _core.unpack_chunks_paged([blob], [layer], torch.tensor([0, 4]).numpy(), 0, 32, layout=too_many)
    with pytest.raises(ValueError, match="non-negative"):
        _core.unpack_chunks_paged([blob], [layer], torch.tensor([0, 1]).numpy(), 0, 32,
                                  layout={**layout, "v": (16, -1, 512, 32, 1)})
    with pytest.raises(ValueError, match="base, block, head, token, dim"):
        _core.gather_paged([layer], torch.tensor([0, 1]).numpy(), torch.empty(1, 2, 32, 2, 16),
                           layout={**layout, "k": (0, 1)})
    with pytest.raises(ValueError, match="tile must divide"):  # a tiled plane whose tiles do not fit the block
        _core.gather_paged([layer], torch.tensor([0, 1]).numpy(), torch.empty(1, 2, 32, 2, 16),
                           layout={**layout, "k": (*layout["k"], 3, 3 * 32, 0, 0)})
    assert not layer.any()
    with pytest.raises(InvalidInputError, match="odd"):
        PagedLayout.packed(torch.zeros(4, 2, 16, 31))
    with pytest.raises(InvalidInputError, match="contiguous"):
        PagedLayout.vllm_cpu_vec(torch.zeros(4, 16, 2, 32).permute(0, 2, 1, 3))


def test_a_blob_that_does_not_fit_is_found_before_any_block_is_written():
    """Every header is checked against the destination first: no half-laid prefix in vLLM's blocks."""
    good = [torch.randn(1, 2, 32, 16) for _ in range(2)]
    other = [torch.randn(1, 3, 32, 16) for _ in range(2)]  # another model's KV heads
    blobs = [_core.pack_chunk(good, 0, 32, FP, bytes(16)), _core.pack_chunk(other, 0, 32, FP, bytes([1]) * 16)]
    paged = [torch.zeros(4, 2, 16, 32)]
    with pytest.raises(ValueError, match="blob 1 layout does not match"):
        _core.unpack_chunks_paged(blobs, paged, torch.tensor([0, 1, 2, 3]).numpy(), 0, 64)
    with pytest.raises(ValueError, match="fewer than count=64"):
        _core.unpack_chunks_paged(blobs[:1], paged, torch.tensor([0, 1, 2, 3]).numpy(), 0, 64)
    assert not paged[0].any()


@pytest.mark.parametrize("kind", KINDS)
def test_the_bound_paged_copy_is_the_unpack_and_gather_the_connector_uses(kind):
    """_core.paged_copy_cpu (the oracle of the CUDA twin) writes what unpack_chunks_paged writes."""
    layers, heads, dim, block_size, num_blocks = 2, 2, 16, 16, 8
    kv = [torch.randn(1, heads, 64, dim).to(element_type(kind)) for _ in range(2 * layers)]
    blob = _core.pack_chunk(kv, 0, 64, FP, bytes(16))
    ids = torch.tensor([5, 0, 7, 2]).numpy()
    by_unpack = engine_layers(kind, layers, num_blocks, heads, block_size, dim, element_type(kind))
    by_copy = engine_layers(kind, layers, num_blocks, heads, block_size, dim, element_type(kind))
    layout = describe_layout(kind, by_unpack[0]).as_dict()
    _core.unpack_chunks_paged([blob], by_unpack, ids, 3, 64, layout=layout)
    _core.paged_copy_cpu(by_copy, ids, codecs.decode(blob).contiguous(), 3, 3, 61, False, layout=layout)
    assert all(torch.equal(a, b) for a, b in zip(by_unpack, by_copy))
    with pytest.raises(ValueError, match="CUDA tensors"):
        _core.paged_copy_cuda(by_copy, ids, codecs.decode(blob).contiguous(), 0, 0, 64, False, layout=layout)
    # a load's chunks in one call (one GIL release; on CUDA one upload of the ids, one wait): the same
    # bytes as a call per chunk, and a bad copy anywhere in the list is refused before any runs
    halves = [_core.pack_chunk(kv, start, 32, FP, bytes(16)) for start in (0, 32)]
    chunks = [codecs.decode(b).contiguous() for b in halves]
    at_once = engine_layers(kind, layers, num_blocks, heads, block_size, dim, element_type(kind))
    _core.paged_copy_chunks_cpu(at_once, ids, [(chunks[0], 3, 3, 29), (chunks[1], 0, 32, 32)], False, layout=layout)
    assert all(torch.equal(a, b) for a, b in zip(by_unpack, at_once))
    _core.paged_copy_chunks_cpu(at_once, ids, [], False, layout=layout)  # nothing to copy
    for copy, why in (((chunks[1], 0, 32), "each copy is"), ((chunks[1], 30, 32, 4), "outside the chunk"),
                      ((torch.zeros(3), 0, 0, 1), "chunk must be")):
        spoiled = engine_layers(kind, layers, num_blocks, heads, block_size, dim, element_type(kind))
        with pytest.raises(ValueError, match=why):
            _core.paged_copy_chunks_cpu(spoiled, ids, [(chunks[0], 0, 0, 32), copy], False, layout=layout)
        assert not any(t.any() for t in spoiled)
    back = torch.empty_like(chunks[1])
    _core.paged_copy_chunks_cpu(at_once, ids, [(back, 0, 32, 32)], True, layout=layout)  # and out of the blocks
    assert torch.equal(back, chunks[1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_sealed_straight_from_the_blocks_are_the_bytes_packed_from_the_model_kv(kind, dtype):
    """What the vLLM connector stores (pack_chunks_paged: one copy, blocks -> blob) is byte for byte
    what pack_chunk makes of the HF tensors the engine computed; the blocks are only read."""
    from kdn.engine.targets import PagedBlocks

    if element_type(kind, dtype) != dtype:
        pytest.skip(f"the {kind!r} layout holds 16-bit KV")
    layers, heads, dim, block_size, num_blocks = 3, 2, 16, 16, 11
    kv = [torch.randn(1, heads, 80, dim).to(dtype) for _ in range(2 * layers)]
    block_ids = [7, 2, 9, 0, 4, 10]
    paged = engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype)
    layout = describe_layout(kind, paged[0])
    _core.unpack_chunks_paged([_core.pack_chunk(kv, 0, 80, FP, bytes(16))], paged, torch.tensor(block_ids).numpy(),
                              0, 80, layout=layout.as_dict())
    before = [t.clone() for t in paged]
    chunks = [(0, 32, bytes([1]) * 16), (32, 32, bytes([2]) * 16), (64, 13, bytes([3]) * 16)]  # a partial tail
    blobs = PagedBlocks(paged, layout, block_ids).pack(chunks, FP)
    for blob, (start, count, key) in zip(blobs, chunks):
        assert bytes(blob) == bytes(_core.pack_chunk(kv, start, count, FP, key))
    assert all(torch.equal(a, b) for a, b in zip(before, paged))
    assert PagedBlocks(paged, layout, block_ids).pack([], FP) == []
    # a GPU engine's store copies out only the span it stores (in its step), and seals it later on the
    # store thread: the blobs name their sequence positions, not where they sit in the span (a reader
    # checks them: a blob at the wrong position is a miss)
    tail = [(48, 16, bytes([4]) * 16), (64, 13, bytes([5]) * 16)]
    span = PagedBlocks(paged, layout, block_ids).copy_out(tail)
    assert span.first == 48 and span.kv[0].shape[2] == 77 - 48
    for (start, count, key), blob, from_span in zip(tail, PagedBlocks(paged, layout, block_ids).pack(tail, FP),
                                                    span.pack(tail, FP)):
        assert bytes(from_span) == bytes(blob) == bytes(_core.pack_chunk(kv, start, count, FP, key))
        assert _core.blob_parse(from_span, verify_checksum=True)["position"] == start
    assert PagedBlocks(paged, layout, block_ids).copy_out([]).pack([], FP) == []
    with pytest.raises(ValueError, match="position"):
        _core.pack_chunk(span.kv, 0, 16, FP, bytes(16), position=-2)
    with pytest.raises(ValueError, match="outside the cache"):  # a chunk before the span's first position
        _core.pack_chunks(span.kv, [(32, 16, bytes(16))], FP, 48)
    with pytest.raises(ValueError, match="each chunk is"):
        _core.pack_chunks(span.kv, [(48, 16)], FP, 48)
    with pytest.raises(ValueError, match="block"):  # positions beyond the request's blocks
        _core.pack_chunks_paged(paged, torch.tensor(block_ids).numpy(), [(80, 32, bytes(16))], FP,
                                layout=layout.as_dict())


def test_a_span_copied_out_in_the_step_and_sealed_later_is_read_back_as_a_full_prefill():
    """A GPU engine's store (the vLLM worker): in the step, which chunks no tier holds and their span
    copied out of the blocks; on the store thread, sealed from that copy and filed, after the blocks
    were reused. Read back by an exact reader: the logits of a full prefill."""
    from conftest import full_prefill, random_ids
    from kdn import KDN, KDNConfig
    from kdn.engine.targets import PagedBlocks
    from kdn.layout import cache_to_kv_list
    from kdn.models.tiny import tiny_model

    model = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)
    cache = KDN(KDNConfig(chunk_size=32))
    ids = random_ids(model, 120)
    logits, past = full_prefill(model, ids)
    kv = cache_to_kv_list(past)
    session = cache.session(model)
    tokens = session.tokens(ids)
    block_ids = list(range(7, -1, -1))
    paged = engine_layers("vec", 3, 9, 2, 16, 16, torch.float32)
    layout = describe_layout("vec", paged[0])
    _core.unpack_chunks_paged([_core.pack_chunk(kv, 0, 120, FP, bytes(16))], paged, torch.tensor(block_ids).numpy(),
                              0, 120, layout=layout.as_dict())  # what the engine computed, in its blocks
    cache.store(model, ids[:, :64], full_prefill(model, ids[:, :64])[1])  # the first two chunks are held already
    unheld = cache.engine.unheld(session, tokens)
    assert [start for start, _, _ in unheld[1]] == [64, 96]
    span = PagedBlocks(paged, layout, block_ids).copy_out(unheld[1])
    for t in paged:
        t.zero_()  # the engine reuses its blocks before the store thread seals
    stored = cache.engine.save(session, tokens, cache.engine.pack(session, tokens, span, unheld))
    assert stored == 120
    restored, hit = cache.retrieve(model, ids, limit=119)
    assert hit == 119
    with torch.inference_mode():
        served = model(ids[:, hit:], past_key_values=restored).logits[0, -1]
    torch.testing.assert_close(served, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", ["gpu [blocks, block, latent]", "cpu [blocks, 1, block, latent]"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mla_latent_lands_where_vllm_reads_it_and_comes_back(shape, dtype):
    """Issue 63: an MLA model's cache holds one latent vector per token (576 values for DeepSeek:
    the 512-value latent, then the 64-value RoPE key); kdn's one-head K and V planes are its halves,
    so token p's latent is ``cat(K[p], V[p])`` at ``cache[block, offset]``, laid in and gathered out."""
    from kdn.engine.paged import vllm_layout

    layers, width, block_size, num_blocks, count = 2, 576, 16, 9, 70
    kv = [torch.randn(1, 1, 96, width // 2).to(dtype) for _ in range(2 * layers)]
    blobs = [_core.pack_chunk(kv, i * 32, 32, FP, bytes([i]) * 16) for i in range(3)]
    cpu = shape.startswith("cpu")
    paged = [torch.zeros(num_blocks, *((1,) if cpu else ()), block_size, width, dtype=dtype) for _ in range(layers)]
    layout = vllm_layout(paged[0], "mla")
    assert (layout.kv_heads, layout.head_dim, layout.name) == (1, width // 2, "mla")
    block_ids = [5, 0, 8, 2, 7]
    _core.unpack_chunks_paged(blobs, paged, torch.tensor(block_ids).numpy(), 0, count, layout=layout.as_dict())
    positions = torch.arange(count)
    blocks, offsets = torch.tensor(block_ids)[positions // block_size], positions % block_size
    for i, layer in enumerate(paged):
        latent = (layer[:, 0] if cpu else layer)[blocks, offsets]  # [tokens, 576], as vLLM's kernels read it
        assert torch.equal(latent, torch.cat([kv[2 * i][0, 0, :count], kv[2 * i + 1][0, 0, :count]], dim=-1))
    out = torch.empty(layers, 2, count, 1, width // 2, dtype=dtype)
    _core.gather_paged(paged, torch.tensor(block_ids).numpy(), out, layout=layout.as_dict())
    for i in range(layers):
        assert torch.equal(out[i, 0, :, 0], kv[2 * i][0, 0, :count])
        assert torch.equal(out[i, 1, :, 0], kv[2 * i + 1][0, 0, :count])


@pytest.mark.parametrize("kind", ["vec", "packed-LBHNC"])
def test_a_block_table_per_kv_cache_group_lays_each_layer_by_its_own_and_a_window_only(kind):
    """vLLM's hybrid KV cache manager: a block table per KV cache group (Gemma 3's sliding and full
    layers), a sliding group's table naming the null block (0) before its window. A load lays every
    layer where its own table says, a sliding layer only from its first kept block on (the pool's
    other blocks, the null block included, untouched); a store gathers the same KV back from each
    layer's table, and refuses positions a sliding layer no longer keeps."""
    from kdn.engine.targets import NULL_BLOCK, PagedBlocks

    layers, heads, dim, block_size, num_blocks, tokens = 4, 2, 16, 16, 24, 80
    kv = [torch.randn(1, heads, tokens, dim) for _ in range(2 * layers)]
    blob = _core.pack_chunk(kv, 0, tokens, FP, bytes(16))
    full, sliding = [3, 5, 7, 9, 11], [NULL_BLOCK, NULL_BLOCK, 13, 15, 17]  # the window: positions 32..79
    groups = (1, 1, 0, 1)  # layers 0, 1, 3 sliding; layer 2 full
    paged = engine_layers(kind, layers, num_blocks, heads, block_size, dim, torch.float32)
    layout = describe_layout(kind, paged[0])
    blocks = PagedBlocks(paged, layout, [full, sliding], 0, groups)
    assert blocks.kept_from() == 32 and blocks.layer_tokens(tokens) == tokens + 3 * (tokens - 32)
    blocks.receive(None, [blob], tokens)

    def reference(block_ids, start):  # torch scatter of layer i's KV by one table, from ``start``
        ref = engine_layers(kind, layers, num_blocks, heads, block_size, dim, torch.float32)
        _core.unpack_chunks_paged([blob], ref, torch.tensor(block_ids).numpy(), start, tokens,
                                  layout=layout.as_dict())
        return ref

    by_full, by_window = reference(full, 0), reference([1, 2] + sliding[2:], 32)
    for i in range(layers):
        want = by_full[i].clone() if groups[i] == 0 else by_window[i].clone()
        if groups[i] == 1:
            want[[1, 2]] = 0  # the stand-ins for the null blocks: nothing lands before the window
        assert torch.equal(paged[i], want), i
    assert all(torch.equal(t[NULL_BLOCK], torch.zeros_like(t[NULL_BLOCK])) for t in paged)
    # stored back: the window's chunk gathers every layer by its own table, byte for byte
    chunk = [(32, 48, bytes([1]) * 16)]
    assert bytes(blocks.pack(chunk, FP)[0]) == bytes(_core.pack_chunk(kv, 32, 48, FP, bytes([1]) * 16))
    with pytest.raises(InvalidInputError, match="window"):
        blocks.pack([(0, 32, bytes(16))], FP)
    # one group's table and no window: the same bytes as the single-table copy
    whole = PagedBlocks(paged, layout, [full], 0, (0,) * layers)
    assert whole.kept_from() == 0 and whole.layer_tokens(tokens) == layers * tokens
