"""kdn for operators, over a store another process wrote (a disk or node folder, a Redis / Valkey or
Mooncake URL): what it holds per tier (``kdn stats``), which prompts of a model it holds
(``kdn ls``: rebuilt from the chunks' pointers, their first words when a tokenizer is given) and
their removal by text, token ids or age (``kdn evict``). Each answers a dict or list a ``--json``
caller prints as it is. A tenant (``KDN_NAMESPACE`` / ``KDN_SECRET``) sees and evicts only its own:
another tenant's chunks are keyed under another root, which its listing never rebuilds.

Example:
    >>> from kdn import operate
    >>> cache = kdn.KDN(kdn.KDNConfig(disk_dir="kv-operated", chunk_size=32))   # pointers every 16 tokens
    >>> stored = cache.store(model, ids, model(ids, use_cache=True).past_key_values)   # as a server would
    >>> cache.flush()                                    # its queued writes on disk, where a listing reads
    >>> [p["served"] == stored for p in operate.listing(cache, model)]   # the prompts stored for this model
    [True]
    >>> operate.evict(cache, model, [p["token_ids"] for p in operate.listing(cache, model)]) > 0
    True
    >>> operate.listing(cache, model)
    []
"""

from __future__ import annotations

import os
import time

import numpy as np

TIERS = ("memory", "node", "disk", "remote")
KEPT = ("entries", "used_bytes", "capacity_bytes", "pinned_bytes", "hits", "misses", "puts", "evictions",
        "errors", "corrupt", "foreign", "state")


def tiers_of(cache) -> list:
    """The tiers of ``cache`` that outlive a process (node, disk, remote), in lookup order."""
    return [tier for tier in (cache.engine.tier(name) for name in TIERS[1:]) if tier is not None]


def stored_keys(cache) -> list[bytes]:
    """Every key the lasting tiers of ``cache`` file (each once)."""
    return list(dict.fromkeys(key for tier in tiers_of(cache) for key in tier.keys()))


def stats(cache) -> dict:
    """Per lasting tier: its counters (:data:`KEPT` where the tier records them), ``entries`` as its
    files or values count them, and for a folder the ``oldest`` / ``newest`` file's age in seconds."""
    out = {}
    counters = cache.stats()
    for tier in tiers_of(cache):
        row = {k: v for k, v in counters.get(tier.name, {}).items() if k in KEPT}
        keys = list(tier.keys())
        row["entries"] = len(keys)
        folder = getattr(tier, "directory", None)
        if folder is not None:
            ages = _ages(folder)
            row["folder"] = folder
            if ages:
                row["oldest_seconds"], row["newest_seconds"] = round(max(ages), 1), round(min(ages), 1)
        out[tier.name] = row
    return out


def tenant_usage(cache, model) -> dict:
    """What this tenant (``KDN_NAMESPACE`` / ``KDN_SECRET``) holds of ``model`` in the lasting tiers:
    its stored ``prompts``, the distinct ``chunks`` they are made of (a shared prefix counted once)
    and their ``bytes`` as the first tier holding each stores it."""
    session = cache.session(model)
    prompts = cache.engine.audit(session, None, stored_keys(cache), sample=0).stored
    keys = list(dict.fromkeys(key for tokens in prompts
                              for key in cache.engine.find(session, tokens, len(tokens)).keys))
    return {"namespace": cache.config.namespace, "prompts": len(prompts), "chunks": len(keys),
            "bytes": sum(cache.engine.stored_bytes(key) for key in keys)}


def _ages(folder: str) -> list[float]:
    now, ages = time.time(), []
    for shard in os.scandir(folder):
        if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(shard.path):
            if entry.name.endswith(".kdnb") and entry.is_file(follow_symlinks=False):
                ages.append(now - entry.stat(follow_symlinks=False).st_mtime)
    return ages


def listing(cache, model, tokenizer=None, words: int = 12) -> list[dict]:
    """The prompts of ``model`` (in this tenant) the store holds, rebuilt from their chunks' pointers
    (:func:`kdn.engine.audit.stored_prompts`, through :meth:`kdn.engine.Engine.audit`), each
    ``{"tokens", "served", "chunks", "tiers", "age_seconds", "token_ids", "text"}``: its length, how
    many of its tokens the store serves, its chunks, the lasting tiers holding them all, the age of its newest
    chunk file, and with ``tokenizer`` its first ``words`` words."""
    session = cache.session(model)
    rows = []
    for tokens in cache.engine.audit(session, None, stored_keys(cache), sample=0).stored:
        found = cache.engine.find(session, tokens, len(tokens))
        holding = [t.name for t in tiers_of(cache) if all(t.contains(key) for key in found.keys)]
        row = {"tokens": int(len(tokens)), "served": int(found.tokens), "chunks": len(found.keys),
               "tiers": holding, "age_seconds": _age(cache, found.keys),
               "token_ids": tokens.tolist()}
        if tokenizer is not None:
            text = tokenizer.decode(tokens[:8 * words].tolist(), skip_special_tokens=True)
            row["text"] = " ".join(text.split()[:words])
        rows.append(row)
    return rows


def _age(cache, keys) -> float | None:
    """Seconds since the newest of ``keys``'s files was written in a folder tier (None: none on a folder)."""
    times = []
    for tier in tiers_of(cache):
        if getattr(tier, "directory", None) is None:
            continue
        for key in keys:
            try:
                times.append(os.lstat(tier.store.path_of(key)).st_mtime)
            except OSError:
                continue
    return round(time.time() - max(times), 1) if times else None


def evict(cache, model, prompts, kept=()) -> int:
    """Remove each of ``prompts`` (token id lists) from every tier of ``cache``, but the leading chunks
    it shares with one of ``kept`` (the prompts that stay: a shared system prompt or document is
    theirs too); the chunks removed."""
    session, chunk = cache.session(model), cache.config.chunk_size
    kept = [np.asarray(k, dtype=np.uint32) for k in kept]
    removed = 0
    for prompt in prompts:
        prompt = np.asarray(prompt, dtype=np.uint32)
        shared = max((_common(prompt, other) // chunk for other in kept), default=0)
        removed += cache.engine.evict(session, prompt, shared)
    return removed


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
