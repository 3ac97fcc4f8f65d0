"""Memory-tier eviction (LRU, S3-FIFO), pins with TTL and memory accounting against reference models."""

import os
import random
import time

import pytest

from kdn import InvalidInputError, _core
from policy_models import ReferenceTier

POLICIES = ["lru", "s3fifo"]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eviction_order_matches_reference_model(policy, seed):
    rng = random.Random(seed)
    capacity = 20_000
    store, ref = _core.MemoryStore(capacity, policy), ReferenceTier(capacity, policy)
    hot = list(range(8))
    for step in range(4000):
        i = rng.choice(hot) if rng.random() < 0.6 else rng.randrange(200)  # hot set + a long tail
        op = rng.random()
        if op < 0.45:
            size = rng.choice([100, 700, 1500, 3000])
            assert store.put(key(i), bytes(size)) == ref.put(i, size), step
        elif op < 0.9:
            assert (store.get(key(i)) is not None) == ref.get(i), step
        elif op < 0.95:
            assert store.pin(key(i)) == ref.pin(i)
        else:
            assert store.unpin(key(i)) == ref.unpin(i)
        assert store.used_bytes == ref.used <= capacity, step
    assert sorted(k for k in range(200) if store.contains(key(k))) == sorted(ref.sizes)
    assert store.stats()["evictions"] > 100


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_entries_are_never_evicted_and_too_big_puts_are_refused(policy):
    store = _core.MemoryStore(1000, policy)
    store.put(key(0), bytes(600))
    assert store.pin(key(0)) and not store.pin(key(99))
    for i in range(1, 50):
        assert store.put(key(i), bytes(300))
        assert store.contains(key(0)) and store.used_bytes <= 1000
    assert not store.put(key(100), bytes(500))  # cannot fit beside the 600 pinned bytes
    assert store.contains(key(49)), "a refused put must not evict anything"
    assert store.stats()["pinned_bytes"] == 600 and store.stats()["rejected"] == 1
    assert store.unpin(key(0))
    assert store.put(key(100), bytes(900)) and not store.contains(key(0))


def test_pin_ttl_expires():
    store = _core.MemoryStore(1000)
    store.put(key(0), bytes(800))
    store.pin(key(0), ttl_seconds=0.05)
    assert not store.put(key(1), bytes(800))  # pinned: refused
    time.sleep(0.1)
    assert store.put(key(1), bytes(800)) and not store.contains(key(0))
    assert store.stats()["pinned_entries"] == 0


def test_s3fifo_resists_a_scan_that_flushes_lru():
    """Hot keys hit repeatedly, then one pass over many new keys, then the hot keys again."""
    hits = {}
    for policy in POLICIES:
        store = _core.MemoryStore(100 * 100, policy)
        hot = range(50)
        for _ in range(3):
            for i in hot:
                if store.get(key(i)) is None:
                    store.put(key(i), bytes(100))
        for i in range(1000, 1300):  # the scan, each key once
            store.put(key(i), bytes(100))
        hits[policy] = sum(store.get(key(i)) is not None for i in hot)
    assert hits["lru"] == 0 and hits["s3fifo"] == 50, hits


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_returns_to_zero_after_clear_and_held_buffers_stay_valid(policy):
    base = _core.buffer_live_bytes()
    store = _core.MemoryStore(1 << 20, policy)
    for i in range(20):
        store.put(key(i), bytes([i]) * 10_000)
    assert _core.buffer_live_bytes() - base == 200_000
    held = store.get(key(3))
    store.clear()
    assert store.used_bytes == 0 and len(store) == 0
    assert bytes(held) == bytes([3]) * 10_000  # a reader's reference outlives clear()
    assert _core.buffer_live_bytes() - base == 10_000
    del held
    assert _core.buffer_live_bytes() == base


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(InvalidInputError, match="unknown eviction policy 'fifo'.*lru or s3fifo"):
        _core.MemoryStore(100, "fifo")
    assert _core.eviction_policies() == POLICIES


def test_buffer_pool_reuses_freed_blocks_within_its_limit():
    _core.buffer_pool_trim()
    before = _core.buffer_pool_stats()
    blocks = [_core.Buffer(bytes(1 << 20)) for _ in range(4)]
    del blocks
    after_free = _core.buffer_pool_stats()
    assert after_free["idle_blocks"] == 4 and after_free["idle_bytes"] == 4 << 20
    again = _core.Buffer(bytes(1 << 20))
    assert _core.buffer_pool_stats()["reused"] == before["reused"] + 1 and bytes(again) == bytes(1 << 20)
    _core.buffer_pool_set_limit(1 << 20)  # shrinking the limit frees the idle blocks above it
    assert _core.buffer_pool_stats()["idle_bytes"] <= 1 << 20
    _core.buffer_pool_set_limit(before["limit_bytes"])
    _core.buffer_pool_trim()
    assert _core.buffer_pool_stats()["idle_bytes"] == 0


def test_page_locking_without_a_device_is_refused_once_and_leaves_blocks_usable():
    """On a GPU engine the pool page-locks its blocks (hits then upload straight from the blobs);
    without a CUDA device (or a CUDA build) the first refusal turns it off: nothing else changes."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device locks the blocks (test_gpu.py checks what it uploads)")
    before = _core.buffer_pool_stats()
    _core.buffer_pool_lock_pages(True)
    blob = _core.Buffer(bytes(range(256)) * 4096)
    after = _core.buffer_pool_stats()
    assert after["lock_failures"] == before["lock_failures"] + 1 and after["locked_blocks"] == 0
    assert not _core.host_memory_locked(blob) and bytes(blob) == bytes(range(256)) * 4096
    _core.Buffer(bytes(1 << 20))
    assert _core.buffer_pool_stats()["lock_failures"] == after["lock_failures"]  # turned off: not asked again


def test_the_pools_large_blocks_ask_for_huge_pages_unless_told_not_to():
    """Blocks of 2 MiB or more ask the kernel for transparent huge pages (a fresh block fills with a
    fault per 2 MiB: bench_fresh_pages); KDN_BUFFER_POOL_HUGE_PAGES=0 or buffer_pool_huge_pages(False)
    turns it off; either way the bytes are the bytes."""
    import subprocess
    import sys

    assert _core.buffer_pool_stats()["huge_pages"]
    code = ("from kdn import _core; b = _core.Buffer(bytes(range(256)) * 16384); "
            "print(_core.buffer_pool_stats()['huge_pages'], bytes(b) == bytes(range(256)) * 16384)")
    env = {**os.environ, "KDN_BUFFER_POOL_HUGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
    _core.buffer_pool_huge_pages(False)
    try:
        assert bytes(_core.Buffer(bytes(range(256)) * 16384)) == bytes(range(256)) * 16384
        assert not _core.buffer_pool_stats()["huge_pages"]
    finally:
        _core.buffer_pool_huge_pages(True)


def test_an_engine_asks_for_page_locking_only_for_a_model_on_a_cuda_device_and_only_if_configured():
    """``Engine.serving_on`` (the vLLM worker over GPU blocks, an HF model on the GPU): the pool is
    asked to page-lock for a CUDA device unless ``pin_host_memory=False``; never for the CPU. Without a
    device the ask is refused once (counted) and the blocks stay pageable."""
    import torch

    from kdn import KDN, KDNConfig

    if torch.cuda.is_available():
        pytest.skip("a CUDA device locks the blocks (test_gpu.py checks what it uploads)")

    def asks(config: KDNConfig, device: str) -> int:
        before = _core.buffer_pool_stats()["lock_failures"]
        KDN(config).engine.serving_on(torch.device(device))
        _core.Buffer(bytes(1 << 20))  # a pooled block: locked if the pool was asked (here: refused)
        return _core.buffer_pool_stats()["lock_failures"] - before

    assert asks(KDNConfig(), "cpu") == 0
    assert asks(KDNConfig(pin_host_memory=False), "cuda") == 0
    assert asks(KDNConfig(), "cuda") == 1


def test_a_cuda_engine_keeps_idle_host_blocks_for_its_longest_hit(monkeypatch):
    """A model on a CUDA device keeps the pool's idle page-locked blocks for one hit of its longest
    prompt (``Engine.serving_on(device, hit_bytes)``; the vLLM worker: max_model_len x the KV's bytes a
    token): a disk hit larger than the default 1 GiB cap had the rest of its blocks locked afresh at
    every hit. Raised, never lowered; at most a quarter of the memory; a cap set by
    ``KDN_BUFFER_POOL_BYTES`` stays; a CPU model or ``pin_host_memory=False`` changes nothing."""
    import os

    import torch

    from kdn import KDN, KDNConfig
    from kdn.engine.host_pool import SLACK

    monkeypatch.delenv("KDN_BUFFER_POOL_BYTES", raising=False)
    before = _core.buffer_pool_stats()["limit_bytes"]
    cuda, hit = torch.device("cuda"), 3 << 30

    def cap() -> int:
        return _core.buffer_pool_stats()["limit_bytes"]

    try:
        _core.buffer_pool_set_limit(1 << 30)
        engine = KDN(KDNConfig()).engine
        engine.serving_on(torch.device("cpu"), hit)
        KDN(KDNConfig(pin_host_memory=False)).engine.serving_on(cuda, hit)
        assert cap() == 1 << 30
        engine.serving_on(cuda, hit)
        assert cap() == hit + hit // SLACK
        engine.serving_on(cuda, 1 << 20)  # a smaller model beside it: the cap stays
        assert cap() == hit + hit // SLACK
        engine.serving_on(cuda, 1 << 50)
        assert cap() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        _core.buffer_pool_set_limit(1 << 30)
        monkeypatch.setenv("KDN_BUFFER_POOL_BYTES", "1GiB")
        engine.serving_on(cuda, hit)
        assert cap() == 1 << 30
    finally:
        _core.buffer_pool_set_limit(before)
        _core.buffer_pool_lock_pages(False)


def test_host_arrays_are_writable_and_blobs_are_not():
    import torch

    array = _core.host_array(4 << 20)
    t = torch.frombuffer(array, dtype=torch.float32)
    t.fill_(2.0)
    assert t.sum().item() == 2.0 * (1 << 20) and array.writable
    assert not _core.Buffer(b"abc").writable and memoryview(_core.Buffer(b"abc")).readonly
