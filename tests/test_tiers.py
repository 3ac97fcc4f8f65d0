"""KDN over memory + disk tiers: restarts, other processes, write policies, pins, eviction, failures."""

import logging
import subprocess

import pytest
import torch

from conftest import full_prefill, random_ids
from disk_helpers import python_process
from kdn import KDN, KDNConfig

CHUNK = 8


def disk_kdn(tmp_path, **overrides) -> KDN:
    return KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kdn"), **overrides))


def first_token_logits(model, kdn, ids):
    cache, hit = kdn.retrieve(model, ids, limit=ids.shape[1] - 1)
    with torch.inference_mode():
        return model(ids[:, hit:], past_key_values=cache).logits[0, -1], hit


def test_a_restarted_kdn_serves_from_disk_with_full_prefill_logits(tiny_llama, tmp_path):
    ids = random_ids(tiny_llama, 45, seed=3)
    reference, cache = full_prefill(tiny_llama, ids)
    first = disk_kdn(tmp_path)
    assert first.store(tiny_llama, ids, cache) == 40
    first.flush()
    del first
    second = disk_kdn(tmp_path)  # a new KDN, empty memory: the disk tier holds the chunks
    assert second.lookup(tiny_llama, ids) == 40
    logits, hit = first_token_logits(tiny_llama, second, ids)
    assert hit == 40
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    stats = second.stats()
    assert stats["disk"]["hits"] == 5 and stats["memory"]["entries"] == 5  # promoted into memory


STORER = """
import sys
from kdn import KDN, KDNConfig
from kdn.models.tiny import tiny_model
model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
kdn = KDN(KDNConfig(chunk_size=8, disk_dir=sys.argv[1]))
ids = [int(t) for t in sys.argv[2].split(",")]
import torch
kdn.generate(model, torch.tensor([ids]), max_new_tokens=1, do_sample=False)
print(kdn.lookup(model, ids))
"""


def test_another_process_gets_a_hit_on_what_one_stored(tiny_llama, tmp_path):
    ids = random_ids(tiny_llama, 33, seed=9)
    reader = disk_kdn(tmp_path)  # running before the other process stores
    proc = python_process(STORER, str(tmp_path / "kdn"), ",".join(map(str, ids[0].tolist())),
                          stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=120)[0].strip() == "32" and proc.returncode == 0
    logits, hit = first_token_logits(tiny_llama, reader, ids)
    assert hit == 32
    torch.testing.assert_close(logits, full_prefill(tiny_llama, ids)[0], rtol=1e-4, atol=1e-4)


def chunk_bytes(model) -> int:
    probe = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(model, CHUNK)
    probe.store(model, ids, full_prefill(model, ids)[1])
    return probe.memory.used_bytes


def test_write_back_sends_only_memory_evictions_to_disk(tiny_llama, tmp_path):
    per_chunk = chunk_bytes(tiny_llama)
    kdn = disk_kdn(tmp_path, memory_bytes=2 * per_chunk, write_policy="write-back")
    ids = random_ids(tiny_llama, 49, seed=4)
    reference, cache = full_prefill(tiny_llama, ids)
    kdn.store(tiny_llama, ids, cache)
    kdn.flush()
    stats = kdn.stats()
    assert stats["memory"]["entries"] == 2 and stats["disk"]["entries"] == 4  # the 4 evicted chunks
    assert kdn.lookup(tiny_llama, ids) == 48
    logits, hit = first_token_logits(tiny_llama, kdn, ids)
    assert hit == 48
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_memory_only_never_writes_to_disk(tiny_llama, tmp_path):
    kdn = disk_kdn(tmp_path, write_policy="memory-only")
    ids = random_ids(tiny_llama, 24)
    kdn.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    kdn.flush()
    assert kdn.stats()["disk"]["entries"] == 0 and kdn.lookup(tiny_llama, ids, limit=24) == 24


def test_pin_by_text_survives_memory_pressure_then_evict_by_text(stories, tmp_path):
    model, tokenizer = stories
    document = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun."
    ids = torch.tensor([tokenizer(document)["input_ids"]])
    per_chunk = chunk_bytes(model)
    kdn = KDN(KDNConfig(chunk_size=CHUNK, memory_bytes=6 * per_chunk))
    kdn.store(model, ids, full_prefill(model, ids)[1])
    stored = kdn.lookup(model, ids)
    assert stored >= 16
    assert kdn.pin(model, document, tokenizer=tokenizer) == stored
    for seed in range(10):  # other documents flood memory
        other = random_ids(model, 24, seed=seed)
        kdn.store(model, other, full_prefill(model, other)[1])
    assert kdn.lookup(model, ids) == stored and kdn.stats()["memory"]["evictions"] > 0
    assert kdn.unpin(model, document, tokenizer=tokenizer) == stored // CHUNK
    assert kdn.evict(model, document, tokenizer=tokenizer) == stored // CHUNK
    assert kdn.lookup(model, ids) == 0
    with pytest.raises(ValueError, match="tokenizer"):
        kdn.pin(model, document)


def test_generate_carries_on_when_the_disk_fails(tiny_llama, tmp_path, caplog):
    kdn = disk_kdn(tmp_path)
    kdn.disk.store._inject_write_failures(1000)
    ids = random_ids(tiny_llama, 30, seed=2)
    expected = tiny_llama.generate(ids, max_new_tokens=4, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="kdn"):
        for _ in range(3):
            assert torch.equal(kdn.generate(tiny_llama, ids, max_new_tokens=4, do_sample=False), expected)
            kdn.flush()
    assert kdn.stats()["disk"]["errors"] > 0 and kdn.last_generate["hit_tokens"] == 24  # memory still serves
    assert len([r for r in caplog.records if "file operations failed" in r.getMessage()]) == 1


def test_clear_empties_every_tier(tiny_llama, tmp_path):
    kdn = disk_kdn(tmp_path)
    ids = random_ids(tiny_llama, 24)
    kdn.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    kdn.flush()
    kdn.clear()
    assert kdn.lookup(tiny_llama, ids) == 0
    assert not list((tmp_path / "kdn").glob("??/*.kdnb"))


@pytest.mark.parametrize("write_policy", ["write-through", "write-back"])
def test_threads_through_the_manager_only_see_what_was_stored(tmp_path, write_policy):
    import random
    import threading
    import time

    from disk_helpers import blob_for, key
    from kdn.storage import TierManager

    size = len(blob_for(0))
    tiers = TierManager(KDNConfig(memory_bytes=6 * size, disk_dir=str(tmp_path), disk_bytes=20 * size,
                                  write_policy=write_policy, memory_policy="s3fifo"))
    expected = {i: bytes(blob_for(i)) for i in range(40)}
    errors, deadline = [], time.monotonic() + 1.5

    def worker(seed):
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            i = rng.randrange(40)
            if rng.random() < 0.4:
                tiers.put(key(i), blob_for(i))
            else:
                ids = [key(j) for j in range(i, min(i + 3, 40))]
                for j, blob in enumerate(tiers.get_many(ids)):
                    if bytes(blob) != expected[i + j]:
                        errors.append(i + j)
            for t in tiers.tiers:
                if t.used_bytes > t.capacity_bytes:
                    errors.append(f"{t.name} over capacity")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tiers.flush()
    assert errors == []
    stats = tiers.stats()
    assert stats["disk"]["corrupt"] == stats["disk"]["errors"] == 0
    assert stats["memory"]["evictions"] > 0 and stats["disk"]["entries"] > 6


def test_memory_returns_to_the_baseline_after_clear(tiny_llama):
    import gc

    from kdn import _core

    gc.collect()
    baseline = _core.buffer_live_bytes()
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    ids = random_ids(tiny_llama, 40)
    kdn.store(tiny_llama, ids, full_prefill(tiny_llama, ids)[1])
    cache, hit = kdn.retrieve(tiny_llama, ids, limit=40)
    assert hit == 40 and _core.buffer_live_bytes() > baseline
    kdn.last_retrieve["stream"].wait_all()  # layer-wise: the blobs are held until delivered
    del cache
    kdn.clear()
    gc.collect()
    assert _core.buffer_live_bytes() == baseline
    assert _core.buffer_pool_stats()["idle_bytes"] == 0


NODE_STORER = """
import os, sys, torch
from kdn import KDN, KDNConfig
from kdn.models.tiny import tiny_model
model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
kdn = KDN(KDNConfig(chunk_size=8, node_dir=sys.argv[1], disk_dir=sys.argv[2]))
kdn.generate(model, torch.tensor([[int(t) for t in sys.argv[3].split(",")]]), max_new_tokens=1, do_sample=False)
kdn.flush()
print(kdn.stats()["node"]["entries"], flush=True)
os._exit(9)  # an engine that crashes: no exit handlers, nothing handed over
"""


def test_engines_of_one_node_share_its_memory_tier_and_a_crash_loses_nothing(tiny_llama, tmp_path):
    """The node tier (``node_dir``: shared memory, a tmpfs folder in production): what one process
    prefilled is a hit for another process of the node from there, without its own disk (another
    folder) or memory, after the first has died; the hit is a full prefill's logits."""
    ids = random_ids(tiny_llama, 41, seed=5)
    node = tmp_path / "node"
    proc = python_process(NODE_STORER, str(node), str(tmp_path / "disk-a"), ",".join(map(str, ids[0].tolist())),
                          stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=120)[0].strip() == "5" and proc.returncode == 9
    other = KDN(KDNConfig(chunk_size=CHUNK, node_dir=str(node), disk_dir=str(tmp_path / "disk-b")))
    logits, hit = first_token_logits(tiny_llama, other, ids)
    assert hit == 40
    torch.testing.assert_close(logits, full_prefill(tiny_llama, ids)[0], rtol=1e-4, atol=1e-4)
    stats = other.stats()
    assert stats["node"]["hits"] == 5 and stats["disk"]["hits"] == 0 and stats["memory"]["entries"] == 5
    other.flush()
    assert other.stats()["disk"]["entries"] == 0  # a hit is promoted up (memory), not down


def test_the_node_tier_is_shared_memory_and_not_the_disk_folder(tmp_path, monkeypatch):
    from kdn._core import InvalidInputError

    from kdn.config import default_node_dir

    config = KDNConfig(node_dir="auto", node_bytes="64MiB")
    assert config.node_dir == str(default_node_dir()) and str(default_node_dir()).startswith("/dev/shm/")
    assert config.node_bytes == 64 << 20
    with pytest.raises(InvalidInputError, match="one folder"):
        KDNConfig(node_dir=str(tmp_path), disk_dir=str(tmp_path))
    with pytest.raises(InvalidInputError, match="node_dir"):
        KDNConfig(node_dir="")
    monkeypatch.setenv("KDN_NODE_DIR", str(tmp_path / "n"))
    assert KDNConfig.from_env().node_dir == str(tmp_path / "n")
