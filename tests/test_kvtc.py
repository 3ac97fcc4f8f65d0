"""The kvtc transform codec: its decoder against a numpy model of the codec, sizes and errors on real
KV, calibrations through the tiers, and a chunk whose calibration is missing served as a miss."""

import struct

import numpy as np
import pytest
import torch

import kdn
from kdn import KDN, BlobError, InvalidInputError, KDNConfig, _core, codecs, kvtc
from kdn.layout import cache_to_kv_list

FP = b"F" * 16
LAYERS, HEADS, DIM, TOKENS = 2, 2, 8, 64


def synthetic_planes(rows: int, seed: int) -> list[np.ndarray]:
    """Correlated rows (a low-rank part plus noise) for each of 2 * LAYERS planes."""
    g = np.random.default_rng(seed)
    mix = np.random.default_rng(0).normal(size=(2 * LAYERS, 4, HEADS * DIM))
    return [g.normal(size=(rows, 4)) @ mix[p] + 0.1 * g.normal(size=(rows, HEADS * DIM)) + p
            for p in range(2 * LAYERS)]


def rope_angles(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    angle = positions[:, None].astype(np.float64) * inv_freq.astype(np.float32).astype(np.float64)[None]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate(rows: np.ndarray, cos, sin, sign: float) -> np.ndarray:
    """Rotate-half RoPE of rows [tokens, heads * DIM] by the given angles (sign -1: backwards)."""
    x = rows.reshape(len(rows), HEADS, DIM)
    a, b = x[..., : DIM // 2], x[..., DIM // 2:]
    c, s = cos[:, None], sign * sin[:, None]
    return np.concatenate([a * c - b * s, b * c + a * s], -1).reshape(rows.shape)


def parse_calibration(data: bytes) -> dict:
    _, _, _, layers, channels, head_dim, comps, n_ratios, flags = struct.unpack_from("<4sI16s6I", data)
    at = struct.calcsize("<4sI16s6I")
    inv_freq = np.frombuffer(data, "<f4", head_dim // 2, at)
    at += 2 * head_dim
    ratios = list(np.frombuffer(data, "<u4", n_ratios, at))
    at += 4 * n_ratios
    planes = []
    for _ in range(2 * layers):
        mean = np.frombuffer(data, "<f4", channels, at)
        basis = np.frombuffer(data, "<f4", comps * channels, at + 4 * channels).reshape(comps, channels)
        at += 4 * channels * (1 + comps)
        steps = np.frombuffer(data, "<f4", n_ratios * comps, at).reshape(n_ratios, comps)
        at += 4 * n_ratios * comps
        planes.append((mean, basis, steps))
    assert at == len(data)
    return {"inv_freq": inv_freq, "ratios": ratios, "planes": planes, "prerope": bool(flags & 1)}


def reference_decode(cal: dict, kv: np.ndarray, ratio: int, position: int, sink: int, recent: int) -> np.ndarray:
    """The codec in numpy: project, quantize, reconstruct (keys pre-RoPE); exact rows kept."""
    out = np.empty_like(kv)
    positions = position + np.arange(TOKENS)
    cos, sin = rope_angles(cal["inv_freq"], positions)
    exact = (positions < sink) | (np.arange(TOKENS) >= TOKENS - recent)
    for p, (mean, basis, steps) in enumerate(cal["planes"]):
        x = kv[p // 2, p % 2].reshape(TOKENS, -1).astype(np.float64)
        keys = p % 2 == 0 and cal["prerope"]
        if keys:
            x = rotate(x.astype(np.float32), cos, sin, -1.0).astype(np.float64)
        step = steps[cal["ratios"].index(ratio)].astype(np.float64)
        coded = step > 0
        z = (x - mean) @ basis[coded].T.astype(np.float64)
        q = np.clip(np.rint(z / step[coded]), -127, 127)
        y = mean + (q * step[coded]) @ basis[coded].astype(np.float64)
        if keys:
            y = rotate(y.astype(np.float32), cos, sin, 1.0)
        y = y.reshape(TOKENS, HEADS, DIM)
        y[exact] = kv[p // 2, p % 2][exact]
        out[p // 2, p % 2] = y
    return out


def synthetic_blob(position: int, seed: int = 3):
    rows = synthetic_planes(TOKENS, seed)
    kv = [torch.from_numpy(r.astype(np.float32)).view(1, TOKENS, HEADS, DIM).transpose(1, 2).contiguous()
          for r in rows]
    return _core.pack_chunk(kv, 0, TOKENS, FP, b"K" * 16) if position == 0 else _pack_at(kv, position)


def _pack_at(kv, position):
    padded = [torch.cat([torch.zeros(1, HEADS, position, DIM), t], 2) for t in kv]
    return _core.pack_chunk(padded, position, TOKENS, FP, b"K" * 16)


@pytest.fixture
def synthetic_calibration():
    inv_freq = 1.0 / (10000 ** (np.arange(0, DIM, 2) / DIM))
    cal = kvtc.fit(synthetic_planes(2000, 1), FP, DIM, inv_freq=inv_freq, ratios=(3, 6))
    kvtc.load(cal)
    yield cal
    _core.kvtc_unload_all()


@pytest.mark.parametrize("position,spec", [(0, "kvtc:ratio=3"), (0, "kvtc:ratio=6,recent=5"),
                                           (100, "kvtc:ratio=6,sink=0")])
def test_decode_matches_a_numpy_model_of_the_codec(synthetic_calibration, position, spec):
    blob = synthetic_blob(position)
    kv = codecs.decode(blob).numpy()
    coded = codecs.encode(blob, spec)
    c = codecs.parse(spec)
    opts = dict(c.options)
    got = codecs.decode(coded).numpy()
    want = reference_decode(parse_calibration(synthetic_calibration), kv, opts["ratio"], position, opts["sink"],
                            opts["recent"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    exact = (position + np.arange(TOKENS) < opts["sink"]) | (np.arange(TOKENS) >= TOKENS - opts["recent"])
    assert np.array_equal(got[:, :, exact], kv[:, :, exact])  # sink and recent rows bit-exact
    assert codecs.codec_of(coded) == c and len(coded) < len(blob)
    assert _core.kvtc_blob_calibration(coded) == _core.blake3(synthetic_calibration, 16)


def test_encoding_without_a_calibration_says_how_to_get_one():
    blob = synthetic_blob(0)
    with pytest.raises(InvalidInputError, match="no calibration is loaded for this model"):
        codecs.encode(blob, "kvtc")
    with pytest.raises(InvalidInputError, match="options: ratio"):
        codecs.parse("kvtc:bits=2")
    with pytest.raises(InvalidInputError, match="out of range"):
        codecs.parse("kvtc:sink=300")


def test_a_payload_whose_calibration_is_not_loaded_never_decodes(synthetic_calibration):
    coded = codecs.encode(synthetic_blob(0), "kvtc:ratio=6")
    _core.kvtc_unload_all()
    with pytest.raises(BlobError, match="corrupt"):
        codecs.decode(coded)
    other = kvtc.fit(synthetic_planes(2000, 9), FP, DIM, ratios=(8,))  # another calibration of the model
    kvtc.load(other)
    with pytest.raises(BlobError):  # not decoded against a calibration it was not coded under
        codecs.decode(coded)
    kvtc.load(synthetic_calibration)
    assert codecs.decode(coded).shape == (LAYERS, 2, TOKENS, HEADS, DIM)


def test_damaged_or_foreign_calibrations_are_refused(synthetic_calibration):
    key = kvtc.calibration_key(FP)
    blob = bytearray(_core.kvtc_pack(FP, key, synthetic_calibration))
    assert _core.kvtc_load_blob(bytes(blob), FP, key) == _core.blake3(synthetic_calibration, 16)
    with pytest.raises(BlobError, match="another model"):
        _core.kvtc_load_blob(bytes(blob), b"G" * 16, key)
    blob[200] ^= 1
    with pytest.raises(BlobError, match="checksum"):
        _core.kvtc_load_blob(bytes(blob), FP, key)
    with pytest.raises(InvalidInputError, match="another model"):
        _core.kvtc_pack(b"G" * 16, key, synthetic_calibration)
    for bad in (b"", b"KVTC" + bytes(60), synthetic_calibration[:-4]):
        with pytest.raises(InvalidInputError, match="kvtc calibration"):
            kvtc.load(bad)
    assert _core.blob_parse(_core.kvtc_pack(FP, key, synthetic_calibration))["kind"] == "calibration"


@pytest.fixture(scope="module")
def stories():
    model, tokenizer = kdn.models.load("stories260k")
    ids = tokenizer(_velmora())["input_ids"]
    return model, ids


def _velmora() -> str:
    from importlib.resources import files

    return files("kdn.data").joinpath("velmora.txt").read_text()


def kv_of(model, ids):
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    kv = [t.clone() for t in cache_to_kv_list(out.past_key_values)]
    return tuple(zip(kv[0::2], kv[1::2]))


def test_on_real_kv_a_higher_ratio_is_smaller_and_less_exact(stories):
    model, ids = stories
    cal = kvtc.calibrate(model, [ids[256 * i:256 * (i + 1)] for i in range(1, 6)], progress=False)
    kvtc.load(cal)
    try:
        store = KDN(KDNConfig(chunk_size=256))
        store.store(model, ids[:256], kv_of(model, ids[:256]))
        blob = store.memory.get(store.chunk_keys(model, ids[:256])[0])
        exact = codecs.decode(blob)
        sizes, errors = [], []
        for ratio in (4, 8, 16):
            coded = codecs.encode(blob, f"kvtc:ratio={ratio}")
            sizes.append(len(coded))
            errors.append(float((codecs.decode(coded) - exact).norm() / exact.norm()))
        assert sizes[0] > sizes[1] > sizes[2] and errors[0] < errors[1] < errors[2]
        assert errors[0] < 0.03 and errors[2] < 0.2
        assert sizes[1] < len(codecs.encode(blob, "cachegen"))  # smaller than cachegen's default level
    finally:
        _core.kvtc_unload_all()


def test_missing_calibration_is_a_miss_and_the_calibration_travels_through_the_tiers(stories, tmp_path):
    model, ids = stories
    ctx = ids[:512]
    config = KDNConfig(chunk_size=256, disk_dir=str(tmp_path), disk_codec="kvtc:ratio=6", write_policy="write-through")
    writer = KDN(config)
    writer.calibrate(model, [ids[512:768], ids[768:1024]], progress=False)
    writer.store(model, ctx, kv_of(model, ctx))
    writer.flush()
    _core.kvtc_unload_all()
    # another process on this machine: the calibration is read from the disk tier with the chunks
    reader = KDN(KDNConfig(chunk_size=256, disk_dir=str(tmp_path), disk_codec="kvtc:ratio=6"))
    cache, hit = reader.retrieve(model, ctx, limit=512)
    assert hit == 512 and _core.kvtc_model_calibration(reader.session(model).fingerprint) is not None
    served = torch.stack([torch.stack([layer.keys, layer.values]) for layer in cache.layers])
    reference = torch.stack([torch.stack(pair) for pair in kv_of(model, ctx)])
    assert float((served - reference).norm() / reference.norm()) < 0.1
    # the calibration gone from the tiers and from the process: the chunks are a miss, never wrong KV
    _core.kvtc_unload_all()
    fresh = KDN(KDNConfig(chunk_size=256, disk_dir=str(tmp_path), disk_codec="kvtc:ratio=6"))
    fresh.engine.calibrations.drop(fresh.session(model))  # every tier
    _core.kvtc_unload_all()
    assert fresh.retrieve(model, ctx)[1] == 0
    assert all(fresh.disk.contains(codecs.address(k, "kvtc:ratio=6")) for k in fresh.chunk_keys(model, ctx))
    writer.calibrate(model, [ids[512:768], ids[768:1024]], progress=False)  # the same fit again
    assert fresh.retrieve(model, ctx, limit=512)[1] == 512
    _core.kvtc_unload_all()


def pruned_blob(per_layer: list[torch.Tensor], seed: int = 5) -> tuple[bytes, np.ndarray]:
    """A chunk of ``per_layer`` KV with about half of its (layer, token, KV head) rows zeroed in K
    and V alike (what a kvzip deposit stores for a codec with per-head bases), and that mask
    ``[layers, tokens, heads]``."""
    dropped = np.random.default_rng(seed).random((LAYERS, TOKENS, HEADS)) < 0.5
    keep = torch.from_numpy(~dropped).permute(0, 2, 1)[:, None, :, :, None]  # [layers, 1, heads, tokens, 1]
    zeroed = [t * keep[i // 2].to(t.dtype) for i, t in enumerate(per_layer)]
    return _core.pack_chunk(zeroed, 0, TOKENS, FP, b"P" * 16), dropped


def per_layer_of(blob) -> list[torch.Tensor]:
    kv = codecs.decode(blob)  # [layers, 2, tokens, heads, dim]
    return [kind[None].transpose(1, 2).contiguous() for layer in kv for kind in layer]


def test_per_head_bases_code_each_kv_head_row_on_its_own():
    inv_freq = 1.0 / (10000 ** (np.arange(0, DIM, 2) / DIM))
    cal = kvtc.fit(synthetic_planes(2000, 1), FP, DIM, inv_freq=inv_freq, ratios=(3,), per_head=True)
    assert kvtc.per_head(cal) and not kvtc.per_head(kvtc.fit(synthetic_planes(200, 1), FP, DIM, ratios=(3,)))
    basis = parse_calibration(cal)["planes"][0][1]
    assert not basis[:DIM, DIM:].any() and not basis[DIM:, :DIM].any()  # block-diagonal
    kvtc.load(cal)
    try:
        whole = synthetic_blob(0)
        blob, dropped = pruned_blob(per_layer_of(whole))
        coded = codecs.encode(blob, "kvtc:ratio=3")
        got = codecs.decode(coded).numpy()
        opts = dict(codecs.parse("kvtc:ratio=3").options)
        want = reference_decode(parse_calibration(cal), codecs.decode(blob).numpy(), 3, 0, opts["sink"], opts["recent"])
        gone = np.broadcast_to(dropped[:, None, :, :, None], want.shape)
        want[gone] = 0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # held rows: the numpy model of the codec
        assert not got[gone].any()  # dropped rows decode as zeros
        # a dropped row costs a bit: the pruned chunk codes in well under the whole one's bytes
        assert len(coded) < 0.75 * len(codecs.encode(whole, "kvtc:ratio=3"))
        # a corrupt presence bit is caught (the lanes no longer end where they should), never wrong KV
        bad = bytearray(coded)
        bits_at = 80 + 8 * LAYERS + 16 + int((parse_calibration(cal)["planes"][0][2][0] > 0).sum())  # plane 0's
        bad[bits_at + 3] ^= 0x10
        _core.blob_reseal(bad)  # a valid checksum: only the decoder can notice
        with pytest.raises(BlobError):
            codecs.decode(bytes(bad))
    finally:
        _core.kvtc_unload_all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_batch_leaves_per_head_chunks_to_the_host_decoder(synthetic_calibration):
    inv_freq = 1.0 / (10000 ** (np.arange(0, DIM, 2) / DIM))
    whole = synthetic_blob(0)
    cal = kvtc.fit(synthetic_planes(2000, 2), b"Q" * 16, DIM, inv_freq=inv_freq, ratios=(3,), per_head=True)
    kvtc.load(cal)
    per_layer = per_layer_of(whole)
    blobs = [codecs.encode(whole, "kvtc:ratio=3"),  # the joint calibration of FP
             codecs.encode(_core.pack_chunk(per_layer, 0, TOKENS, b"Q" * 16, b"P" * 16), "kvtc:ratio=3")]
    outs = [torch.empty(codecs.decode(b).shape, dtype=torch.float32, device="cuda") for b in blobs]
    _core.codec_decode_cuda_many(blobs, outs)
    assert all(torch.equal(o.cpu(), codecs.decode(b)) for o, b in zip(outs, blobs))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_decoder_matches_the_cpu_decoder(synthetic_calibration, dtype):
    blobs = []
    for position, spec in ((0, "kvtc:ratio=3,recent=5"), (100, "kvtc:ratio=6"), (7, "int4")):
        kv = codecs.decode(synthetic_blob(position))
        per_layer = [kind[None].transpose(1, 2).to(dtype).contiguous() for layer in kv for kind in layer]
        if position:
            per_layer = [torch.cat([torch.zeros(1, HEADS, position, DIM, dtype=dtype), t], 2) for t in per_layer]
        coded = codecs.encode(_core.pack_chunk(per_layer, position, TOKENS, FP, b"K" * 16), spec)
        cpu = codecs.decode(coded)
        out = torch.empty(cpu.shape, dtype=dtype, device="cuda")
        _core.codec_decode_cuda(coded, out)
        assert torch.equal(out.cpu(), cpu)  # same KDN_HD math and summation order, no fused multiply-adds
        blobs.append(coded)
    # a batch (the kvtc chunks in one launch pair, partial chunks among them: one ending inside a
    # tile of rows, its recent rows exact across the tile's edge) gives the same bits
    blobs.append(codecs.encode(_core.pack_chunk(per_layer, position, TOKENS // 2, FP, b"H" * 16), "kvtc:ratio=6"))
    blobs.append(codecs.encode(_core.pack_chunk(per_layer, position, TOKENS // 2 + 3, FP, b"J" * 16),
                               "kvtc:ratio=3,recent=5"))
    outs = [torch.empty(codecs.decode(b).shape, dtype=dtype, device="cuda") for b in blobs]
    _core.codec_decode_cuda_many(blobs, outs)
    assert all(torch.equal(o.cpu(), codecs.decode(b)) for o, b in zip(outs, blobs))
    _core.kvtc_unload_all()
    with pytest.raises(BlobError, match="calibration is not loaded"):  # the device copy is no way around it
        _core.codec_decode_cuda_many(blobs[:2], outs[:2])
