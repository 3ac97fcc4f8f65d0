"""Settings and calls that used to break instead of erroring: each is now a typed error naming the
argument, or works (beams, pins for ever, prompts larger than memory)."""

import logging
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig, _core
from kdn.storage.remote import RemoteTier
from kdn.urls import redact

CHUNK = 16


@pytest.fixture()
def stored(tiny_llama):
    cache = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(tiny_llama, 3 * CHUNK + 1, seed=21)
    cache.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    return cache, ids


@pytest.mark.parametrize("ttl", [math.inf, 1e10, 1e30])
def test_a_pin_for_ever_holds(tiny_llama, stored, ttl):
    cache, ids = stored
    assert cache.pin(tiny_llama, ids[0].tolist(), ttl=ttl) == 3 * CHUNK
    assert cache.stats()["memory"]["pinned_bytes"] > 0  # was 0: the deadline overflowed into the past
    store = _core.MemoryStore(3000)
    store.put(b"k" * 16, b"x" * 1000)
    assert store.pin(b"k" * 16, ttl)
    for i in range(10):  # eviction pressure: an expired pin would let the entry go
        store.put(bytes([i]) * 16, b"y" * 1000)
    assert store.contains(b"k" * 16) and store.stats()["pinned_bytes"] == 1000


def test_thread_counts_are_bounded_and_thread_failures_are_exceptions(tmp_path):
    with pytest.raises(InvalidInputError, match="disk_read_threads=100000: at most 64"):
        KDNConfig(disk_dir=str(tmp_path), disk_read_threads=100000)
    # with too little address space for the threads' stacks, a store raises (was: abort, exit 134)
    code = ("import re, resource\n"
            "from kdn import KDNError, _core\n"
            "vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), vm + (256 << 20)))\n"
            "try:\n"
            f"    _core.DiskStore({str(tmp_path / 'd')!r}, 1 << 20, read_threads=200)\n"
            "except KDNError as e:\n"
            "    print('raised:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "raised: cannot start 200 threads" in result.stdout, result.stderr


@pytest.mark.parametrize("ttl, ok", [(0.5, True), (2, True), (0, False), (-1, False), (math.inf, False),
                                     (math.nan, False), ("10", False)])
def test_remote_ttl_is_validated(ttl, ok):
    if ok:
        assert KDNConfig(remote_ttl=ttl).remote_ttl == ttl
    else:
        with pytest.raises(InvalidInputError, match="remote_ttl"):
            KDNConfig(remote_ttl=ttl)


def test_a_sub_second_ttl_stores_and_expires(redis_server):
    tier = RemoteTier(redis_server.url, ttl=0.5)
    from disk_helpers import blob_for, key

    assert tier.put(key(1), blob_for(1), wait=True)
    pttl = int(redis_server.cli("PTTL", tier.redis_key(key(1))).stdout)
    assert 0 < pttl <= 500 and tier.stats()["state"] == "ok"


def test_a_refused_command_is_not_an_outage(redis_server, caplog):
    from disk_helpers import blob_for, key

    tier = RemoteTier(redis_server.url)
    redis_server.cli("CONFIG", "SET", "maxmemory", "1")  # every write is refused with OOM
    redis_server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    try:
        with caplog.at_level(logging.WARNING, logger="kdn"):
            tier.put(key(91), blob_for(91), wait=True)
        stats = tier.stats()
        assert stats["refused"] == 1 and stats["state"] == "ok"
        assert "unreachable" not in caplog.text and "refused a command" in caplog.text
        assert tier.get_many([key(91)]) == [None] and tier.stats()["skipped"] == 0
    finally:
        redis_server.cli("CONFIG", "SET", "maxmemory", "0")


@pytest.mark.parametrize("url", ["unix:///run/redis.sock?db=0&password=hunter22", "redis://user:hunter22@host:1/0",
                                 "redis://:hunter22@host:1", "rediss://host:1/0?password=hunter22&ssl=true"])
def test_credentials_never_show(url, caplog):
    assert "hunter22" not in redact(url)
    config = KDNConfig(remote_url=url, remote_timeout=0.2)
    assert "hunter22" not in repr(config)
    if url.startswith("unix"):
        with caplog.at_level(logging.WARNING, logger="kdn"):
            cache = KDN(config)  # no such socket: a warning, which must not carry the password
        assert "hunter22" not in caplog.text and "hunter22" not in str(cache.stats())


@pytest.mark.parametrize("kwargs", [{"num_beams": 3}, {"num_beams": 3, "num_return_sequences": 2},
                                    {"do_sample": True, "top_k": 1, "num_return_sequences": 2}])
def test_beams_and_several_sequences_on_a_hit(tiny_llama, kwargs):
    cache = KDN(KDNConfig(chunk_size=8))
    ids = random_ids(tiny_llama, 40, seed=22)
    expected = tiny_llama.generate(ids, max_new_tokens=5, **kwargs)
    first = cache.generate(tiny_llama, ids, max_new_tokens=5, **kwargs)  # a miss: the prompt is stored
    second = cache.generate(tiny_llama, ids, max_new_tokens=5, **kwargs)  # a hit, expanded to the rows
    assert cache.last_generate["hit_tokens"] == 39
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_store_returns_what_is_retrievable_when_a_prompt_exceeds_memory(tiny_llama, caplog):
    ids = random_ids(tiny_llama, 8 * CHUNK, seed=23)
    kv = full_prefill(tiny_llama, ids)[1]
    chunk_bytes = len(_core.pack_chunk([t.contiguous() for layer in kv.layers for t in (layer.keys, layer.values)],
                                       0, CHUNK, b"F" * 16, b"K" * 16))
    cache = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=3 * chunk_bytes + 100))
    with caplog.at_level(logging.WARNING, logger="kdn"):
        stored = cache.store(tiny_llama, ids, kv)
    assert stored == cache.lookup(tiny_llama, ids) == 0  # the tail evicted the head: nothing retrievable
    assert cache.retrieve(tiny_llama, ids)[1] == stored
    assert len([r for r in caplog.records if "can be retrieved" in r.getMessage()]) == 1


@pytest.mark.parametrize("call, match", [
    (lambda c, m, ids: c.retrieve(m, ids, limit=math.nan), "limit"),
    (lambda c, m, ids: c.retrieve(m, ids, limit="5"), "limit"),
    (lambda c, m, ids: c.lookup(m, [[1, 2], [3]]), "token_ids"),
    (lambda c, m, ids: c.pin(m, ids[0].tolist(), ttl="10"), "ttl"),
    (lambda c, m, ids: c.store(m, ids, [(k.numpy(), v.numpy()) for k, v in
                                        ((torch.zeros(1, 2, 49, 16),) * 2 for _ in range(2))]), "torch tensor"),
    (lambda c, m, ids: c.store(m, ids, [(torch.empty(1, 2, 49, 16, device="meta"),) * 2] * 2), "meta device"),
    (lambda c, m, ids: c.blend(m, [ids[0, :8].tolist()], ids[0, 8:12].tolist(), recompute_ratio="x"),
     "recompute_ratio"),
])
def test_bad_arguments_are_typed_errors_naming_the_argument(tiny_llama, stored, call, match):
    cache, ids = stored
    with pytest.raises(InvalidInputError, match=match):
        call(cache, tiny_llama, ids)


def test_bad_settings_are_typed_errors_with_a_hint(monkeypatch):
    with pytest.raises(InvalidInputError, match="unknown kdn setting 'memory_byte'.*did you mean 'memory_bytes'"):
        KDNConfig(memory_byte=1)
    with pytest.raises(InvalidInputError, match="unknown kdn setting 'foo'"):
        KDNConfig(foo=1)
    with pytest.raises(InvalidInputError, match="memory_bytes=.*larger than 1 EiB"):
        KDNConfig(memory_bytes=2**70)
    monkeypatch.setenv("KDN_MEMORY_BYTE", "1GiB")
    with pytest.warns(UserWarning, match="KDN_MEMORY_BYTE; did you mean KDN_MEMORY_BYTES"):
        KDNConfig.from_env()


def test_numpy_token_ids_still_work(tiny_llama, stored):
    cache, ids = stored
    assert cache.lookup(tiny_llama, np.asarray(ids[0])) == 3 * CHUNK


@pytest.mark.parametrize("settings, match", [
    ({"remote_timeout": 1e-9}, "remote_timeout"), ({"remote_retry_seconds": 1e-9}, "remote_retry_seconds"),
    ({"remote_part_bytes": 1}, "remote_part_bytes"), ({"memory_bytes": "9" * 400}, "memory_bytes"),
    ({"memory_bytes": "9" * 30}, "1 EiB"), ({"namespace": "bad \udc80"}, "namespace"),
    ({"namespace": ["x"]}, "namespace"),
])
def test_issue_62_settings_are_one_line_typed_errors(settings, match):
    with pytest.raises(InvalidInputError, match=match):
        KDNConfig(**settings)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:99999/0", "redis://127.0.0.1:6379/abc"])
def test_a_bad_port_or_database_is_a_typed_error(url):
    with pytest.raises(InvalidInputError, match="remote_url"):
        KDN(KDNConfig(remote_url=url))


@pytest.mark.parametrize("variable, value, ok", [
    ("KDN_ENCRYPT", "true", None), ("KDN_PROBE_STEP", "8", 8), ("KDN_BUFFER_POOL_BYTES", "garbage", False),
    ("KDN_BUFFER_POOL_BYTES", "-1", False), ("KDN_BUFFER_POOL_BYTES", "512MiB", 512 << 20),
    ("KDN_BUFFER_POOL_HUGE_PAGES", "no", False), ("KDN_BUFFER_POOL_HUGE_PAGES", "maybe", "error"),
])
def test_every_setting_can_come_from_the_environment_and_a_bad_one_says_so(monkeypatch, variable, value, ok):
    """``KDN_ENCRYPT`` and ``KDN_PROBE_STEP`` are read (they were refused); the buffer pool's variables
    are checked and applied when an engine starts (``garbage`` was 0, ``-1`` was 2^64 - 1, ``no`` was on)."""
    limit, huge = _core.buffer_pool_stats()["limit_bytes"], _core.buffer_pool_stats()["huge_pages"]
    monkeypatch.setenv(variable, value)
    try:
        if variable == "KDN_ENCRYPT":
            with pytest.raises(InvalidInputError, match="needs a secret"):  # read as True: it needs one
                KDNConfig.from_env()
            assert KDNConfig.from_env(secret="a long enough secret").encrypt is True
        elif variable == "KDN_PROBE_STEP":
            assert KDNConfig.from_env().probe_step == ok
        elif ok is False and variable == "KDN_BUFFER_POOL_BYTES" or ok == "error":
            with pytest.raises(InvalidInputError, match=variable):
                KDN(KDNConfig())
        else:
            KDN(KDNConfig())
            stats = _core.buffer_pool_stats()
            assert (stats["limit_bytes"] if variable == "KDN_BUFFER_POOL_BYTES" else stats["huge_pages"]) == ok
    finally:
        _core.buffer_pool_set_limit(limit)
        _core.buffer_pool_huge_pages(huge)


def test_a_negative_limit_and_kdns_own_flat_kv_list(tiny_llama, stored):
    """``retrieve(limit=-1)`` is a typed error (it was a miss); ``store`` takes the flat
    ``[k0, v0, k1, v1, ...]`` list :func:`kdn.layout.cache_to_kv_list` makes (it raised IndexError)."""
    from kdn.layout import cache_to_kv_list

    cache, ids = stored
    with pytest.raises(InvalidInputError, match="limit"):
        cache.retrieve(tiny_llama, ids, limit=-1)
    fresh = KDN(KDNConfig(chunk_size=CHUNK))
    assert fresh.store(tiny_llama, ids, cache_to_kv_list(full_prefill(tiny_llama, ids)[1])) == 3 * CHUNK
    with pytest.raises(InvalidInputError, match="even number"):
        fresh.store(tiny_llama, ids, cache_to_kv_list(full_prefill(tiny_llama, ids)[1])[:-1])
