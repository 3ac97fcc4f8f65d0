"""The one door tests use into an engine's own parts (:class:`kdn.engine.chunks.ChunkIO`): tests that
forge, drop or read stored blobs below the Engine's API (a chunk evicted between a lookup and its
load, a blob planted under another chunk's key, verification counters). Everything else, tests
included, drives kdn through :class:`kdn.engine.Engine` (``tests/test_code_rules.py`` checks it)."""

from __future__ import annotations

import numpy as np


def chunk_io(engine):
    """The engine's chunk reader/writer."""
    return engine.chunks


def drop_chunk(engine, session, tokens, index: int, limit: int | None = None) -> list:
    """Drop chunk ``index`` of the stored prefix of ``tokens`` (at most ``limit`` tokens; every
    fidelity, with its pointers), as verification does with a chunk that differs: a hole in the
    middle of a stored prompt. The keys dropped."""
    tokens = np.asarray(tokens, dtype=np.uint32)
    io = engine.chunks
    found = io.find(session, tokens, len(tokens) if limit is None else limit)
    return io.drop_chunks(session, tokens, found, [index])


def tiers(engine):
    """The engine's tier manager (what a test plants blobs in, drops them from, or watches)."""
    return engine.tiers


def plant(engine, key: bytes, blob) -> bool:
    """File ``blob`` under ``key`` in place of whatever is stored there (every fidelity's copy dropped
    first): a forged or a damaged blob a reader will meet. True if a tier took it."""
    for address in engine.tiers.addresses(key):
        engine.tiers.drop(address)
    return engine.tiers.put(key, blob)


def held(engine, key: bytes) -> bool:
    """Whether a local tier holds ``key``."""
    return engine.tiers.held([key])[0]
