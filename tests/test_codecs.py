"""KV codecs against references: bit-exact lossless, numpy KIVI and cachegen quantizers, the entropy
coder's distance to its model, real-model KV, and the codecs inside the tiers."""

import numpy as np
import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, BlobError, InvalidInputError, KDNConfig, _core, codecs

FP, KEY = b"F" * 16, b"K" * 16
LOSSY = ["int8", "int4", "int2", "int4:group=8", "cachegen:level=1", "cachegen", "cachegen:level=3",
         "cachegen:anchor=1"]


def kv_list(layers=3, heads=2, tokens=40, dim=16, dtype=torch.float32, seed=0):
    """Per-layer KV with KV-like structure: outlier key channels, a heavy first token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(2 * layers):
        t = torch.randn(1, heads, tokens, dim, generator=g)
        if i % 2 == 0:
            t = t * (1 + 8 * torch.rand(1, heads, 1, dim, generator=g)) + 3 * torch.randn(1, heads, 1, dim, generator=g)
        t[:, :, 0] *= 6
        out.append(t.to(dtype))
    return out


def blob_of(kv):
    return _core.pack_chunk(kv, 0, kv[0].shape[2], FP, KEY)


def canonical(kv) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] of a per-layer list."""
    return torch.stack([torch.stack([kv[2 * i], kv[2 * i + 1]]) for i in range(len(kv) // 2)])[:, :, 0].transpose(2, 3)


# -- lossless ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_lossless_is_bit_exact(dtype, tokens):
    kv = kv_list(tokens=tokens, dtype=dtype)
    kv[0][0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    blob = blob_of(kv)
    coded = codecs.encode(blob, "lossless")
    assert codecs.codec_of(coded).name == "lossless"
    back = codecs.encode(coded, "raw")
    assert bytes(back) == bytes(blob)  # header, payload and checksum: the very same blob
    assert canonical(kv).view(torch.uint8).equal(codecs.decode(coded).view(torch.uint8))


def test_lossless_compresses_structured_bf16():
    kv = kv_list(tokens=256, dtype=torch.bfloat16)
    blob = blob_of(kv)
    coded, report = codecs.encode(blob, "lossless", report=True)
    assert len(coded) < 0.85 * len(blob)
    assert report["coded_bytes"] * 8 <= 1.02 * report["model_bits"]


# -- KIVI: numpy reference --------------------------------------------------------------------------
def kivi_reference(x: np.ndarray, values: bool, bits: int, group: int) -> np.ndarray:
    tokens, channels = x.shape
    t, c = np.meshgrid(np.arange(tokens), np.arange(channels), indexing="ij")
    idx = t * -(-channels // group) + c // group if values else (t // group) * channels + c
    n = idx.max() + 1
    lo, hi = np.full(n, np.inf, np.float32), np.full(n, -np.inf, np.float32)
    np.minimum.at(lo, idx, x)
    np.maximum.at(hi, idx, x)
    levels = np.float32(2**bits - 1)
    zero = lo.astype(np.float16).astype(np.float32)
    s = np.maximum(np.float32(0), (hi - zero) / levels).astype(np.float32)
    sh = s.astype(np.float16)
    up = sh.astype(np.float32) < s
    sh[up] = np.nextafter(sh[up], np.float16(np.inf))
    scale = sh.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[idx] > 0, np.rint((x - zero[idx]) / scale[idx]), 0)
    q = np.clip(q, 0, levels).astype(np.float32)
    return q * scale[idx] + zero[idx]


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "int4:group=8", "int2:group=128"])
def test_kivi_matches_numpy_reference(spec):
    codec = codecs.parse(spec)
    bits, group = codec.params & 0xFF, codec.params >> 16
    kv = kv_list(tokens=45)
    decoded = codecs.decode(codecs.encode(blob_of(kv), codec)).numpy()
    x = canonical(kv).numpy()
    for layer in range(x.shape[0]):
        for kind in (0, 1):
            plane = x[layer, kind].reshape(x.shape[2], -1)
            ref = kivi_reference(plane, bool(kind), bits, group)
            np.testing.assert_allclose(decoded[layer, kind].reshape(plane.shape), ref, rtol=1e-6, atol=1e-6)


def test_kivi_error_shrinks_with_bits():
    kv = kv_list(tokens=64)
    x = canonical(kv)
    errors = [float((codecs.decode(codecs.encode(blob_of(kv), s)) - x).norm() / x.norm())
              for s in ("int2", "int4", "int8")]
    assert errors[0] > 3 * errors[1] > 9 * errors[2] > 0


# -- cachegen: numpy reference -----------------------------------------------------------------------
def cachegen_reference(x: np.ndarray, level: int, layer: int, layers: int, values: bool, anchor: bool) -> np.ndarray:
    step, bound = _core.cachegen_step(level, layer, layers, values)
    step = np.float32(step)
    x64 = x.astype(np.float64)
    mean = x64.mean(0)
    std = np.sqrt(np.maximum(0, (x64 * x64).mean(0) - mean * mean))
    offset = mean.astype(np.float16).astype(np.float32)
    scale = np.maximum(std, 1e-4).astype(np.float16).astype(np.float32)
    ref = np.zeros(x.shape[1], np.float32)
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        delta = anchor and t % 8 != 0
        base = ref if delta else np.zeros_like(ref)
        d = (x[t] - offset) / scale - base
        rms = np.float32(np.float16(np.sqrt((d.astype(np.float64) ** 2).sum() / d.size)))
        unit = step * rms
        q = np.clip(np.rint(d / unit), -bound, bound) if unit > 0 else np.zeros_like(d)
        u = base + q.astype(np.float32) * unit
        if not delta:
            ref = u
        out[t] = offset + scale * u
    return out


@pytest.mark.parametrize("spec", ["cachegen:level=1", "cachegen", "cachegen:level=3", "cachegen:anchor=1"])
def test_cachegen_matches_numpy_reference(spec):
    codec = codecs.parse(spec)
    level, anchor = codec.params & 0xFF, bool(codec.params >> 8)
    kv = kv_list(tokens=37)
    decoded = codecs.decode(codecs.encode(blob_of(kv), codec)).numpy()
    x = canonical(kv).numpy()
    layers = x.shape[0]
    for layer in range(layers):
        for kind in (0, 1):
            plane = x[layer, kind].reshape(x.shape[2], -1)
            ref = cachegen_reference(plane, level, layer, layers, bool(kind), anchor)
            got = decoded[layer, kind].reshape(plane.shape)
            close = np.isclose(got, ref, rtol=1e-5, atol=1e-5)
            assert close.mean() > 0.999, f"layer {layer} kind {kind}: {(~close).sum()} values differ"


def test_cachegen_levels_trade_size_for_error_and_code_at_the_model_entropy():
    kv = kv_list(layers=6, tokens=256, heads=2, dim=32)
    blob, x = blob_of(kv), canonical(kv)
    sizes, errors = [], []
    for level in (1, 2, 3):
        coded, report = codecs.encode(blob, f"cachegen:level={level}", report=True)
        sizes.append(len(coded))
        errors.append(float((codecs.decode(coded) - x).norm() / x.norm()))
        # the physical limit: coded bits within 2% of the symbols' cost under the codec's own model
        assert report["coded_bytes"] * 8 <= 1.02 * report["model_bits"]
        assert report["model_bits"] >= report["empirical_bits"]
    assert sizes[0] < sizes[1] < sizes[2] < len(blob) / 4
    assert errors[0] > errors[1] > errors[2]


# -- every codec -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["lossless"] + LOSSY)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_codecs_keep_the_header_and_the_dtype(spec, dtype):
    kv = kv_list(tokens=20, dtype=dtype)
    blob = blob_of(kv)
    coded = codecs.encode(blob, spec)
    h, h0 = _core.blob_parse(coded), _core.blob_parse(blob)
    assert {k: v for k, v in h.items() if k not in ("codec", "codec_params", "payload_bytes", "key")} == \
           {k: v for k, v in h0.items() if k not in ("codec", "codec_params", "payload_bytes", "key")}
    # lossy KV is filed under its own key, exact codecs keep the chunk's key
    assert h["key"] == (codecs.address(h0["key"], spec) if codecs.parse(spec).lossy else h0["key"])
    assert (h["key"] != h0["key"]) == codecs.parse(spec).lossy
    assert _core.blob_parse(codecs.encode(coded, "raw"))["key"] == h["key"]  # decoding keeps the lossy key
    assert codecs.codec_of(coded) == codecs.parse(spec)
    out = codecs.decode(coded)
    assert out.dtype == dtype and out.shape == canonical(kv).shape
    assert codecs.encode(coded, spec) is coded  # already in that codec: no work


@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_codecs_refuse_non_finite_kv(spec):
    kv = kv_list(tokens=8)
    kv[1][0, 0, 3, 2] = float("nan")
    with pytest.raises(InvalidInputError, match="finite"):
        codecs.encode(blob_of(kv), spec)


def test_real_model_kv_round_trips(stories):
    model, tok = stories
    ids = random_ids(model, 256, seed=1)
    _, cache = full_prefill(model, ids)
    from kdn.layout import cache_to_kv_list

    kv = cache_to_kv_list(cache)
    blob, x = blob_of(kv), canonical(kv)
    assert codecs.decode(codecs.encode(blob, "lossless")).equal(x)
    for spec, bound in (("int8", 0.01), ("int4", 0.15), ("cachegen:level=3", 0.1), ("cachegen", 0.15)):
        err = float((codecs.decode(codecs.encode(blob, spec)) - x).norm() / x.norm())
        assert 0 < err < bound, (spec, err)


# -- codecs in the tiers -------------------------------------------------------------------------------
def test_memory_lossless_serves_full_prefill_logits_and_holds_less(tiny_llama):
    ids = random_ids(tiny_llama, 33, seed=2)
    reference, cache = full_prefill(tiny_llama, ids)
    plain, coded = KDN(KDNConfig(chunk_size=8)), KDN(KDNConfig(chunk_size=8, memory_codec="lossless"))
    for k in (plain, coded):
        k.store(tiny_llama, ids, cache)
        got, hit = k.retrieve(tiny_llama, ids, limit=32)
        assert hit == 32
        with torch.inference_mode():
            logits = tiny_llama(ids[:, hit:], past_key_values=got).logits[0, -1]
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    assert coded.stats()["memory"]["used_bytes"] < plain.stats()["memory"]["used_bytes"]


def test_disk_codec_writes_coded_files_and_promotes_raw(tiny_llama, tmp_path):
    ids = random_ids(tiny_llama, 40, seed=4)
    reference, cache = full_prefill(tiny_llama, ids)
    config = KDNConfig(chunk_size=8, disk_dir=str(tmp_path), disk_codec="cachegen:level=3")
    first = KDN(config)
    first.store(tiny_llama, ids, cache)
    first.flush()
    files = sorted(tmp_path.glob("*/*.kdnb"))
    assert len(files) == 5
    assert all(codecs.codec_of(f.read_bytes()).spec == "cachegen:level=3" for f in files)
    second = KDN(config)
    got, hit = second.retrieve(tiny_llama, ids, limit=39)
    assert hit == 39
    key = second.chunk_keys(tiny_llama, ids[0].tolist())[0]
    assert second.memory.get(key) is None  # lossy KV never sits under the exact key
    promoted = second.memory.get(codecs.address(key, "cachegen:level=3"))
    assert codecs.codec_of(promoted).name == "raw"  # decoded for memory on promotion, still filed as lossy
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=got).logits[0, -1]
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="sum")
    assert 0 < float(kl) < 0.05


def test_disk_tier_counts_a_chunk_its_codec_cannot_take(tmp_path):
    from kdn.storage import DiskTier

    tier = DiskTier(str(tmp_path), 1 << 30, codec="int4")
    kv = kv_list(tokens=8)
    kv[0][0, 0, 0, 0] = float("inf")
    assert tier.put(KEY, blob_of(kv)) is True  # queued
    tier.flush()
    assert tier.stats()["errors"] == 1 and not tier.contains(KEY)
    assert "encode" in tier.stats()["last_error"]


def test_a_coded_payload_that_fails_to_decode_is_a_miss(tiny_llama, caplog):
    ids = random_ids(tiny_llama, 17, seed=5)
    _, cache = full_prefill(tiny_llama, ids)
    kdn = KDN(KDNConfig(chunk_size=8, memory_codec="lossless", delivery="whole"))
    kdn.store(tiny_llama, ids, cache)
    key = kdn.chunk_keys(tiny_llama, ids[0].tolist())[0]
    bad = bytearray(kdn.memory.get(key))
    bad[80 + _core.blob_parse(bad)["payload_bytes"] - 12] ^= 0xFF  # inside the last rANS lane...
    _core.blob_reseal(bad)  # ...with a valid checksum: only the decoder can notice
    kdn.memory.remove(key)
    kdn.memory.put(key, bytes(bad))
    with caplog.at_level("WARNING", logger="kdn"):
        got, hit = kdn.retrieve(tiny_llama, ids)
    assert (got, hit) == (None, 0)
    assert "undecodable" in caplog.text and not kdn.memory.contains(key)
    with pytest.raises(BlobError):
        codecs.decode(bytes(bad))


def test_decode_chunks_writes_each_chunk_canonically_one_after_the_other():
    """The host half of a copy to a device: raw, lossless and lossy chunks, each decoded in place."""
    blobs = [codecs.encode(blob_of(kv_list(tokens=t, seed=t)), spec)
             for t, spec in ((16, "raw"), (9, "lossless"), (16, "int4"), (5, "cachegen:level=3"))]
    out = torch.empty(sum(codecs.decode(b).numel() for b in blobs))
    _core.decode_chunks(blobs, out)
    assert torch.equal(out, torch.cat([codecs.decode(b).reshape(-1) for b in blobs]))
    with pytest.raises(InvalidInputError, match="out holds"):
        _core.decode_chunks(blobs, out[:-1])


# -- CUDA decoders (same math as the CPU decoders; run where a GPU exists) ---------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_decoder_matches_the_cpu_decoder():
    for spec in LOSSY:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            coded = codecs.encode(blob_of(kv_list(tokens=45, dtype=dtype)), spec)
            cpu = codecs.decode(coded)
            out = torch.empty(cpu.shape, dtype=dtype, device="cuda")
            _core.codec_decode_cuda(coded, out)
            assert torch.equal(out.cpu(), cpu)  # same KDN_HD math, built without fused multiply-adds
            if codecs.parse(spec).name == "cachegen":  # a corrupt lane: reported exactly when the CPU reports it
                refused = 0
                for at in range(-220, -16, 9):
                    bad = bytearray(coded)
                    bad[at] ^= 0xFF
                    _core.blob_reseal(bad)
                    try:
                        want = codecs.decode(bytes(bad))
                    except BlobError:
                        refused += 1
                        with pytest.raises(BlobError, match="corrupt"):
                            _core.codec_decode_cuda(bytes(bad), out)
                        continue
                    _core.codec_decode_cuda(bytes(bad), out)
                    assert torch.equal(out.cpu(), want)
                assert refused  # the sweep reached the entropy-coded lanes


def test_the_cuda_decoder_refuses_a_host_destination_before_touching_the_device():
    coded = codecs.encode(blob_of(kv_list(tokens=8)), "int4")
    with pytest.raises(InvalidInputError, match="out must be a contiguous writable CUDA tensor"):
        _core.codec_decode_cuda(coded, torch.empty(3, 2, 8, 2, 16))
