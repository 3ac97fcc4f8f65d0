"""Tenants share a tier fairly (issue 64): every stored blob's owner is its tenant (its fingerprint),
and room is made by evicting from the tenant furthest over its fair share first. Tenant B streaming
never-repeated documents at full speed does not take tenant A's working set (within its share)."""

import pytest
import torch
from kdn._core import InvalidInputError

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig

CHUNK = 16
PROMPT = 4 * CHUNK + 1
PER_PROMPT = 4 * CHUNK * 2 * 2 * 2 * 16 * 4  # 4 chunks: layers * K,V * kv_heads * head_dim * fp32


def hit_rate(cache, model, docs, namespace) -> float:
    """The share of ``docs`` whose whole stored prefix a lookup finds (nothing is stored by asking)."""
    return sum(cache.lookup(model, d, namespace=namespace) == PROMPT - 1 for d in docs) / len(docs)


@pytest.mark.parametrize("tier", ["memory", "disk"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_flooding_tenant_evicts_its_own_kv_not_another_tenants_working_set(tiny_llama, tmp_path, tier, policy):
    """A's 4 documents (a third of the tier) before, during and after B's flood of 60 new ones: A's
    hit rate is 100% throughout (it was 0% after the flood under one shared LRU order), B's newest
    documents are held, and A's hits are exact (a full prefill's logits)."""
    size = 12 * PER_PROMPT
    settings = ({"memory_bytes": size, "memory_policy": policy} if tier == "memory" else
                {"memory_bytes": 2 * PER_PROMPT, "disk_dir": str(tmp_path / "kv"), "disk_bytes": size,
                 "disk_policy": policy, "write_policy": "write-through"})
    cache = KDN(KDNConfig(chunk_size=CHUNK, probe_step=0, **settings))
    mine = [random_ids(tiny_llama, PROMPT, seed=s) for s in range(4)]
    for d in mine:
        cache.generate(tiny_llama, d, max_new_tokens=1, do_sample=False, namespace="tenant-a")
    cache.flush()
    rates = [hit_rate(cache, tiny_llama, mine, "tenant-a")]
    flood = [random_ids(tiny_llama, PROMPT, seed=100 + s) for s in range(60)]
    for i, d in enumerate(flood):
        cache.generate(tiny_llama, d, max_new_tokens=1, do_sample=False, namespace="tenant-b")
        if i % 15 == 14:
            cache.flush()
            rates.append(hit_rate(cache, tiny_llama, mine, "tenant-a"))
    cache.flush()
    rates.append(hit_rate(cache, tiny_llama, mine, "tenant-a"))
    assert rates == [1.0] * len(rates)
    assert hit_rate(cache, tiny_llama, flood[-3:], "tenant-b") == 1.0  # B keeps what fits its share
    assert cache.stats()[tier]["tenants"] == 2
    kv, hit = cache.retrieve(tiny_llama, mine[0], namespace="tenant-a")
    with torch.inference_mode():
        logits = tiny_llama(mine[0][:, hit:], past_key_values=kv).logits[0, -1]
    torch.testing.assert_close(logits, full_prefill(tiny_llama, mine[0])[0], rtol=1e-5, atol=1e-5)


def stored(cache, model, docs, namespace) -> list[bool]:
    return [cache.lookup(model, d, namespace=namespace) == PROMPT - 1 for d in docs]


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_tenant_quota_bounds_what_it_holds_and_the_others_keep_the_rest(tiny_llama, tmp_path, tier):
    """Tenant B (quota: 3 prompts' blobs of a 12-prompt tier) stores 10 documents into a tier with room
    to spare: it keeps its last 3 and nothing more; tenant A's 6 documents (beyond an even split, within
    what B's quota leaves) all stay through B's stream, and what each holds reads back exactly."""
    size = 12 * PER_PROMPT
    settings = ({"memory_bytes": size} if tier == "memory" else
                {"memory_bytes": 2 * PER_PROMPT, "disk_dir": str(tmp_path / "kv"), "disk_bytes": size,
                 "write_policy": "write-through"})
    cache = KDN(KDNConfig(chunk_size=CHUNK, probe_step=0, quotas={"tenant-b": int(3.1 * PER_PROMPT)}, **settings))
    mine = [random_ids(tiny_llama, PROMPT, seed=s) for s in range(6)]
    theirs = [random_ids(tiny_llama, PROMPT, seed=200 + s) for s in range(10)]
    for d in mine:
        cache.generate(tiny_llama, d, max_new_tokens=1, do_sample=False, namespace="tenant-a")
    for d in theirs:
        cache.generate(tiny_llama, d, max_new_tokens=1, do_sample=False, namespace="tenant-b")
    cache.flush()
    assert stored(cache, tiny_llama, theirs, "tenant-b") == [False] * 7 + [True] * 3
    assert stored(cache, tiny_llama, mine, "tenant-a") == [True] * 6
    assert cache.stats()[tier]["used_bytes"] <= 9.3 * PER_PROMPT  # B's quota holds with room to spare
    for docs, namespace in ((mine, "tenant-a"), (theirs, "tenant-b")):
        kv, hit = cache.retrieve(tiny_llama, docs[-1], namespace=namespace)
        assert hit == PROMPT - 1
        with torch.inference_mode():
            logits = tiny_llama(docs[-1][:, hit:], past_key_values=kv).logits[0, -1]
        torch.testing.assert_close(logits, full_prefill(tiny_llama, docs[-1])[0], rtol=1e-5, atol=1e-5)


def test_a_quota_as_a_fraction_applies_to_each_tier_and_pins_count_against_it(tiny_llama):
    """``quotas={"b": 0.3}``: 30% of the memory tier; B's retained (pinned) prompt fills it, so
    B's next prompt is refused by the tier (counted ``rejected``) and evicts nothing of anyone's."""
    cache = KDN(KDNConfig(chunk_size=CHUNK, probe_step=0, memory_bytes=4 * PER_PROMPT, quotas={"b": 0.3},
                          retain_fraction=1.0))
    first, second, other = (random_ids(tiny_llama, PROMPT, seed=s) for s in (1, 2, 3))
    cache.generate(tiny_llama, other, max_new_tokens=1, do_sample=False, namespace="a")
    cache.generate(tiny_llama, first, max_new_tokens=1, do_sample=False, namespace="b", retain=600)
    cache.generate(tiny_llama, second, max_new_tokens=1, do_sample=False, namespace="b")
    assert stored(cache, tiny_llama, [first, second], "b") == [True, False]
    assert stored(cache, tiny_llama, [other], "a") == [True]
    assert cache.stats()["memory"]["rejected"] >= 1


@pytest.mark.parametrize("given, expected", [
    ({"b": "2GiB", "a": 0.25}, (("a", 0.25), ("b", 2 << 30))),
    ("a=0.5, b=512MiB", (("a", 0.5), ("b", 512 << 20))),
    ('{"a": 1048576}', (("a", 1 << 20),)),
    (None, ()),
])
def test_quotas_are_read_from_mappings_text_and_json(given, expected):
    assert KDNConfig(quotas=given).quotas == expected


@pytest.mark.parametrize("given", [{"a": 1.5}, {"a": 0.0}, {"a": -3}, {"a": True}, {"": 0.5}, {"a": "lots"},
                                   "a:0.5", ["a"]])
def test_a_quota_that_is_not_a_fraction_nor_a_size_is_refused(given):
    with pytest.raises(InvalidInputError, match="quotas"):
        KDNConfig(quotas=given)


def test_quotas_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KDN_QUOTAS", "tenant-a=0.25,tenant-b=1GiB")
    assert KDNConfig.load().quotas == (("tenant-a", 0.25), ("tenant-b", 1 << 30))
