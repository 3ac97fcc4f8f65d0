"""The vLLM connector's scheduler half: how many prompt tokens kdn holds, which requests wait for a
document another request is prefilling (in this engine, or claimed in a shared remote store), and
what the worker loads and stores each step (:mod:`kdn.integrations.vllm`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from kdn._core import InvalidInputError
from kdn.engine import Engine, ModelSession, Prefix, Retention, passages
from kdn.engine.channel import LookupClient, WorkerNotServing
from kdn.engine.messages import Readiness
from kdn.engine.requests import Request, Requests, request_digest
from kdn.integrations.vllm import blend, metrics, process
from kdn.integrations.vllm.disaggregated import Handoffs, Role, expected, handed_off
from kdn.integrations.vllm.kv_layers import KVGroups
from kdn.integrations.vllm.ranks import RankLookups
from kdn.integrations.vllm.scope import Scopes, Unservable
from kdn.integrations.vllm.specs import KDNConnectorMetadata, LoadSpec, SaveSpec
from kdn.integrations.vllm.vouch import resumed_req_ids

log = logging.getLogger("kdn")


@dataclasses.dataclass
class _Scheduled:
    """A scheduled request: kdn's record of it and vLLM's block tables (one per KV cache group)."""

    request: Request
    block_ids: list
    check: tuple | None = None  # (start, end) of its hit held back to be verified, when it was scheduled


class SchedulerSide:
    """The scheduler's half of :class:`kdn.integrations.vllm.KDNConnector` for one engine and model:
    vLLM's callbacks translated into kdn's serving policy (:class:`kdn.engine.requests.Requests`:
    lookups, in-flight waits, claims, verify spans, what each request stores) and into the loads and
    stores the worker runs each step. ``lookups`` asks the worker's process (its memory tier is its
    own), ``owner`` names this engine's claims in a shared remote store (:func:`kdn.engine.requests.claim_owner`);
    ``loads_async``: hits load before their request is scheduled (vLLM's asynchronous KV load,
    ``vllm_load`` in kv_connector_extra_config), else in its step. ``keys_shared``: every worker keys
    a chunk as ``session`` does, so a load reads the chunks the lookup found without looking again
    (False for tensor-parallel ranks holding shares of the heads: each looks in its own share).
    ``blending``: how a request that names its passages is blended (:mod:`.blend`); ``role``: whether
    it loads and stores (vLLM's ``kv_role``, :mod:`.disaggregated`)."""

    def __init__(self, engine: Engine, session: ModelSession, block_size: int, lookups: LookupClient | RankLookups,
                 owner: str, loads_async: bool = False, groups: KVGroups | None = None, keys_shared: bool = True,
                 blending: blend.Options | None = None, role: Role | None = None):
        self.engine, self.session, self.block_size, self._lookups = engine, session, block_size, lookups
        self.owner, self.loads_async, self.groups = owner, loads_async, groups or KVGroups()
        self.keys_shared = keys_shared
        self.requests = Requests(engine, owner, count=metrics.count)
        self.not_serving = False  # the worker refused the engine (its answer to a lookup): requests run without kdn
        self.scopes = Scopes()
        self._scheduled: dict[str, _Scheduled] = {}
        self._before: list[LoadSpec] = []  # async loads to start this step
        self._loaded_before: set[str] = set()  # requests an async load served: their next schedule is no restart
        self.blending = blending or blend.Options()
        self._blends: dict[str, passages.Blend] = {}  # requests that named passages: their pieces
        self._blend_loads: set[str] = set()  # those whose hit is a blended span
        self._said_unvouched = False
        self.role = role or Role()  # vLLM's kv_role: a prefiller never loads, a decoder never stores
        self.handoffs = Handoffs(self.role.wait_s, metrics.count)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.not_serving:
            return 0, False
        try:
            scope = self.scopes.of(request)  # salt, LoRA adapter, multimodal inputs: all in the keys
        except Unservable as e:
            self.requests.unkeyed(request.request_id)
            self.scopes.warn_once(request.request_id, str(e))
            return 0, False
        tokens = np.asarray(request.prompt_token_ids or [], dtype=np.uint32)
        retain, store = self.retention_of(request)
        store = store and self.role.stores
        session = self.session.within(scope)
        if not self.role.loads:  # a prefiller: computes and stores every prompt, waits for no one
            self.requests.lookup(session, request.request_id, tokens, scope, Prefix([], 0, 0), num_computed_tokens,
                                 retain, store, wait=False)
            return 0, False
        began = time.perf_counter()
        found = None  # the last token is computed: limit len - 1
        if not process.worker_here(self.engine):  # ask the worker's process: its memory tier is its own
            try:
                found = self._lookups.lookup(tokens, len(tokens) - 1, scope)
            except WorkerNotServing as e:
                log.warning("kdn: %s; requests run without kdn", e)
                self.not_serving = True
                return 0, False
            self.requests.stores_ended(self._lookups.take_ended())  # told with the answer
        else:
            self.requests.stores_ended(map(request_digest, process.ended_stores(self.engine)))
        if found is None:
            # where each chunk is held, when the worker's tiers are these
            found = self.engine.find(session, tokens, len(tokens) - 1, holders=process.worker_here(self.engine))
            metrics.count(lookups=1)
        metrics.count(lookup_seconds=time.perf_counter() - began)
        if self.handoffs.waits(request.request_id, found.tokens, expected(request, session.chunk_size)):
            return None, False  # the prefiller's store is still landing: vLLM asks again next step
        external = self.requests.lookup(session, request.request_id, tokens, scope, found, num_computed_tokens,
                                        retain, store)
        if external is None:
            return None, False  # vLLM skips the request this step and asks again
        planned = self._blend_of(request, session, tokens)
        self._blend_loads.discard(request.request_id)
        if planned is not None and planned.end > num_computed_tokens + external:
            record = self.requests.get(request.request_id)  # the blended span, not the exact prefix, is loaded
            record.check = record.found = None
            self._blend_loads.add(request.request_id)
            return planned.end - num_computed_tokens, False  # recomputed in the step, with the engine's layers
        return external, self.loads_async and external > 0

    def _blend_of(self, request, session: ModelSession, tokens: np.ndarray) -> passages.Blend | None:
        """The blend of a request that names its passages (kept for its load and its store), or None:
        it asked none, or cannot be blended here (said once, and served its exact prefix)."""
        self._blends.pop(request.request_id, None)
        try:
            asked = blend.asked(request, self.blending.separator)
        except InvalidInputError as e:
            self.scopes.warn_once(request.request_id, f"kv_transfer_params: kdn's {e}",
                                  "is served its exact prefix only")
            return None
        if asked is None:
            return None
        spans, ratio, selection = asked
        pieces = passages.cut(session, tokens, spans, self.blending.bos)
        keys = [p.key for p in passages.candidates(pieces, len(tokens))]
        ready = process.readiness(self.engine, keys) if process.worker_here(self.engine) \
            else self._lookups.readiness(keys)  # the worker's process holds its layers and its memory tier
        ready = ready or Readiness(False, why="the worker's lookup server did not answer")
        if not ready.blends or (self.blending.prefix_caching and not getattr(request, "cache_salt", None)):
            why = ready.why if not ready.blends else (
                "vLLM's prefix cache is on and the request has no cache_salt: its blended blocks would "
                "enter vLLM's prefix cache, where an exact request could be served them")
            self.scopes.warn_once(request.request_id, f"blending: {why}", "is served its exact prefix only")
            return None
        planned = self._blends[request.request_id] = passages.Blend(pieces, ready.held, ratio, selection)
        if not ready.vouched:  # its passages are stored once a prefill vouched for the layers; nothing blended yet
            if not self._said_unvouched:
                self._said_unvouched = True
                log.info("kdn: blending starts once kdn has run the engine's layers over a prompt whose exact KV "
                         "the engine holds and found that KV; until then requests are served their exact prefix")
            planned.held = 0
        return planned

    def hit_of(self, req_id: str) -> tuple[int, tuple]:
        """Where a request's kdn hit starts (the tokens vLLM's own prefix cache held at its lookup), and
        the worker's tier holding each chunk at its lookup ("": a remote store's; () not known)."""
        req = self.requests.get(req_id)
        return (req.local, req.holders) if req is not None else (0, ())

    def retention_of(self, request) -> tuple:
        """What a request asks kdn to keep (``kv_transfer_params={"kdn": {"retain": seconds, "priority":
        n, "store": false}}``): ``(Retention or None, store)``; a value kdn cannot use is logged once
        and ignored (request content never raises into vLLM)."""
        params = getattr(request, "kv_transfer_params", None)
        asked = params.get("kdn") if isinstance(params, dict) else None
        if not isinstance(asked, dict):
            return None, True
        store = asked.get("store", True)
        try:
            if not isinstance(store, bool):
                raise InvalidInputError(f"store: a boolean, got {store!r}")
            retention = Retention.asked(asked.get("retain"), asked.get("priority"))
        except InvalidInputError as e:
            self.scopes.warn_once(request.request_id, f"kv_transfer_params: kdn's {e} (in {asked!r:.200})",
                                  "is served and stored as if it had asked nothing")
            return None, True
        return (retention if retention and store else None), store

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req = self.requests.admit(request.request_id, num_external_tokens)
        if req is None or num_external_tokens <= 0 or not self.loads_async:
            return  # an in-step load is made when the request is scheduled (build_connector_meta)
        # loaded now; vLLM schedules it once loaded
        end = req.local + num_external_tokens
        self._before.append(LoadSpec(req.id, list(request.prompt_token_ids or [])[:end], req.local, end,
                                     [list(ids) for ids in blocks.get_block_ids()], req.scope,
                                     req.found if self.keys_shared else None, before=True))
        req.load, req.found = 0, None
        self._loaded_before.add(req.id)

    def build_connector_meta(self, scheduler_output) -> KDNConnectorMetadata:
        meta = KDNConnectorMetadata()
        meta.loads, self._before = self._before, []
        self.requests.renew_claims()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            record = self.requests.get(new.req_id)
            if record is None or not record.keyed:
                continue
            req = self._scheduled[new.req_id] = _Scheduled(record, [list(ids) for ids in new.block_ids], record.check)
            if new.req_id not in self._loaded_before:  # else what its async load served stays known
                meta.fresh.append(new.req_id)
            self._loaded_before.discard(new.req_id)
            self._load_in_step(meta, req, new.num_computed_tokens)
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            req = self._scheduled.get(req_id)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in resumed_ids
            if new_blocks is not None:
                req.block_ids = [list(new) if resumed else held + list(new)
                                 for held, new in zip(req.block_ids, new_blocks)]
            if cached.num_computed_tokens[i] >= len(req.request.tokens):
                self.requests.completed(req_id)  # the step that completed its prefill has run
            if resumed:  # preempted, now recomputed (and perhaps loaded) from scratch
                if req_id not in self._loaded_before:
                    meta.fresh.append(req_id)
                self._loaded_before.discard(req_id)
                req.check = req.request.check
            self._load_in_step(meta, req, cached.num_computed_tokens[i])  # resumed after preemption, loaded afresh
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        return meta

    def _load_in_step(self, meta: KDNConnectorMetadata, req: _Scheduled, done: int) -> None:
        """The load of a request scheduled with ``done`` tokens computed, the last ``load`` of them kdn's."""
        record = req.request
        if record.load:
            tokens = record.tokens[:done].tolist()
            blended = self._blends.get(record.id) if record.id in self._blend_loads else None
            meta.loads.append(LoadSpec(record.id, tokens, done - record.load, done, req.block_ids, record.scope,
                                       record.found if self.keys_shared else None, blend=blended))
            record.load, record.found = 0, None

    def _maybe_save(self, meta: KDNConnectorMetadata, req_id: str, computed: int, scheduled: int) -> None:
        """A step that completes a prompt's prefill (``computed`` tokens before it, ``scheduled`` in
        it) stores it; the worker refuses it if a load of that step failed or lossy KV was served
        (:mod:`kdn.engine.served`). A prefill recomputed after a failed load, or after preemption,
        completes again, and is stored then. A windowed model's prefill also stores the chunks each
        of its steps completes (``partial``): vLLM frees a sliding layer's blocks below its window
        as the prefill goes on, so each chunk is stored while its blocks hold it."""
        req = self._scheduled[req_id]
        record = req.request
        n, end = len(record.tokens), computed + scheduled
        chunk = self.session.chunk_size
        if computed < n <= end:
            check = req.check if req.check is not None and computed <= req.check[0] else None
        elif self.groups.windowed and end < n and end // chunk > computed // chunk:
            n, check = end // chunk * chunk, None
        else:
            return
        if not record.store:
            return  # an ephemeral request: served, never stored
        partial = n < len(record.tokens)
        if not partial:
            self.requests.completing(req_id)
        blocks = -(-n // self.block_size)
        meta.saves.append(SaveSpec(req_id, record.tokens[:n].tolist(), [ids[:blocks] for ids in req.block_ids],
                                   check, record.scope, None if partial else record.retain, partial=partial,
                                   kept_from=self.groups.kept_from(computed, self.block_size),
                                   blend=None if partial else self._blends.get(req_id)))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._scheduled.pop(request.request_id, None)
        self._loaded_before.discard(request.request_id)
        self._blends.pop(request.request_id, None)
        self._blend_loads.discard(request.request_id)
        self.handoffs.forget(request.request_id)
        record = self.requests.get(request.request_id)
        self.requests.finished(request.request_id)
        # the KV was copied out in the step that finished the prefill; a prefiller tells its decoder
        return False, handed_off(self.role, request, record is not None and record.store)
