"""KV events from a running vLLM engine (issue 64): a router's subscriber on the engine's ZMQ stream
reads what kdn announces, checked against vLLM's own events, the disk folder and the remote store."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import torch

import test_vllm
from redis_servers import RedisServer
from test_vllm import engine

setup = test_vllm.setup  # the fixture: (vLLM venv's python, SmolLM2's folder, prompts), for this module too
CHUNK = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_running_engine_announces_what_kdn_files_and_evicts_as_its_tiers_hold(setup, tmp_path):
    """Four 512-token documents through kdn's memory (room for two), disk (room for three) and, where
    redis-server is installed (CI requires it), a remote store that evicts (room for about two and a
    half), vLLM's prefix cache on so vLLM publishes its own blocks too: every block kdn announces is
    vLLM's own event for it (hash, parent, tokens), each chunk is announced once per tier, memory and
    remote evictions are announced, and the blocks each tier's events leave held are exactly the
    chunks in the disk folder and in the remote store."""
    from kdn import KDNConfig
    from kdn.engine import Engine
    from kdn.layout import describe_checkpoint

    docs = [np.random.default_rng(300 + i).integers(100, 40000, 4 * CHUNK).tolist() for i in range(4)]
    prompts = tmp_path / "docs.json"
    prompts.write_text(json.dumps(docs))
    chunk_bytes = 30 * 2 * 3 * 64 * 4 * CHUNK + 4096  # SmolLM2, fp32
    disk = tmp_path / "kv"
    settings = {"chunk_size": CHUNK, "probe_step": 0, "memory_bytes": int(8.5 * chunk_bytes), "disk_dir": str(disk),
                "disk_bytes": int(12.5 * chunk_bytes) + (1 << 20)}
    redis = None
    if shutil.which("redis-server") or os.environ.get("KDN_REQUIRE_SERVERS") == "1":
        redis = RedisServer(tmp_path / "redis", None, "--maxmemory", str(10 * chunk_bytes),
                            "--maxmemory-policy", "allkeys-lru", "--notify-keyspace-events", "Egex")  # the operator's
        settings["remote_url"] = redis.url
    try:
        out = engine(setup, settings, "--prefix-caching", "--max-tokens", "1", "--kv-events", str(_free_port()),
                     prompts=str(prompts))
        if redis is not None:  # the store as the engine left it: the reader's own commands evict nothing more
            redis.cli("CONFIG", "SET", "maxmemory", "0")
        events, own = out["events"]["kdn"], out["events"]["vllm"]
        assert all(own.get(h) == [tokens, parent] for _, stored, h, tokens, parent in events if stored), "not vLLM's"
        held = {"CPU": {}, "STORAGE": {}, "STORAGE/REMOTE": {}}
        for medium, stored, h, *_ in events:
            if stored:
                assert held[medium].get(h, 0) == 0, f"{medium} announced {h} twice"
            held[medium][h] = held[medium].get(h, 0) + (1 if stored else -1)
            assert held[medium][h] in (0, 1)
        by_tokens = {tuple(tokens): h for h, (tokens, _) in own.items()}
        block = len(next(iter(own.values()))[0])  # vLLM's block size: a chunk completes CHUNK // block of them
        per_chunk = CHUNK // block
        reader, session = Engine.for_checkpoint(KDNConfig(**settings, write_policy="memory-only"), setup[1],
                                                torch.float32, lambda: describe_checkpoint(setup[1], torch.float32))
        there = {"STORAGE": set(), "STORAGE/REMOTE": set()}
        for doc in docs:
            for i, key in enumerate(session.prefix_keys(np.asarray(doc, dtype=np.uint32))):
                blocks = {by_tokens[tuple(doc[j * block:(j + 1) * block])]
                          for j in range(i * per_chunk, (i + 1) * per_chunk)}
                for medium, tier in (("STORAGE", "disk"), ("STORAGE/REMOTE", "remote")):
                    if reader.tier(tier) is not None and reader.tier(tier).contains(key):
                        there[medium].update(blocks)
        for medium in there:
            assert {h for h, n in held[medium].items() if n} == there[medium], medium
        assert len(there["STORAGE"]) == 12 * per_chunk
        assert sum(1 for m, stored, *_ in events if m == "CPU" and stored) == 16 * per_chunk
        assert sum(1 for m, stored, *_ in events if m == "CPU" and not stored) >= 8 * per_chunk  # the first two
        assert sum(held["CPU"].values()) == 8 * per_chunk
        if redis is not None:  # every chunk sent, the store evicted some: each eviction announced
            remote = [stored for m, stored, *_ in events if m == "STORAGE/REMOTE"]
            assert remote.count(True) == 16 * per_chunk and remote.count(False) >= 4 * per_chunk
            assert 0 < len(there["STORAGE/REMOTE"]) <= 10 * per_chunk
    finally:
        if redis is not None:
            redis.stop()
