"""Blob validation and the host-memory LRU store against a small reference model."""

import collections
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
    assert h == {"codec": 0, "dtype": "float32", "layers": 2, "kv_heads": 2, "head_dim": 8, "tokens": 4,
                 "position": 0, "fingerprint": b"F" * 16, "key": b"K" * 16, "payload_bytes": 2 * 2 * 4 * 2 * 8 * 4}


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


class ReferenceLRU:
    """The eviction model the C++ store must follow."""

    def __init__(self, capacity):
        self.capacity, self.items = capacity, collections.OrderedDict()

    def put(self, key, size):
        self.items.pop(key, None)
        if size > self.capacity:
            return False
        while self.items and sum(self.items.values()) + size > self.capacity:
            self.items.popitem(last=False)
        self.items[key] = size
        return True

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            return True
        return False


def test_lru_matches_reference_model_and_never_exceeds_capacity():
    rng = random.Random(1)
    capacity = 10_000
    store, ref = _core.MemoryStore(capacity), ReferenceLRU(capacity)
    keys = [bytes([i]) * 16 for i in range(40)]
    for step in range(3000):
        key = rng.choice(keys)
        if rng.random() < 0.5:
            size = rng.choice([10, 500, 1500, 4000, 12_000])
            assert store.put(key, bytes([step % 256]) * size) == ref.put(key, size)
        else:
            assert (store.get(key) is not None) == ref.get(key)
        assert store.used_bytes <= capacity
        assert store.used_bytes == sum(ref.items.values())
    assert sorted(k for k in keys if store.contains(k)) == sorted(ref.items)
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["rejected"] > 0 and stats["entries"] == len(ref.items)
    store.clear()
    assert store.used_bytes == 0 and len(store) == 0


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
