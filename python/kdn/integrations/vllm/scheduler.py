"""The vLLM connector's scheduler half: how many prompt tokens kdn holds, which requests wait for a
document another request is prefilling (in this engine, or claimed in a shared remote store), and
what the worker loads and stores each step (:mod:`kdn.integrations.vllm`)."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Any

import numpy as np

from kdn.engine import Engine, ModelSession, Prefix
from kdn.integrations.vllm import metrics, process
from kdn.integrations.vllm.kv_layers import KVGroups
from kdn.integrations.vllm.lookups import LookupClient, WorkerNotServing, request_digest
from kdn.integrations.vllm.scope import Scopes, Unservable
from kdn.integrations.vllm.specs import KDNConnectorMetadata, LoadSpec, SaveSpec

log = logging.getLogger("kdn")

# a request whose next chunk another request is prefilling (in this engine, or claimed in the remote
# store by another) waits for it (asked again each step) at most this long; a prefill that completed
# (its last step executed, not scheduled: a step may take longer than this on a loaded host) is
# waited on this long more, while its store lands. A claim in the remote store is a lease of
# CLAIM_LEASE_S that its engine renews while the prefill runs: a claim whose engine died, or that
# nobody renews, stops holding anyone within seconds; a store that cannot be used holds no one. A
# claim is a hint anyone who can name the chunk may write: a request waiting on another engine's
# claim computes once CLAIM_PROGRESS_LEASES leases pass with nothing more of its prompt stored.
IN_FLIGHT_WAIT_S, STORE_GRACE_S, CLAIM_LEASE_S = 120.0, 10.0, 5.0
CLAIM_PROGRESS_LEASES = 3
_COMPLETING = float("inf")  # an admitted request whose prefill's last step is scheduled, not yet run


@dataclasses.dataclass
class _Request:
    tokens: list
    block_ids: list  # one block table per KV cache group
    check: tuple | None = None  # (start, end): hit tokens held back to be verified
    scope: bytes | None = None  # its salt, adapter and inputs (kdn.keys.request_scope): KV is shared only within it


def claim_owner(engine_id: str) -> str:
    """How an engine's claims are named in a shared remote store: its vLLM engine id, printable ASCII."""
    return re.sub(r"[^\x21-\x7e]", "_", engine_id)[:200]


class SchedulerSide:
    """The scheduler's half of :class:`kdn.integrations.vllm.KDNConnector` for one engine and model:
    ``lookups`` asks the worker's process (its memory tier is its own), ``owner`` names this engine's
    claims in a shared remote store (:func:`claim_owner`); ``loads_async``: hits load before their
    request is scheduled (vLLM's asynchronous KV load, ``KDNConfig.vllm_load``), else in its step."""

    def __init__(self, engine: Engine, session: ModelSession, block_size: int, lookups: LookupClient, owner: str,
                 loads_async: bool = False, groups: KVGroups | None = None):
        self.engine, self.session, self.block_size, self._lookups = engine, session, block_size, lookups
        self.owner, self.loads_async, self.groups = owner, loads_async, groups or KVGroups()
        self.not_serving = False  # the worker refused the engine (its answer to a lookup): requests run without kdn
        self._pending: dict[str, int] = {}  # req_id -> external tokens to load
        self._checks: dict[str, tuple] = {}  # req_id -> (start, end) of a hit held back for verification
        self._found: dict[str, Prefix] = {}  # req_id -> what its last lookup found
        # req_id -> [since when it waits for another's prefill, since when nothing more was stored, hit then]
        self._waiting: dict[str, list] = {}
        # req_id -> [prompt tokens, prefill completed at (None: running, _COMPLETING), claimed keys, scope];
        # kept STORE_GRACE_S past its request's end, while its store lands
        self._admitted: dict[str, list] = {}
        self._stores_ended: set[bytes] = set()  # request_digest of requests whose store the worker says has ended
        self._claims: dict[str, list[bytes]] = {}  # req_id -> the chunks it will compute (claimed)
        self._scopes: dict[str, bytes | None] = {}  # req_id -> its scope (salt, adapter, inputs)
        self._unserved: set[str] = set()  # requests kdn cannot key (prompt embeddings, ...): nothing loaded or stored
        self._retention: dict[str, tuple] = {}  # req_id -> (seconds to keep it pinned or None, whether to store it)
        self.scopes = Scopes()
        self._renewed = 0.0  # when the claims of running prefills were last renewed
        self._requests: dict[str, _Request] = {}
        # req_id -> (tokens vLLM's own prefix cache holds, the worker's tier holding each chunk), at its lookup
        self._local: dict[str, tuple] = {}
        self._before: list[LoadSpec] = []  # async loads to start this step
        self._loaded_before: set[str] = set()  # requests an async load served: their next schedule is no restart

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.not_serving:
            return 0, False
        try:
            scope = self.scopes.of(request)  # salt, LoRA adapter, multimodal inputs: all in the keys
        except Unservable as e:
            self._unserved.add(request.request_id)
            self.scopes.warn_once(request.request_id, str(e))
            return 0, False
        tokens = np.asarray(request.prompt_token_ids or [], dtype=np.uint32)
        self._scopes[request.request_id] = scope
        self._retention[request.request_id] = retention = self.retention_of(request)
        session = self.session.within(scope)
        began = time.perf_counter()
        found = None  # the last token is computed: limit len - 1
        if not process.worker_here(self.engine):  # ask the worker's process: its memory tier is its own
            try:
                found = self._lookups.lookup(tokens, len(tokens) - 1, scope)
            except WorkerNotServing as e:
                log.warning("kdn: %s; requests run without kdn", e)
                self.not_serving = True
                return 0, False
            self._stores_ended.update(self._lookups.take_ended())  # told with the answer
        else:
            self._stores_ended.update(map(request_digest, process.ended_stores(self.engine)))
        if found is None:
            # where each chunk is held, when the worker's tiers are these
            found = self.engine.find(session, tokens, len(tokens) - 1, holders=process.worker_here(self.engine))
            metrics.count(lookups=1)
        metrics.count(lookup_seconds=time.perf_counter() - began)
        hit = found.tokens
        self._found[request.request_id] = found  # the worker's load reads these chunks, without a second lookup
        if self._prefilled_elsewhere(request.request_id, tokens, hit, session, claims=retention[1]):
            return None, False  # vLLM skips the request this step and asks again
        # verified: vLLM computes the last ones (an ephemeral request stores nothing, checks nothing)
        span = self.engine.sample_check(hit - num_computed_tokens) if retention[1] else 0
        if span:
            self._checks[request.request_id] = (hit - span, hit)
        else:
            self._checks.pop(request.request_id, None)
        self._local[request.request_id] = (num_computed_tokens, found.holders)
        external = max(0, hit - span - num_computed_tokens)
        return external, self.loads_async and external > 0

    def hit_of(self, req_id: str) -> tuple[int, tuple]:
        """Where a request's kdn hit starts (the tokens vLLM's own prefix cache held at its lookup), and
        the worker's tier holding each chunk at its lookup ("": a remote store's; () not known)."""
        return self._local.get(req_id, (0, ()))

    def retention_of(self, request) -> tuple:
        """What a request asks kdn to keep (``kv_transfer_params={"kdn": {"retain": seconds, "store":
        false}}``): ``(seconds or None, store)``; a value kdn cannot use is logged once and ignored
        (request content never raises into vLLM)."""
        params = getattr(request, "kv_transfer_params", None)
        asked = params.get("kdn") if isinstance(params, dict) else None
        if not isinstance(asked, dict):
            return None, True
        retain, store = asked.get("retain"), asked.get("store", True)
        ok_retain = retain is None or (isinstance(retain, (int, float)) and not isinstance(retain, bool) and retain > 0)
        if not ok_retain or not isinstance(store, bool):
            self.scopes.warn_once(request.request_id, f"kv_transfer_params: kdn's retain must be positive seconds "
                                                      f"and store a boolean, got {asked!r:.200}",
                                  "is served and stored as if it had asked nothing")
            return None, True
        return (float(retain) if retain is not None and store else None), store

    def _prefilled_elsewhere(self, req_id: str, tokens: np.ndarray, hit: int, session: ModelSession,
                             claims: bool = True) -> bool:
        """Whether another request is computing at least one more chunk of this prompt than kdn
        holds (two questions of one document arriving together): one admitted in this engine, or,
        with a remote store, one another engine claimed there. Then this request waits for that KV
        to be stored, so the document is prefilled once (at most ``IN_FLIGHT_WAIT_S``); otherwise
        it has claimed the chunk it will compute (until ``STORE_GRACE_S`` after it finishes: its
        stores to a remote tier are queued, and a claim dropped at once let another engine miss).
        A finished request in this engine holds others until its store lands or the worker says it
        has ended (a store that cannot land holds no one), at most ``STORE_GRACE_S``."""
        need = hit + session.chunk_size
        now = time.monotonic()
        for done in [r for r, (_, at, _, _) in self._admitted.items() if at is not None and now - at > STORE_GRACE_S]:
            del self._admitted[done]  # prefilled and stored (or refused) already: nothing to wait for
        for done in [r for r in self._admitted if request_digest(r) in self._stores_ended]:
            del self._admitted[done]  # its store landed, or never will (refused, a full tier): wait no more
        self._stores_ended.clear()
        busy, claimed, keys = False, False, []
        scope = self._scopes.get(req_id)
        if need < len(tokens):
            for other_id, (other, _, _, other_scope) in self._admitted.items():
                if (other_id != req_id and other_scope == scope and len(other) >= need
                        and np.array_equal(other[:need], tokens[:need])):
                    busy = True
                    break
            keys = self.engine.computing_keys(session, tokens, hit) if claims else []  # an ephemeral one: none
            if not busy and keys:  # claimed now, at lookup: of two engines asked at once, one computes
                # False: another engine's live claim; None (the store cannot tell): computes now
                busy = claimed = self.engine.claim(keys, self.owner, CLAIM_LEASE_S) is False
        if busy:
            waited = self._waiting.setdefault(req_id, [now, now, hit])
            if hit > waited[2]:  # more of it was stored meanwhile: its claimant is making progress
                waited[1:] = [now, hit]
            stalled = claimed and now - waited[1] >= CLAIM_PROGRESS_LEASES * CLAIM_LEASE_S
            if now - waited[0] < IN_FLIGHT_WAIT_S and not stalled:
                return True
            if stalled:
                metrics.count(stalled_claims=1)
            keys = []  # waited long enough: computes it too, without a claim
        self._claims[req_id] = keys
        if self._waiting.pop(req_id, None) is not None:
            metrics.count(in_flight_waits=1)
        return False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if request.request_id in self._unserved or not self._retention.get(request.request_id, (None, True))[1]:
            return  # nothing of it will be stored: nobody waits for it
        # admitted: the next request's lookup in this very step sees that this one prefills its prompt
        keys = self._claims.pop(request.request_id, [])  # claimed at its lookup: renewed when it finishes
        self._admitted[request.request_id] = [np.asarray(request.prompt_token_ids or [], dtype=np.uint32), None, keys,
                                              self._scopes.get(request.request_id)]
        if num_external_tokens > 0 and self.loads_async:  # loaded now; vLLM schedules it once loaded
            req_id, local = request.request_id, self.hit_of(request.request_id)[0]
            end = local + num_external_tokens
            self._before.append(LoadSpec(req_id, list(request.prompt_token_ids or [])[:end], local, end,
                                         [list(ids) for ids in blocks.get_block_ids()], self._scopes.get(req_id),
                                         self._found.pop(req_id, None), before=True))
            self._loaded_before.add(req_id)
        elif num_external_tokens > 0:
            self._pending[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KDNConnectorMetadata:
        meta = KDNConnectorMetadata()
        meta.loads, self._before = self._before, []
        self._renew_claims()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._unserved:
                continue
            req = self._requests[new.req_id] = _Request(list(new.prompt_token_ids or []),
                                                        [list(ids) for ids in new.block_ids],
                                                        self._checks.pop(new.req_id, None),
                                                        self._scopes.get(new.req_id))
            if new.req_id not in self._loaded_before:  # else what its async load served stays known
                meta.fresh.append(new.req_id)
            self._loaded_before.discard(new.req_id)
            external = self._pending.pop(new.req_id, 0)
            if external:
                start = new.num_computed_tokens - external
                meta.loads.append(LoadSpec(new.req_id, req.tokens[:new.num_computed_tokens], start,
                                           new.num_computed_tokens, req.block_ids, req.scope,
                                           self._found.pop(new.req_id, None)))
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if new_blocks is not None:
                req.block_ids = [list(new) if resumed else held + list(new)
                                 for held, new in zip(req.block_ids, new_blocks)]
            admitted = self._admitted.get(req_id)
            if admitted is not None and admitted[1] == _COMPLETING and cached.num_computed_tokens[i] >= len(req.tokens):
                admitted[1] = time.monotonic()  # the step that completed its prefill has run
            if resumed:  # preempted, now recomputed (and perhaps loaded) from scratch
                if req_id not in self._loaded_before:
                    meta.fresh.append(req_id)
                self._loaded_before.discard(req_id)
                req.check = self._checks.pop(req_id, None)
            external = self._pending.pop(req_id, 0)
            if external:  # resumed after preemption with a fresh load
                done = cached.num_computed_tokens[i]
                meta.loads.append(LoadSpec(req_id, req.tokens[:done], done - external, done, req.block_ids,
                                           req.scope, self._found.pop(req_id, None)))
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        return meta

    def _renew_claims(self) -> None:
        """Renew the leases of the chunks this engine's prefills claimed, while they run and for
        ``STORE_GRACE_S`` after (their stores land), every third of a lease in one round trip: engines
        waiting on them keep waiting only while this engine is alive and on its way to storing them."""
        now = time.monotonic()
        if now - self._renewed < CLAIM_LEASE_S / 3:
            return
        self._renewed = now
        keys = [k for _, at, claimed, _ in self._admitted.values() if at is None or now - at < STORE_GRACE_S
                for k in claimed]
        if keys:
            self.engine.renew_claims(keys, self.owner, CLAIM_LEASE_S)

    def _maybe_save(self, meta: KDNConnectorMetadata, req_id: str, computed: int, scheduled: int) -> None:
        """A step that completes a prompt's prefill (``computed`` tokens before it, ``scheduled`` in
        it) stores it; the worker refuses it if a load of that step failed or lossy KV was served
        (:mod:`kdn.engine.served`). A prefill recomputed after a failed load, or after preemption,
        completes again, and is stored then. A windowed model's prefill also stores the chunks each
        of its steps completes (``partial``): vLLM frees a sliding layer's blocks below its window
        as the prefill goes on, so each chunk is stored while its blocks hold it."""
        req = self._requests[req_id]
        n, end = len(req.tokens), computed + scheduled
        chunk = self.session.chunk_size
        if computed < n <= end:
            check = req.check if req.check is not None and computed <= req.check[0] else None
        elif self.groups.windowed and end < n and end // chunk > computed // chunk:
            n, check = end // chunk * chunk, None
        else:
            return
        retain, store = self._retention.get(req_id, (None, True))
        if not store:
            return  # an ephemeral request: served, never stored
        partial = n < len(req.tokens)
        if req_id in self._admitted and not partial:
            self._admitted[req_id][1] = _COMPLETING
        blocks = -(-n // self.block_size)
        meta.saves.append(SaveSpec(req_id, req.tokens[:n], [ids[:blocks] for ids in req.block_ids], check, req.scope,
                                   None if partial else retain, partial=partial,
                                   kept_from=self.groups.kept_from(computed, self.block_size)))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._scopes.pop(request.request_id, None)
        self._unserved.discard(request.request_id)
        self._retention.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._checks.pop(request.request_id, None)
        self._found.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._local.pop(request.request_id, None)
        self._loaded_before.discard(request.request_id)
        admitted = self._admitted.get(request.request_id)
        keys = self._claims.pop(request.request_id, None) or (admitted[2] if admitted is not None else [])
        if admitted is not None:
            if admitted[1] is None:  # ended before its prefill completed: nothing of it is on its way
                del self._admitted[request.request_id]
            else:  # its store may still be on its way: others wait STORE_GRACE_S more for it
                admitted[1] = min(admitted[1], time.monotonic())
        if keys:  # kept STORE_GRACE_S more, not dropped: its KV may still be on its way to the store
            self.engine.claim(keys, self.owner, STORE_GRACE_S)
        return False, None  # the KV was copied out in the step that finished the prefill
