"""Retrieve, generate and blending with the model on a CUDA device, against the CPU path (the oracle).

Skipped without a CUDA device; the kernels' own index math is shared with the CPU code and checked
there by every other test."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kdn
from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig, codecs
from kdn.engine import HFTarget
from kdn.layout import cache_to_kv_list
from kdn.models.tiny import tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

CODECS = ["raw", "lossless", "int4", "int8:group=64", "cachegen:level=3", "cachegen:level=1,anchor=1"]


def _read(provider: KDN, session, tokens, limit: int, device: str):
    load = provider.engine.load(session, tokens, limit, HFTarget(device))
    return load.result, load.hit


def _provider(codec: str) -> KDN:
    lossy = codecs.parse(codec).lossy
    return KDN(KDNConfig(chunk_size=32, memory_codec=codec, accept_codecs=(codec,) if lossy else ()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", CODECS)
def test_chunks_laid_out_on_the_device_equal_the_cpu_layout(codec, dtype):
    """The same stored chunks (raw staged through pinned memory, lossless decoded on the host,
    int*/cachegen decoded by the CUDA decoders), laid out on the GPU and on the CPU."""
    model = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=32).to(dtype)
    provider = _provider(codec)
    ids = random_ids(model, 120)
    with torch.inference_mode():
        provider.store(model, ids, model(ids, use_cache=True).past_key_values)
    session = provider.session(model)
    tokens = session.tokens(ids)
    for limit in (96, 75, 120):  # whole chunks, a hit that ends inside one, a stored partial chunk
        cpu, hit = _read(provider, session, tokens, limit, "cpu")
        gpu, hit_gpu = _read(provider, session, tokens, limit, "cuda")
        assert hit == hit_gpu == limit
        for got, want in zip(gpu, cpu):
            assert got.is_cuda and got.shape == want.shape
            assert torch.equal(got.cpu(), want)  # the kernels share the CPU math, without fused multiply-adds


def test_generate_on_the_gpu_hits_and_matches_full_prefill(stories):
    cpu_model, tok = stories
    model = kdn.models.load("stories260k")[0].to("cuda")
    provider = KDN(KDNConfig(chunk_size=32))
    doc = tok("Once upon a time there was a little dog who liked to run in the park. " * 6,
              return_tensors="pt").input_ids
    question = tok(" The dog", return_tensors="pt").input_ids[:, 1:]
    ids = torch.cat([doc, question], dim=1).to("cuda")
    provider.generate(model, doc.to("cuda"), max_new_tokens=1, do_sample=False)
    out = provider.generate(model, ids, max_new_tokens=8, do_sample=False)
    assert provider.last_generate["hit_tokens"] >= 32
    want = cpu_model.generate(ids.cpu(), max_new_tokens=8, do_sample=False)
    assert torch.equal(out.cpu(), want)
    cache, hit = provider.retrieve(model, ids, limit=ids.shape[1] - 1)
    with torch.inference_mode():
        logits = model(ids[:, hit:], past_key_values=cache).logits[0, -1]
    torch.testing.assert_close(logits.cpu(), full_prefill(cpu_model, ids.cpu())[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["naive", "blend"])
def test_blending_on_the_gpu_equals_blending_on_the_cpu(stories, mode):
    """Segments come back onto the device and their keys are re-rotated there (rope_shift's CUDA
    twin); the blended cache equals the CPU one."""
    cpu_model, tok = stories
    gpu_model = kdn.models.load("stories260k")[0].to("cuda")
    segments = [tok(t).input_ids[1:] for t in ("The cat sat on the mat.", "A bird sang in the tall tree.",
                                                "Tom found a red ball under the bed.")]
    query = tok(" Where was the ball?").input_ids[1:]
    caches = []
    for model in (cpu_model, gpu_model):
        provider = KDN(KDNConfig(chunk_size=32))
        provider.store_segments(model, segments)  # the second blend reads every segment back
        cache, stats = provider.blend(model, segments, query, recompute_ratio=0.3, mode=mode)
        assert stats["segment_hits"] == len(segments) + 1
        caches.append(cache_to_kv_list(cache))
    for got, want in zip(caches[1], caches[0]):
        assert got.is_cuda
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["vec", "amx", "packed-LBHNC", "packed-LBNHC", "kv-first", "blocks-first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_copies_on_the_device_equal_the_cpu_oracle_in_every_layout(kind, dtype):
    """paged_copy_cuda (kernels/paged.cu) lays a chunk into GPU blocks and gathers it back bit-equal
    to paged_copy_cpu on the same layout (vLLM's GPU packed layout in both stride orders among them,
    and a tiled one: the CPU 'amx' kernel's, the same index math on the device)."""
    import numpy as np

    from kdn import _core
    from test_paged import describe_layout, element_type, engine_layers

    if element_type(kind, dtype) != dtype:
        pytest.skip(f"the {kind!r} layout holds 16-bit KV")

    layers, heads, dim, block_size, num_blocks = 3, 2, 16, 16, 11
    chunk = torch.randn(layers, 2, 70, heads, dim).to(dtype)
    ids = np.array([7, 2, 9, 0, 4, 10], dtype=np.int64)
    cpu = engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype)
    gpu = engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype, device="cuda")
    layout = describe_layout(kind, cpu[0]).as_dict()
    assert describe_layout(kind, gpu[0]).as_dict() == layout
    _core.paged_copy_cpu(cpu, ids, chunk, 5, 5, 60, False, layout=layout)
    _core.paged_copy_cuda(gpu, ids, chunk.cuda(), 5, 5, 60, False, layout=layout,
                          stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    back = torch.zeros(layers, 2, 70, heads, dim, dtype=dtype, device="cuda")
    _core.paged_copy_cuda(gpu, ids, back, 5, 5, 60, True, layout=layout, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(back[:, :, 5:65].cpu(), chunk[:, :, 5:65])
    with pytest.raises(Exception, match="outside"):  # a block id the kernel would write out of bounds
        _core.paged_copy_cuda(gpu, np.array([0, 99, 1, 2, 3], dtype=np.int64), back, 0, 0, 70, False, layout=layout)
    # a load's chunks in one call (ids uploaded once, one wait): what a call per chunk lays, on both sides
    parts = [torch.randn(layers, 2, n, heads, dim).to(dtype) for n in (32, 32, 20)]
    copies = [(parts[0], 5, 5, 27), (parts[1], 0, 32, 32), (parts[2], 0, 64, 20)]
    for t in cpu + gpu:
        t.zero_()
    _core.paged_copy_chunks_cpu(cpu, ids, copies, False, layout=layout)
    _core.paged_copy_chunks_cuda(gpu, ids, [(c.cuda(), *rest) for c, *rest in copies], False, layout=layout,
                                 stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    with pytest.raises(Exception, match="outside"):  # the third copy's block id: refused, the others ran
        _core.paged_copy_chunks_cuda(gpu, np.array([0, 1, 2, 3, 99], dtype=np.int64),
                                     [(c.cuda(), *rest) for c, *rest in copies], False, layout=layout)


@pytest.mark.parametrize("kind", ["vec", "packed-LBHNC", "packed-LBNHC", "kv-first", "blocks-first"])
@pytest.mark.parametrize("codec", ["raw", "int8", "cachegen"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_blocks_on_the_gpu_receive_and_emit_what_the_cpu_blocks_do(kind, codec, dtype):
    """The connector's target/source (PagedBlocks) on GPU blocks: whole loads from a position on,
    layer groups (layer-wise delivery) and the gather of a save, bit-equal to the same on CPU blocks."""
    from kdn.engine import PagedBlocks
    from test_paged import FP, coded_chunks, describe_layout, engine_layers

    layers, heads, dim, block_size, num_blocks, count, start = 3, 2, 16, 16, 11, 75, 10
    blobs, _ = coded_chunks(dtype, codec, count)
    ids = [7, 2, 9, 0, 4, 10, 1]
    cpu = engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype)
    gpu = engine_layers(kind, layers, num_blocks, heads, block_size, dim, dtype, device="cuda")
    on_cpu = PagedBlocks(cpu, describe_layout(kind, cpu[0]), ids, start)
    on_gpu = PagedBlocks(gpu, describe_layout(kind, gpu[0]), ids, start)
    assert on_gpu.receive(None, blobs, count) == on_cpu.receive(None, blobs, count) == count
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    for t in gpu + cpu:
        t.zero_()
    torch.cuda.synchronize()
    engine_stream = torch.cuda.Stream()  # the engine's stream; layer groups arrive from a delivery thread
    with torch.cuda.stream(engine_stream):
        on_gpu = PagedBlocks(gpu, describe_layout(kind, gpu[0]), ids, start)
    for first, end in ((0, 1), (1, 3)):  # layer groups, as layer-wise delivery sends them
        on_cpu.receive_layers(blobs, first, end, count, layers)
        with ThreadPoolExecutor(1) as delivery:
            delivery.submit(on_gpu.receive_layers, list(blobs), first, end, count, layers).result()  # a new list
    engine_stream.synchronize()
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    assert on_gpu.decodes == 1  # each group's list holds the same chunks: decoded onto the device once
    (first_gpu, kv_gpu), (first_cpu, kv_cpu) = on_gpu.emit(start, count), on_cpu.emit(start, count)
    assert first_gpu == first_cpu == 0 and all(torch.equal(g, c) for g, c in zip(kv_gpu, kv_cpu))
    assert kv_gpu[0].device.type == "cpu" and kv_gpu[0].is_pinned()  # staged in pinned memory for the store
    tail = [(32, 16, bytes([1]) * 16), (48, count - 48, bytes([2]) * 16)]  # a served prompt stores its tail only
    assert [bytes(b) for b in on_gpu.pack(tail, FP)] == [bytes(b) for b in on_cpu.pack(tail, FP)]


def test_raw_chunks_in_page_locked_blocks_go_up_straight_from_the_blob(monkeypatch):
    """Once the pool page-locks its blocks (a CUDA engine asks), a tier's raw blobs are DMA'd to
    the device from where they are, with no host copy, and land as the staged path lays them; a
    blob too small to be pooled (the 44-token tail) takes the host path beside them."""
    from kdn import _core
    from kdn.engine import PagedBlocks, targets
    from kdn.storage.memory import MemoryTier
    from test_paged import FP, describe_layout, engine_layers

    _core.buffer_pool_lock_pages(True)
    layers, heads, dim, block_size, num_blocks, count = 3, 2, 128, 16, 40, 300
    kv = [torch.randn(1, heads, count, dim).to(torch.bfloat16) for _ in range(2 * layers)]
    tier = MemoryTier(1 << 30)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):  # 128 + 128 + 44 tokens: 384 KiB, 384 KiB, 132 KiB
        assert tier.put(key, _core.pack_chunk(kv, 128 * i, min(128, count - 128 * i), FP, key))
    held = tier.get_many(keys)
    assert [_core.host_memory_locked(b) for b in held] == [True, True, False], _core.buffer_pool_stats()
    ids = list(range(num_blocks - 1, -1, -1))[: -(-count // block_size)]
    cpu = engine_layers("kv-first", layers, num_blocks, heads, block_size, dim, torch.bfloat16)
    gpu = engine_layers("kv-first", layers, num_blocks, heads, block_size, dim, torch.bfloat16, device="cuda")
    PagedBlocks(cpu, describe_layout("kv-first", cpu[0]), ids, 5).receive(None, held, count)
    staged, decode = [], targets._core.decode_chunks
    monkeypatch.setattr(targets._core, "decode_chunks", lambda blobs, out: (staged.append(blobs), decode(blobs, out)))
    PagedBlocks(gpu, describe_layout("kv-first", gpu[0]), ids, 5).receive(None, held, count)
    del held  # the uploads hold their blobs until the stream has run them
    torch.cuda.synchronize()
    assert [[bytes(b) for b in blobs] for blobs in staged] == [[bytes(tier.get(keys[2]))]]  # the tail only
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))
    pageable = [bytes(tier.get(k)) for k in keys]  # copies in Python's heap: left to the host path
    out = torch.empty(count * layers * 2 * heads * dim, dtype=torch.bfloat16, device="cuda")
    assert _core.upload_raw_chunks_cuda(pageable, out) == [False, False, False]
    with pytest.raises(ValueError, match="out holds"):
        _core.upload_raw_chunks_cuda(pageable, out[1:])
