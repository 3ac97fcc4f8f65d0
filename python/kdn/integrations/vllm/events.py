"""KV events for a prefix-cache-aware router: what kdn's tiers in this engine file and remove, in vLLM's
KV event stream (``--kv-events-config``), under vLLM's own block hashes (:mod:`kdn.integrations.vllm`).

The worker's tiers log every blob filed and removed (:meth:`kdn.engine.Engine.take_tier_events`); the
worker hands them to the scheduler in vLLM's ``KVConnectorOutput`` (:class:`TierEvents`); the
scheduler, which saw each stored request's block hashes, token ids, LoRA adapter and extra keys,
announces each chunk as a ``BlockStored`` of the vLLM blocks it completes (medium ``CPU`` for kdn's
memory tier, ``STORAGE`` for its disk, both locality ``LOCAL``; ``STORAGE`` with locality ``REMOTE`` for
the chunks this engine wrote to a remote store) and each removal as a ``BlockRemoved`` of the same
hashes (:class:`Announcer`), once per KV cache group, each naming its group (``group_idx``, and on a
store its kind and sliding window, as vLLM's own offloading announces them: a chunk holds every
layer, so each group's blocks are held): a remote store's evictions, expiries and deletes as the store tells them
(:mod:`kdn.storage.remote_events`). A router that indexes vLLM's own events (llm-d, Dynamo) matches
kdn-held prefixes with no kdn code. Blobs that are not a stored prompt's chunks (pointers, sidecars,
files another process wrote) are not announced.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kdn.engine import Engine, ModelSession
from kdn.integrations.vllm.kv_layers import KVGroups

log = logging.getLogger("kdn")
# (medium, locality) of each tier; the node tier (shared memory) is not announced: vLLM's media have
# no name for it, and as "CPU" its removals would read as the memory tier's
MEDIA = {"memory": (MEDIUM_CPU, "LOCAL"), "disk": (MEDIUM_STORAGE, "LOCAL"), "remote": (MEDIUM_STORAGE, "REMOTE")}
KNOWN_CHUNKS = 1 << 18  # chunks whose announcement is remembered (for their removal), least recent forgotten


class TierEvents(KVConnectorKVEvents):
    """The worker's tier events ``[(tier, stored, address), ...]``, carried to the scheduler."""

    def __init__(self, events: list | None = None):
        self.events, self.workers = list(events or []), 1

    def add_events(self, events: list) -> None:
        self.events.extend(events)

    def aggregate(self) -> TierEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events = []


@dataclasses.dataclass
class _Blocks:
    """What a request's prompt announces: vLLM's hash of each full block, its adapter and extra keys."""

    hashes: list
    lora_id: int | None
    lora_name: str | None
    extra_keys: list | None


@dataclasses.dataclass
class _Chunk:
    """What one stored chunk announces: the vLLM blocks it completes."""

    first: int  # its first block's index in the prompt
    blocks: _Blocks
    token_ids: list


class Announcer:
    """The scheduler's side: a request's blocks noted at its lookup (:meth:`note_request`), its chunks
    at its store (:meth:`note_store`), the worker's tier events turned into vLLM's (:meth:`take`)."""

    def __init__(self, engine: Engine, block_size: int, groups: KVGroups | None = None):
        self.engine, self.block_size = engine, block_size
        # per KV cache group: what its events name (none: this vLLM's events name no group)
        kinds = (groups or KVGroups()).kinds if "group_idx" in getattr(BlockStored, "__struct_fields__", ()) else ()
        self._groups = [({"group_idx": g}, {"group_idx": g, "kv_cache_spec_kind": kind,
                                            "kv_cache_spec_sliding_window": window})
                        for g, (kind, window) in enumerate(kinds)] or [({}, {})]
        self._requests: dict[str, _Blocks] = {}
        self._chunks: collections.OrderedDict[bytes, _Chunk] = collections.OrderedDict()
        self._raw: list = []
        self.unannounced = 0  # tier events of blobs that are no stored prompt's chunk
        self._warned = False

    def safely(self, note, *args) -> None:
        """``note(*args)``; what a request's content makes it raise is logged once and announces nothing
        of that request (a hook never raises into vLLM's scheduler)."""
        try:
            note(*args)
        except Exception as e:  # noqa: BLE001 - any request content
            if not self._warned:
                self._warned = True
                log.warning("kdn: KV events: a request's blocks not announced: %s", e)

    def note_request(self, request) -> None:
        if request.request_id in self._requests:  # asked again (it waits, or was preempted): the same blocks
            return
        hashes = [maybe_convert_block_hash(h) for h in getattr(request, "block_hashes", None) or []]
        lora = getattr(request, "lora_request", None)
        self._requests[request.request_id] = _Blocks(hashes, getattr(lora, "adapter_id", None),
                                                     getattr(lora, "name", None), _extra_keys(request, len(hashes),
                                                                                              self.block_size))

    def note_store(self, req_id: str, session: ModelSession, tokens: list) -> None:
        """The request ``req_id`` stores its prompt ``tokens`` under ``session``: each chunk announces the
        vLLM blocks whose last token it holds."""
        blocks = self._requests.get(req_id)
        if blocks is None or not blocks.hashes:
            return
        chunk, size = session.chunk_size, self.block_size
        keys = session.prefix_keys(session.tokens(tokens), include_partial=True)
        for i, key in enumerate(keys):
            start, end = i * chunk, min(len(tokens), (i + 1) * chunk)
            first, last = start // size, min(end // size, len(blocks.hashes))  # blocks whose last token is here
            if last <= first:
                continue
            record = _Chunk(first, blocks, list(tokens[first * size:last * size]))
            for address in self.engine.addresses(key):
                self._chunks[address] = record
                self._chunks.move_to_end(address)
        while len(self._chunks) > KNOWN_CHUNKS:
            self._chunks.popitem(last=False)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def add(self, events: KVConnectorKVEvents | None) -> None:
        if isinstance(events, TierEvents):
            self._raw.extend(events.get_all_events())

    def take(self) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        raw, self._raw = self._raw, []
        for tier, stored, address in raw:
            chunk = self._chunks.get(address)
            if chunk is None or tier not in MEDIA:
                self.unannounced += 1
                continue
            n = len(chunk.token_ids) // self.block_size
            hashes = chunk.blocks.hashes[chunk.first:chunk.first + n]
            medium, locality = MEDIA[tier]
            if not stored:
                out += [BlockRemoved(block_hashes=hashes, medium=medium, locality=locality, **removed)
                        for removed, _ in self._groups]
                continue
            extra = (chunk.blocks.extra_keys or [])[chunk.first:chunk.first + n]
            out += [BlockStored(block_hashes=hashes,
                                parent_block_hash=chunk.blocks.hashes[chunk.first - 1] if chunk.first else None,
                                token_ids=chunk.token_ids, block_size=self.block_size, lora_id=chunk.blocks.lora_id,
                                medium=medium, lora_name=chunk.blocks.lora_name,
                                extra_keys=extra if any(k is not None for k in extra) else None, locality=locality,
                                **group) for _, group in self._groups]
        return out


def hit_sources(holders: tuple, chunk: int, start: int, n: int) -> dict:
    """Where the ``n`` prompt tokens a hit serves from ``start`` on are held, as vLLM's
    ``CacheHitSource`` counts, from the fastest tier holding each chunk (``holders``,
    :meth:`kdn.storage.TierManager.holders`): kdn's memory and node tiers (``host``), its disk
    (``disk``), else a remote store (``external_unspecified``)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    sources = {"memory": CacheHitSource.HOST, "node": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
    counts = collections.Counter()
    for i in range(start // chunk, min(len(holders), -(-(start + n) // chunk))):
        covered = min(start + n, (i + 1) * chunk) - max(start, i * chunk)
        counts[sources.get(holders[i], CacheHitSource.EXTERNAL_UNSPECIFIED)] += covered
    return {source: count for source, count in counts.items() if count}


def _extra_keys(request, blocks: int, size: int) -> list | None:
    """vLLM's untagged extra keys of each full block (LoRA name, multimodal inputs, cache salt), as its
    own events publish them; None when there are none or this vLLM cannot say."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    except ImportError:
        return None
    keys, mm = [], 0
    for j in range(blocks):
        extra, mm = generate_block_hash_extra_keys(request, j * size, (j + 1) * size, mm)
        keys.append(extra)
    return to_event_extra_keys(keys) if any(k is not None for k in keys) else None
