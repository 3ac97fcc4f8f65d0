"""The KV events scenario of tests/vllm_scheduler.py (issue 64): what kdn announces in vLLM's KV
event stream against what its tiers hold and against vLLM's own events for the same blocks."""

from __future__ import annotations

import numpy as np

from kdn.keys import request_scope
from vllm_harness import Harness, random_kv, random_tokens


def events(model: str) -> dict:
    """Issue 64: KV events. Five 256-token documents (one under a cache_salt) stored through a memory
    tier that holds two and a disk that holds three: what kdn announces (BlockStored / BlockRemoved,
    medium CPU for memory and STORAGE for disk) against what each tier holds at the end, and each
    announced block against vLLM's own event for it (its prefix cache's: hash, parent, tokens, extra keys)."""
    import tempfile

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    probe = Harness(model, chunk_size=64)
    chunk_bytes = probe.session.layout.bytes_per_token() * 64 + 4096
    h = Harness(model, kv_events=True, chunk_size=64, probe_step=0, memory_bytes=int(8.5 * chunk_bytes),
                disk_dir=tempfile.mkdtemp(), disk_bytes=int(12.5 * chunk_bytes + (1 << 20)))
    docs = {f"d{i}": random_tokens(256, 130 + i) for i in range(5)}
    salts = {"d2": "tenant-a"}
    for i, (name, doc) in enumerate(docs.items()):
        h.request(name, doc, max_tokens=1, cache_salt=salts.get(name))
        h.step({name: random_kv(h, 256, 140 + i)})
    h.step({})  # one more step: the last store's events reach the scheduler
    announced = {"CPU": {}, "STORAGE": {}}  # medium -> block hash -> times held (stored - removed)
    stored_once, vllm_blocks, mine = True, {}, []
    for batch in h.published:
        for e in batch.events:
            if isinstance(e, BlockStored) and e.medium not in announced:  # vLLM's own (its GPU blocks)
                for j, block_hash in enumerate(e.block_hashes):
                    vllm_blocks[block_hash] = (e.block_hashes[j - 1] if j else e.parent_block_hash,
                                               e.token_ids[j * e.block_size:(j + 1) * e.block_size],
                                               e.extra_keys[j] if e.extra_keys else None, e.group_idx)
            elif isinstance(e, BlockStored):
                mine.append(e)
                for block_hash in e.block_hashes:
                    held = announced[e.medium]
                    stored_once &= held.get(block_hash, 0) == 0
                    held[block_hash] = held.get(block_hash, 0) + 1
            elif isinstance(e, BlockRemoved) and e.medium in announced:
                for block_hash in e.block_hashes:
                    announced[e.medium][block_hash] -= 1
    tiers = {"CPU": h.worker.engine.tier("memory"), "STORAGE": h.worker.engine.tier("disk")}
    matches, held = True, {"CPU": 0, "STORAGE": 0}
    for name, doc in docs.items():
        request_hashes = _block_hashes(h, name)
        keys = h.session.within(request_scope(salts[name]) if name in salts else None).prefix_keys(
            np.asarray(doc, dtype=np.uint32))
        for medium, tier in tiers.items():
            for i, key in enumerate(keys):
                in_tier = tier.contains(key)
                held[medium] += in_tier
                said = [announced[medium].get(request_hashes[2 * i + j], 0) for j in range(2)]
                matches &= said == [int(in_tier)] * 2
    same_as_vllm = all(
        vllm_blocks.get(block_hash) == (e.block_hashes[j - 1] if j else e.parent_block_hash,
                                        e.token_ids[j * e.block_size:(j + 1) * e.block_size],
                                        e.extra_keys[j] if e.extra_keys else None, e.group_idx)
        for e in mine for j, block_hash in enumerate(e.block_hashes))
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in mine}
    removed = sum(isinstance(e, BlockRemoved) and e.medium in announced for b in h.published for e in b.events)
    salted_extra = [e.extra_keys for e in mine if e.extra_keys]  # vLLM keys a salt into a prompt's first block
    return {"matches_tiers": bool(matches), "held": held, "stored_once": bool(stored_once),
            "same_as_vllm": bool(same_as_vllm), "announced": len(mine), "removed_events": removed,
            "salted_extra_keys": len(salted_extra), "unannounced": h.scheduler.connector._announcer.unannounced,
            "group_kinds": sorted(kinds), "grouped": grouped_events(h)}


def grouped_events(h: Harness) -> dict:
    """Issue 87: a hybrid model's (Gemma 3: a full-attention group and a sliding one of 128) chunk
    filed and then evicted is announced once per KV cache group, each event naming its group, and on
    a store the group's kind and window, as vLLM's own offloading names them."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kdn.integrations.vllm.events import Announcer, TierEvents
    from kdn.integrations.vllm.kv_layers import KVGroups

    groups = KVGroups(("FullAttentionSpec", "SlidingWindowSpec"), {}, 128,
                      (("full_attention", None), ("sliding_window", 128)))
    announcer = Announcer(h.worker.engine, h.block, groups)
    request = h.requests["d0"]
    announcer.note_request(request)
    announcer.note_store("d0", h.session, list(request.prompt_token_ids))
    key = h.session.prefix_keys(np.asarray(request.prompt_token_ids, dtype=np.uint32))[0]
    announcer.add(type("Events", (), {})())  # not the worker's: ignored
    announcer.add(TierEvents([("memory", True, key), ("memory", False, key)]))
    out = announcer.take()
    return {"stored": sorted((e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, len(e.block_hashes))
                             for e in out if isinstance(e, BlockStored)),
            "removed": sorted((e.group_idx, len(e.block_hashes)) for e in out if isinstance(e, BlockRemoved))}


def _block_hashes(h: Harness, req_id: str) -> list:
    """vLLM's hashes of a finished request's full blocks, as its events publish them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(b) for b in h.requests[req_id].block_hashes]


def hit_sources(model: str, through_lookup_server: bool = False) -> dict:
    """Issue 64: a hit's source through vLLM's ``CacheHitSource``: document A stored, then B, through a
    memory tier that holds one of them and a disk that holds both; B's question is served from memory,
    A's from the disk, each hit's counts adding up to what it served. ``through_lookup_server``: the
    scheduler asks the worker's lookup server, as under ``vllm serve`` (the worker in another
    process): where each chunk is held travels with the answer."""

    from kdn.integrations.vllm import process

    here = process.worker_here
    if through_lookup_server:
        process.worker_here = lambda engine: False
    try:
        return _hit_sources(model)
    finally:
        process.worker_here = here


def _hit_sources(model: str) -> dict:
    import tempfile

    probe = Harness(model, chunk_size=64)
    chunk_bytes = probe.session.layout.bytes_per_token() * 64 + 4096
    h = Harness(model, chunk_size=64, probe_step=0, memory_bytes=int(4.5 * chunk_bytes), disk_dir=tempfile.mkdtemp())
    seen = {}
    connector = h.scheduler.connector
    allocated = connector.update_state_after_alloc

    def then_ask(request, blocks, n):  # where vLLM asks (its stats on: right after the allocation)
        allocated(request, blocks, n)
        if n:
            sources = connector.get_external_cache_hit_sources(request, n)
            seen[request.request_id] = {str(source.value): count for source, count in sources.items()}

    connector.update_state_after_alloc = then_ask
    docs = {"a": random_tokens(256, 150), "b": random_tokens(256, 151)}
    for i, (name, doc) in enumerate(docs.items()):
        h.request(name, doc, max_tokens=1)
        h.step({name: random_kv(h, 256, 152 + i)})
    for name in ("b", "a"):  # B's first: A's hit promotes it into memory, evicting B
        h.request(f"{name}-q", docs[name] + random_tokens(20, 160), max_tokens=1)
        h.step({f"{name}-q": random_kv(h, 276, 170)})
    return seen
