"""Blob validation and basic host-memory store behaviour (eviction order: test_eviction.py)."""

import random
import threading

import pytest
import torch

from kdn import BlobError, _core


def make_blob(tokens=4, key=bytes(16), seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(1, 2, tokens, 8, generator=g) for _ in range(4)]
    return _core.pack_chunk(kv, 0, tokens, b"F" * 16, key)


def test_blob_header_round_trip():
    h = _core.blob_parse(make_blob(key=b"K" * 16))
    assert h == {"version": 2, "kind": "kv", "codec": 0, "codec_params": 0, "dtype": "float32", "layers": 2,
                 "kv_heads": 2, "head_dim": 8, "tokens": 4, "position": 0,
                 "fingerprint": b"F" * 16, "key": b"K" * 16, "payload_bytes": 2 * 2 * 4 * 2 * 8 * 4}


def test_every_truncation_and_bit_flip_is_a_clean_error():
    blob = bytes(make_blob())
    for n in range(0, len(blob)):
        with pytest.raises(BlobError):
            _core.blob_parse(blob[:n])
    rng = random.Random(0)
    for _ in range(500):
        damaged = bytearray(blob)
        pos = rng.randrange(len(blob))
        damaged[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(BlobError):
            _core.blob_parse(bytes(damaged))
    with pytest.raises(BlobError, match="bad magic"):
        _core.blob_parse(b"X" * 200)


def test_buffer_outlives_eviction():
    store = _core.MemoryStore(100)
    store.put(b"a" * 16, b"x" * 80)
    held = store.get(b"a" * 16)
    store.put(b"b" * 16, b"y" * 80)  # evicts a
    assert not store.contains(b"a" * 16)
    assert bytes(held) == b"x" * 80


def test_count_prefix_stops_at_first_missing_key():
    store = _core.MemoryStore(1000)
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys[:3] + keys[4:]:
        store.put(k, b"v")
    assert store.count_prefix(keys) == 3


def test_concurrent_puts_and_gets_return_what_was_stored():
    store = _core.MemoryStore(64 * 1024)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(2000):
            i = rng.randrange(64)
            key, value = bytes([i]) * 16, bytes([i]) * (100 + 10 * i)
            if rng.random() < 0.5:
                store.put(key, value)
            else:
                got = store.get(key)
                if got is not None and bytes(got) != value:
                    errors.append(i)
            if store.used_bytes > store.capacity:
                errors.append("capacity")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
