"""Tenants share a tier fairly (issue 64): every stored blob's owner is its tenant (its fingerprint),
and room is made by evicting from the tenant furthest over its fair share first. Tenant B streaming
never-repeated documents at full speed does not take tenant A's working set (within its share)."""

import pytest
import torch

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
