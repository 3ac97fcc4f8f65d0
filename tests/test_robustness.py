"""Bad blobs are misses (one warning, never an exception or a wrong answer); bad input is a clear error."""

import logging

import numpy as np
import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.models.tiny import tiny_model

CHUNK = 8


@pytest.fixture()
def stored(tiny_llama):
    """A KDN holding the KV of a 40-token prompt (5 chunks) of tiny_llama."""
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(tiny_llama, 40, seed=5)
    kdn.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    keys = kdn.chunk_keys(tiny_llama, ids)
    return kdn, ids, keys


def damage(kdn, key, how):
    blob = bytearray(bytes(kdn.memory.get(key)))
    if how == "flip":
        blob[len(blob) // 2] ^= 0x10
    elif how == "truncate":
        blob = blob[: len(blob) // 3]
    elif how == "garbage":
        blob = bytearray(np.random.default_rng(0).integers(0, 256, len(blob), dtype=np.uint8).tobytes())
    kdn.memory.put(key, bytes(blob))


@pytest.mark.parametrize("how", ["flip", "truncate", "garbage"])
def test_corrupt_blob_is_a_miss_with_one_warning(tiny_llama, stored, how, caplog):
    kdn, ids, keys = stored
    damage(kdn, keys[2], how)
    expected = tiny_llama.generate(ids, max_new_tokens=8, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="kdn"):
        got = kdn.generate(tiny_llama, ids, max_new_tokens=8, do_sample=False)
        assert kdn.last_generate["hit_tokens"] == 2 * CHUNK  # the hit ends before the damaged chunk
        again = kdn.generate(tiny_llama, ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    warnings = [r for r in caplog.records if "unusable stored chunk" in r.getMessage()]
    assert len(warnings) == 1
    assert kdn.last_generate["hit_tokens"] == 39  # the first generate re-stored the damaged chunk


def test_blob_moved_under_another_key_is_a_miss(tiny_llama, stored):
    kdn, ids, keys = stored
    kdn.memory.put(keys[0], bytes(kdn.memory.get(keys[1])))
    cache, hit = kdn.retrieve(tiny_llama, ids)
    assert (cache, hit) == (None, 0)


def test_another_model_never_hits(tiny_llama, stored):
    kdn, ids, _ = stored
    same_shape_other_weights = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=99)
    assert kdn.lookup(same_shape_other_weights, ids) == 0
    assert kdn.retrieve(same_shape_other_weights, ids) == (None, 0)
    assert kdn.lookup(tiny_llama, ids) == 39  # the last token is always the model's


def test_foreign_fingerprint_inside_blob_is_a_miss(tiny_llama, stored):
    kdn, ids, keys = stored
    other = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, seed=7)
    other_kdn = KDN(KDNConfig(chunk_size=CHUNK))
    other_kdn.store(other, ids, full_prefill(other, ids)[1])
    other_keys = other_kdn.chunk_keys(other, ids)
    kdn.memory.put(keys[0], bytes(other_kdn.memory.get(other_keys[0])))  # right key, wrong model inside
    assert kdn.retrieve(tiny_llama, ids) == (None, 0)


def test_store_is_idempotent(tiny_llama, stored):
    kdn, ids, _ = stored
    before = kdn.stats()["memory"]
    assert kdn.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1]) == 40
    after = kdn.stats()["memory"]
    assert after["puts"] == before["puts"] and after["used_bytes"] == before["used_bytes"]


def test_capacity_eviction_keeps_store_under_limit(tiny_llama):
    per_chunk = 2 * 2 * CHUNK * 2 * 16 * 4 + 80 + 8 * (1 + 2 * 2) + 8  # layers*2*tokens*heads*dim*4 + header,
    # the section sums (one for the header, one per plane) and the checksum
    kdn = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=3 * per_chunk))
    for seed in range(4):
        ids = random_ids(tiny_llama, 24, seed=seed)
        kdn.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
        assert kdn.memory.used_bytes <= kdn.memory.capacity_bytes
    assert kdn.stats()["memory"]["evictions"] > 0
    assert kdn.lookup(tiny_llama, random_ids(tiny_llama, 24, seed=3), limit=24) == 24  # newest survives


def test_bad_inputs_are_clear_errors(tiny_llama, stored):
    kdn, ids, _ = stored
    cache = full_prefill(tiny_llama, ids)[1]
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        kdn.lookup(tiny_llama, [1, 2, tiny_llama.config.vocab_size])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        kdn.retrieve(tiny_llama, [-1, 2])
    with pytest.raises(InvalidInputError, match="must be 1-D"):
        kdn.lookup(tiny_llama, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="must be integers"):
        kdn.lookup(tiny_llama, np.array([1.5, 2.0]))
    other = tiny_model("qwen2", layers=3, heads=4, kv_heads=2, head_dim=16)
    other_cache = full_prefill(other, ids)[1]
    with pytest.raises(InvalidInputError, match="different model"):
        kdn.store(tiny_llama, ids, other_cache)
    wider = tiny_model("llama", layers=2, heads=4, kv_heads=4, head_dim=16)
    with pytest.raises(InvalidInputError, match="different model"):
        kdn.store(tiny_llama, ids, full_prefill(wider, ids)[1])
    with pytest.raises(InvalidInputError, match="dtype"):
        kdn.store(tiny_llama, ids, [(k.half(), v.half()) for k, v in ((la.keys, la.values) for la in cache.layers)])
    with pytest.raises(InvalidInputError, match="holds 40 tokens but 41"):
        kdn.store(tiny_llama, torch.cat([ids, ids[:, :1]], 1), cache)
    with pytest.raises(InvalidInputError, match="DynamicCache"):
        kdn.store(tiny_llama, ids, "not a cache")
    with pytest.raises(InvalidInputError, match="batch size 1"):
        kdn.generate(tiny_llama, torch.cat([ids, ids]), max_new_tokens=2)
    with pytest.raises(InvalidInputError, match="padding"):
        kdn.generate(tiny_llama, ids, attention_mask=torch.zeros_like(ids), max_new_tokens=2)


def test_bad_config_is_a_clear_error(monkeypatch):
    with pytest.raises(InvalidInputError, match="chunk_size must be a positive integer"):
        KDNConfig(chunk_size=0)
    monkeypatch.setenv("KDN_MEMORY_BYTES", "lots")
    with pytest.raises(InvalidInputError, match="KDN_MEMORY_BYTES"):
        KDNConfig.from_env()
    monkeypatch.setenv("KDN_MEMORY_BYTES", "4096")
    assert KDNConfig.from_env(chunk_size=32) == KDNConfig(chunk_size=32, memory_bytes=4096)


def test_store_failure_never_escapes_generate(tiny_llama, monkeypatch, caplog):
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(tiny_llama, 20)

    def broken_store(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(kdn.engine, "save", broken_store)  # generate stores through the engine
    with caplog.at_level(logging.WARNING, logger="kdn"):
        out = kdn.generate(tiny_llama, ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, tiny_llama.generate(ids, max_new_tokens=4, do_sample=False))
    assert any("disk on fire" in r.getMessage() for r in caplog.records)
