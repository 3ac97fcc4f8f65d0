"""KV layout copies (pack/unpack, CPU and CUDA) against a plain torch reference, over a grid."""

import pytest
import torch

from kdn import _core

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [8, 64, 128]
CHUNK_TOKENS = [1, 5, 16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_kv(layers, heads, seq, dim, dtype, device, strided):
    """Fresh random per-layer tensors [1, heads, seq, dim]; optionally non-contiguous views."""
    out = []
    for _ in range(2 * layers):
        if strided:  # a [1, seq, heads, dim] buffer viewed as [1, heads, seq, dim]
            t = torch.randn(1, seq, heads, dim, device=device).to(dtype).transpose(1, 2)
        else:
            t = torch.randn(1, heads, seq, dim, device=device).to(dtype)
        out.append(t)
    return out


def reference_chunk(kv, start, count):
    """Canonical [layers, 2, count, heads, dim] built with plain torch."""
    layers = len(kv) // 2
    per_layer = [torch.stack([kv[2 * i][0, :, start : start + count], kv[2 * i + 1][0, :, start : start + count]])
                 for i in range(layers)]
    return torch.stack(per_layer).transpose(2, 3).contiguous()  # [L, 2, H, T, D] -> [L, 2, T, H, D]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("chunk_tokens", CHUNK_TOKENS)
@pytest.mark.parametrize("strided", [False, True])
def test_copy_round_trip_matches_reference(device, dtype, head_dim, chunk_tokens, strided):
    layers, heads, seq, start = 3, 2, 23, 4
    kv = make_kv(layers, heads, seq, head_dim, dtype, device, strided)
    chunk = torch.empty(layers, 2, chunk_tokens, heads, head_dim, dtype=dtype, device=device)
    copy = _core.kv_copy_cuda if device == "cuda" else _core.kv_copy_cpu
    copy(kv, chunk, chunk_tokens, start, chunk_tokens, True)
    assert torch.equal(chunk, reference_chunk(kv, start, chunk_tokens))
    back = [torch.randn_like(t) for t in kv]
    copy(back, chunk, chunk_tokens, start, chunk_tokens, False)
    for got, want in zip(back, kv):
        assert torch.equal(got[:, :, start : start + chunk_tokens], want[:, :, start : start + chunk_tokens])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_then_unpack_across_chunks(dtype):
    layers, heads, dim, chunk = 2, 3, 16, 8
    kv = make_kv(layers, heads, 3 * chunk, dim, dtype, "cpu", strided=True)
    fp = bytes(16)
    blobs = [_core.pack_chunk(kv, i * chunk, chunk, fp, bytes([i]) * 16) for i in range(3)]
    header = _core.blob_parse(blobs[1])
    assert header["tokens"] == chunk and header["position"] == chunk and header["layers"] == layers
    assert header["dtype"] == str(dtype).removeprefix("torch.")
    count = 2 * chunk + 5  # a hit that ends inside the last chunk
    out = [torch.empty(1, heads, count, dim, dtype=dtype) for _ in kv]
    _core.unpack_chunks(blobs, out, count)
    for got, want in zip(out, kv):
        assert torch.equal(got, want[:, :, :count])


def test_numpy_arrays_work_through_the_buffer_protocol():
    np = pytest.importorskip("numpy")
    kv = [np.random.default_rng(i).standard_normal((1, 2, 6, 4)).astype(np.float32) for i in range(4)]
    blob = _core.pack_chunk(kv, 0, 6, bytes(16), bytes(16))
    out = [np.empty((1, 2, 6, 4), np.float32) for _ in kv]
    _core.unpack_chunks([blob], out, 6)
    for got, want in zip(out, kv):
        np.testing.assert_array_equal(got, want)


def test_bad_tensors_are_clear_errors():
    good = [torch.randn(1, 2, 4, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="unsupported dtype"):
        _core.pack_chunk([t.double() for t in good], 0, 4, bytes(16), bytes(16))
    with pytest.raises(ValueError, match=r"expected shape \[1, kv_heads, seq, head_dim\]"):
        _core.pack_chunk([torch.randn(2, 2, 4, 8)] * 2, 0, 4, bytes(16), bytes(16))
    with pytest.raises(ValueError, match="differs from kv"):
        _core.pack_chunk([good[0], torch.randn(1, 2, 4, 16)], 0, 4, bytes(16), bytes(16))
    with pytest.raises(ValueError, match="even length"):
        _core.pack_chunk(good[:1], 0, 4, bytes(16), bytes(16))
    with pytest.raises(ValueError, match="outside the cache"):
        _core.pack_chunk(good, 2, 4, bytes(16), bytes(16))
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        _core.pack_chunk([torch.randn(1, 2, 8, 4).transpose(2, 3)] * 2, 0, 4, bytes(16), bytes(16))
    with pytest.raises(ValueError, match="expected a torch tensor or numpy array"):
        _core.pack_chunk(["not a tensor", "x"], 0, 4, bytes(16), bytes(16))


def test_the_cuda_copy_refuses_host_tensors_before_touching_the_device():
    """Host pointers handed to the kernel would be a crash: the binding refuses them, with or without
    a GPU and with or without a CUDA build (the build without nvcc is tested in csrc/tests)."""
    with pytest.raises(ValueError, match="kv tensors and chunk must be CUDA tensors"):
        _core.kv_copy_cuda([torch.randn(1, 2, 4, 8)] * 2, torch.empty(1, 2, 4, 2, 8), 4, 0, 4, True)
