"""A token-addressed serving engine's requests, from lookup to finish, as kdn serves them: what each
lookup found, the hit held back to be verified, the chunks a request claims, a request that waits
for another's prefill of its document (in this engine, or claimed in a shared store), and a finished
prefill whose store is still landing. Engine-agnostic: a face (vLLM's connector) translates its
engine's callbacks into these calls and keeps only its engine's own state (block tables)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time

import numpy as np

from kdn.engine.chunks import Prefix
from kdn.engine.core import Engine
from kdn.engine.retention import Retention
from kdn.engine.session import ModelSession

COMPLETING = float("inf")  # an admitted request whose prefill's last step is scheduled, not yet run
ID_DIGEST_BYTES = 16


def request_digest(request_id: str) -> bytes:
    """The 16 bytes that name a request id on the wire (any length, any characters)."""
    return hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=ID_DIGEST_BYTES).digest()


def claim_owner(engine_id: str) -> str:
    """How an engine's claims are named in a shared remote store: its engine id, printable ASCII."""
    return re.sub(r"[^\x21-\x7e]", "_", engine_id)[:200]


@dataclasses.dataclass
class Request:
    """One request as kdn serves it. ``keyed``: False when kdn cannot key it (prompt embeddings, ...):
    nothing is loaded or stored for it."""

    id: str
    tokens: np.ndarray
    scope: bytes | None = None  # its salt, adapter and inputs (kdn.keys.request_scope): KV shared only within it
    keyed: bool = True
    retain: Retention | None = None  # what it asked kdn to keep of its stored prompt
    store: bool = True  # False: ephemeral, served and never stored
    found: Prefix | None = None  # what its last lookup found (the load reads these chunks, no second lookup)
    local: int = 0  # tokens the serving engine's own cache held at its lookup: where kdn's hit starts
    holders: tuple = ()  # the tier holding each chunk at its lookup ("": a remote store's; () not known)
    check: tuple | None = None  # (start, end): hit tokens held back to be verified (computed, compared)
    load: int = 0  # tokens kdn loads once it is admitted (its engine's blocks allocated)
    claims: list = dataclasses.field(default_factory=list)  # the chunks it will compute, claimed at its lookup
    waiting: list | None = None  # [since when it waits for another prefill, since when nothing more came, hit then]
    admitted: bool = False
    completed_at: float | None = None  # its prefill completed then (COMPLETING: its last step is scheduled)


class Requests:
    """kdn's serving policy over one engine's requests, for one model (``engine``; ``owner`` names
    this engine's claims in a shared remote store, :func:`claim_owner`).

    A request whose next chunk another request is prefilling (in this engine, or claimed in the
    remote store by another) waits for it (asked again each step) at most ``in_flight_wait``
    seconds; a prefill that completed (its last step executed, not scheduled: a step may take longer
    than this on a loaded host) is waited on ``store_grace`` more, while its store lands. A claim in
    the remote store is a lease of ``lease`` seconds that its engine renews while the prefill runs: a
    claim whose engine died, or that nobody renews, stops holding anyone within seconds; a store
    that cannot be used holds no one. A claim is a hint anyone who can name the chunk may write: a
    request waiting on another engine's claim computes once ``progress_leases`` leases pass with
    nothing more of its prompt stored.

    Lifecycle: :meth:`lookup` (each time the engine asks; None: wait) → :meth:`admit` (its blocks
    allocated) → :meth:`completing` / :meth:`completed` (the step that completes its prefill is
    scheduled, then has run) → :meth:`finished`; :meth:`stores_ended` tells which stores have landed
    or never will; :meth:`renew_claims` each step."""

    in_flight_wait, store_grace, lease, progress_leases = 120.0, 10.0, 5.0, 3

    def __init__(self, engine: Engine, owner: str, count=lambda **counts: None, clock=time.monotonic):
        self.engine, self.owner, self.count, self.clock = engine, owner, count, clock
        self._live: dict[str, Request] = {}
        self._admitted: dict[str, Request] = {}  # admitted; kept store_grace past its end, while its store lands
        self._ended: set[bytes] = set()  # request_digest of requests whose store has ended (landed or refused)
        self._renewed = float("-inf")  # when the claims of running prefills were last renewed

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._live

    def get(self, req_id: str) -> Request | None:
        return self._live.get(req_id)

    def unkeyed(self, req_id: str) -> None:
        """A request kdn cannot key: nothing is loaded or stored for it."""
        self._live[req_id] = Request(req_id, np.zeros(0, np.uint32), keyed=False)

    def lookup(self, session: ModelSession, req_id: str, tokens: np.ndarray, scope: bytes | None, found: Prefix,
               computed: int, retain: Retention | None = None, store: bool = True, wait: bool = True) -> int | None:
        """A request's lookup (``found``, in ``session``: its model within ``scope``) once the engine's
        own cache holds ``computed`` tokens: how many tokens kdn will load, or None when it waits for
        another's prefill of its document (the engine asks again later). An ephemeral request
        (``store=False``) claims nothing and checks nothing; ``wait=False`` (an engine that never
        loads) waits for no one and claims nothing. Counted through ``count``: requests
        that waited (``in_flight_waits``) and waits a stalled claim ended (``stalled_claims``)."""
        req = self._live.get(req_id)
        if req is None or not req.keyed:
            req = self._live[req_id] = Request(req_id, tokens)
        req.tokens, req.scope, req.retain, req.store, req.found = tokens, scope, retain, store, found
        hit = found.tokens
        if wait and self._held(req, hit, session):
            return None
        span = self.engine.sample_check(hit - computed) if store else 0  # verified: the engine computes the last ones
        req.check = (hit - span, hit) if span else None
        req.local, req.holders = computed, found.holders
        return max(0, hit - span - computed)

    def _held(self, req: Request, hit: int, session: ModelSession) -> bool:
        """Whether another request is computing at least one more chunk of this prompt than kdn
        holds (two questions of one document arriving together): one admitted in this engine, or,
        with a remote store, one another engine claimed there. Then this request waits for that KV
        to be stored, so the document is prefilled once (at most ``in_flight_wait``); otherwise it
        has claimed the chunk it will compute (until ``store_grace`` after it finishes: its stores
        to a remote tier are queued, and a claim dropped at once let another engine miss). A
        finished request in this engine holds others until its store lands or its engine says it has
        ended (a store that cannot land holds no one), at most ``store_grace``."""
        need = hit + session.chunk_size
        now = self.clock()
        self._forget_landed(now)
        busy, claimed, keys = False, False, []
        if need < len(req.tokens):
            busy = any(other.id != req.id and other.scope == req.scope and len(other.tokens) >= need
                       and np.array_equal(other.tokens[:need], req.tokens[:need]) for other in self._admitted.values())
            keys = self.engine.computing_keys(session, req.tokens, hit) if req.store else []  # ephemeral: none
            if not busy and keys:  # claimed now, at lookup: of two engines asked at once, one computes
                # False: another engine's live claim; None (the store cannot tell): computes now
                busy = claimed = self.engine.claim(keys, self.owner, self.lease) is False
        if busy:
            waited = req.waiting = req.waiting or [now, now, hit]
            if hit > waited[2]:  # more of it was stored meanwhile: its claimant is making progress
                waited[1:] = [now, hit]
            stalled = claimed and now - waited[1] >= self.progress_leases * self.lease
            if now - waited[0] < self.in_flight_wait and not stalled:
                return True
            if stalled:
                self.count(stalled_claims=1)
            keys = []  # waited long enough: computes it too, without a claim
        req.claims = keys
        if req.waiting is not None:
            req.waiting = None
            self.count(in_flight_waits=1)
        return False

    def _forget_landed(self, now: float) -> None:
        """Drop the finished prefills nobody need wait for: past ``store_grace``, or stored (or refused)."""
        for req_id in [r for r, req in self._admitted.items()
                       if (req.completed_at is not None and now - req.completed_at > self.store_grace)
                       or request_digest(r) in self._ended]:
            del self._admitted[req_id]
        self._ended.clear()

    def admit(self, req_id: str, load: int) -> Request | None:
        """The engine allocated the request's blocks for ``load`` tokens kdn loads: from now on the
        next lookup (in this very step) sees that it prefills its prompt. None: kdn serves it nothing."""
        req = self._live.get(req_id)
        if req is None or not req.keyed:
            return None
        req.load = load
        if req.store:  # a prompt that is stored: others wait for it
            req.admitted, req.completed_at = True, None
            self._admitted[req_id] = req
        return req

    def completing(self, req_id: str) -> None:
        """The step that completes the request's prefill is scheduled."""
        req = self._admitted.get(req_id)
        if req is not None:
            req.completed_at = COMPLETING

    def completed(self, req_id: str) -> None:
        """The step that completed its prefill has run (its store is on its way)."""
        req = self._admitted.get(req_id)
        if req is not None and req.completed_at == COMPLETING:
            req.completed_at = self.clock()

    def stores_ended(self, digests) -> None:
        """The :func:`request_digest` of requests whose store landed, or never will (refused, a full
        tier): nobody waits for them any more."""
        self._ended.update(digests)

    def renew_claims(self) -> None:
        """Renew the leases of the chunks this engine's prefills claimed, while they run and for
        ``store_grace`` after (their stores land), every third of a lease in one round trip: engines
        waiting on them keep waiting only while this engine is alive and on its way to storing them."""
        now = self.clock()
        if now - self._renewed < self.lease / 3:
            return
        self._renewed = now
        keys = [k for req in self._admitted.values()
                if req.completed_at is None or now - req.completed_at < self.store_grace for k in req.claims]
        if keys:
            self.engine.renew_claims(keys, self.owner, self.lease)

    def finished(self, req_id: str) -> None:
        """The request ended. A prefill that completed holds others ``store_grace`` more (its store may
        be on its way), and so do its claims; one that ended before is forgotten."""
        req = self._live.pop(req_id, None) or self._admitted.get(req_id)  # one record, live or landing
        keys = req.claims if req is not None else []
        admitted = self._admitted.get(req_id)
        if admitted is not None:
            if admitted.completed_at is None:  # ended before its prefill completed: nothing of it is on its way
                del self._admitted[req_id]
            else:
                admitted.completed_at = min(admitted.completed_at, self.clock())
        if keys:  # kept store_grace more, not dropped: its KV may still be on its way to the store
            self.engine.claim(keys, self.owner, self.store_grace)
