"""Decoders never trust their input: 10,000 random, truncated, bit-flipped and re-labelled payloads per
codec (checksum re-sealed so that they reach the decoder) must each decode or raise BlobError."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn import BlobError, _core, codecs, kvtc

SPECS = ["lossless", "int8", "int4", "int2", "cachegen:level=1", "cachegen:level=3,anchor=1",
         "kvtc:ratio=4,recent=3"]
HEADER, TRAILER = 80, 8
# a kvtc calibration of the fuzzed blobs' "model" (2 layers, 2 heads of 8 channels, keys pre-RoPE)
CALIBRATION = kvtc.fit([np.random.default_rng(p).normal(size=(500, 16)) for p in range(4)], b"F" * 16, 8,
                       inv_freq=1.0 / 10000 ** (np.arange(0, 8, 2) / 8), ratios=(4,))
# and one with per-head bases, for a "model" of fingerprint H, whose blobs hold zeroed head rows
PER_HEAD = kvtc.fit([np.random.default_rng(p).normal(size=(500, 16)) for p in range(4)], b"H" * 16, 8,
                    inv_freq=1.0 / 10000 ** (np.arange(0, 8, 2) / 8), ratios=(4,), per_head=True)
MASKED = "kvtc:ratio=4,recent=3 (per-head bases, pruned rows)"


def load_calibrations():
    kvtc.load(CALIBRATION)
    kvtc.load(PER_HEAD)


load_calibrations()


def base_blob(spec: str) -> bytes:
    g = torch.Generator().manual_seed(7)
    kv = [torch.randn(1, 2, 24, 8, generator=g).to(torch.float16) for _ in range(4)]
    if spec == MASKED:
        held = (torch.rand(2, 2, 24, generator=g) < 0.5).to(torch.float16)[:, None, :, :, None]
        kv = [t * held[i // 2, 0] for i, t in enumerate(kv)]
        return bytes(codecs.encode(_core.pack_chunk(kv, 0, 24, b"H" * 16, b"K" * 16), "kvtc:ratio=4,recent=3"))
    return bytes(codecs.encode(_core.pack_chunk(kv, 0, 24, b"F" * 16, b"K" * 16), spec))


BASES = {spec: base_blob(spec) for spec in SPECS + [MASKED]}
_PARAMS = [(c.id, c.params) for c in map(codecs.parse, SPECS)]

mutations = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 7)), min_size=1, max_size=8)),
    st.tuples(st.just("random"), st.binary(max_size=2048)),
    st.tuples(st.just("splice"), st.tuples(st.integers(0, 1 << 16), st.binary(min_size=1, max_size=64))),
    st.tuples(st.just("relabel"), st.sampled_from(_PARAMS)),
)


def mutate(blob: bytes, mutation) -> bytearray:
    header, payload = bytearray(blob[:HEADER]), bytearray(blob[HEADER:-TRAILER])
    kind, arg = mutation
    if kind == "truncate":
        payload = payload[: arg % (len(payload) + 1)]
    elif kind == "flip":
        for pos, bit in arg:
            payload[pos % len(payload)] ^= 1 << bit
    elif kind == "random":
        payload = bytearray(arg)
    elif kind == "splice":
        pos, data = arg
        pos %= len(payload)
        payload[pos:pos + len(data)] = data
    else:  # another codec's decoder on this payload
        header[8] = arg[0]
        header[32:36] = struct.pack("<I", arg[1])
    header[68:76] = struct.pack("<Q", len(payload))
    out = header + payload + bytes(TRAILER)
    _core.blob_reseal(out)
    return out


@pytest.mark.slow  # ~18 s per codec: CI runs it; `-m "not slow"` (the inner loop) leaves it out
@pytest.mark.parametrize("spec", SPECS + [MASKED])
def test_decoder_survives_10000_corrupt_payloads(spec):
    load_calibrations()  # other tests unload calibrations
    base = BASES[spec]
    outcomes = {"decoded": 0, "rejected": 0}

    @settings(max_examples=10_000, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutations)
    def check(mutation):
        blob = mutate(base, mutation)
        try:
            out = _core.transcode(blob, 0, 0)
        except BlobError:
            outcomes["rejected"] += 1
            return
        outcomes["decoded"] += 1
        assert len(out) == HEADER + _core.blob_parse(out)["payload_bytes"] + TRAILER

    check()
    assert sum(outcomes.values()) >= 10_000
    assert outcomes["rejected"] > 0
