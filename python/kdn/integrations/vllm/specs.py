"""What the vLLM connector's scheduler half tells its worker half each step (the connector metadata)."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass
class LoadSpec:
    """Load tokens [start, end) of ``tokens`` from kdn into ``block_ids`` (a block table per KV cache
    group), in the request's ``scope``
    (:func:`kdn.keys.request_scope` of its salt, adapter and inputs; None for none)."""

    req_id: str
    tokens: list
    start: int
    end: int
    block_ids: list
    scope: bytes | None = None
    found: object = None  # what the scheduler's lookup found (a kdn.engine.Prefix): loaded without a second lookup
    before: bool = False  # loaded before the request is scheduled (vLLM's async KV load), reported when done
    blend: object = None  # a kdn.engine.passages.Blend: [start, end) is joined from its passages, recomputed


@dataclasses.dataclass
class SaveSpec:
    """Store the KV of ``tokens`` (a prefill this step completed, or with ``partial`` the chunks of
    one a step of a windowed model completed), held in ``block_ids`` (a table per KV cache group) from
    position ``kept_from`` on (a windowed layer's blocks before it may be vLLM's again); with
    ``check = (start, end)``, first compare the rows [start, end) vLLM computed with kdn's."""

    req_id: str
    tokens: list
    block_ids: list
    check: tuple | None = None
    scope: bytes | None = None
    retain: float | None = None  # seconds the request asked its prompt be kept pinned (kv_transfer_params)
    partial: bool = False  # the prefill goes on: its request's store has not ended
    kept_from: int = 0
    blend: object = None  # a kdn.engine.passages.Blend: its pieces no tier holds are computed and stored


@dataclasses.dataclass
class KDNConnectorMetadata(KVConnectorMetadata):
    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    fresh: list = dataclasses.field(default_factory=list)  # requests (re)started from scratch this step
