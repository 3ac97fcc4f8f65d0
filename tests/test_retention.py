"""Retention a request asks for (issue 64): ``retain=`` seconds pins a request's prompt in memory,
within the operator's bound (``retain_fraction`` of the memory tier, ``retain_max_seconds``); a
request beyond it is refused before anything is computed; ``priority=`` orders a prompt in its
tenant's eviction order; ``store=False`` stores nothing."""

import time

import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig

CHUNK = 16


def test_a_retained_prompt_survives_a_flood_that_evicts_everything_unpinned(tiny_llama):
    """Memory for ~12 prompts; one kept with ``retain=600`` and one not; 40 never-repeated prompts
    flood the tier: the kept one is still served whole and exactly, the other is gone."""
    ids = [random_ids(tiny_llama, 4 * CHUNK + 1, seed=s) for s in range(42)]
    per_prompt = 4 * CHUNK * 2 * 2 * 2 * 16 * 4  # 4 chunks, layers * K,V * heads * dim * fp32
    cache = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=12 * per_prompt, retain_fraction=0.5))
    cache.generate(tiny_llama, ids[0], max_new_tokens=1, do_sample=False, retain=600)
    assert cache.last_generate["retained_chunks"] == 4
    cache.generate(tiny_llama, ids[1], max_new_tokens=1, do_sample=False)
    for flood in ids[2:]:
        cache.generate(tiny_llama, flood, max_new_tokens=1, do_sample=False)
    assert cache.lookup(tiny_llama, ids[1]) == 0 and cache.lookup(tiny_llama, ids[0]) == 4 * CHUNK
    kv, hit = cache.retrieve(tiny_llama, ids[0])
    with torch.inference_mode():
        logits = tiny_llama(ids[0][:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, full_prefill(tiny_llama, ids[0])[0], rtol=1e-5, atol=1e-5)


def test_a_retention_beyond_the_operators_bound_is_refused_before_anything_runs(tiny_llama):
    """With room for two and a half prompts. pins, the third request asking to be kept is a one-line typed error
    raised before its prefill (nothing stored for it); a TTL above ``retain_max_seconds`` is cut to
    it (the pin lapses then, and a flood evicts the prompt)."""
    ids = [random_ids(tiny_llama, 4 * CHUNK + 1, seed=50 + s) for s in range(3)]
    per_prompt = 4 * CHUNK * 2 * 2 * 2 * 16 * 4
    cache = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=10 * per_prompt, retain_fraction=0.25))
    for prompt in ids[:2]:
        cache.generate(tiny_llama, prompt, max_new_tokens=1, do_sample=False, retain=600)
    with pytest.raises(InvalidInputError, match="retain_fraction"):
        cache.generate(tiny_llama, ids[2], max_new_tokens=1, do_sample=False, retain=600)
    assert cache.lookup(tiny_llama, ids[2]) == 0
    with pytest.raises(InvalidInputError, match="positive number of seconds"):
        cache.generate(tiny_llama, ids[2], max_new_tokens=1, do_sample=False, retain=-1)
    short = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=3 * per_prompt, retain_fraction=0.5, retain_max_seconds=0.3))
    short.generate(tiny_llama, ids[0], max_new_tokens=1, do_sample=False, retain=3600)
    time.sleep(0.5)
    for s in range(8):
        short.generate(tiny_llama, random_ids(tiny_llama, 4 * CHUNK + 1, seed=70 + s), max_new_tokens=1)
    assert short.lookup(tiny_llama, ids[0]) == 0


def test_a_lower_priority_leaves_first_and_a_higher_one_last(tiny_llama):
    """Memory for ~12 prompts: one stored first at the default priority, then one with ``priority=-1``
    and one with ``priority=1``; a flood of never-repeated prompts evicts the low one first (the LRU
    order alone would take the first), then the default ones; the high one outlives 40 prompts and is
    served whole and exactly (against a full prefill)."""
    ids = [random_ids(tiny_llama, 4 * CHUNK + 1, seed=80 + s) for s in range(43)]
    per_prompt = 4 * CHUNK * 2 * 2 * 2 * 16 * 4
    cache = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=12 * per_prompt))
    default, low, high = ids[:3]
    cache.generate(tiny_llama, default, max_new_tokens=1, do_sample=False)
    cache.generate(tiny_llama, low, max_new_tokens=1, do_sample=False, priority=-1)
    assert cache.last_generate["retained_chunks"] == 4
    cache.generate(tiny_llama, high, max_new_tokens=1, do_sample=False, priority=1)
    low_left_at = None
    for n, flood in enumerate(ids[3:]):
        cache.generate(tiny_llama, flood, max_new_tokens=1, do_sample=False)
        if low_left_at is None and cache.lookup(tiny_llama, low) < 4 * CHUNK:
            low_left_at = n
            assert cache.lookup(tiny_llama, default) == 4 * CHUNK, "the default prompt left before the low one"
    assert low_left_at is not None and cache.lookup(tiny_llama, default) == 0
    assert cache.lookup(tiny_llama, high) == 4 * CHUNK
    assert cache.engine.tier("memory").stats()["pinned_bytes"] == 0  # ordered, never pinned
    kv, hit = cache.retrieve(tiny_llama, high)
    with torch.inference_mode():
        logits = tiny_llama(high[:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, full_prefill(tiny_llama, high)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidInputError, match="priority: an integer"):
        cache.generate(tiny_llama, ids[0], max_new_tokens=1, do_sample=False, priority=1.5)
    with pytest.raises(InvalidInputError, match="with store=False nothing is"):
        cache.generate(tiny_llama, ids[0], max_new_tokens=1, do_sample=False, priority=2, store=False)


def test_an_ephemeral_request_is_served_and_stores_nothing(tiny_llama):
    ids = random_ids(tiny_llama, 4 * CHUNK + 1, seed=60)
    cache = KDN(KDNConfig(chunk_size=CHUNK))
    expected = tiny_llama.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(cache.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False, store=False), expected)
    assert cache.lookup(tiny_llama, ids) == 0
    cache.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False)
    out = cache.generate(tiny_llama, ids, max_new_tokens=3, do_sample=False, store=False)  # served a hit
    assert torch.equal(out, expected) and cache.last_generate["hit_tokens"] == 4 * CHUNK
