"""Prefill and decode on different vLLM engines through kdn's store (vLLM's disaggregated serving):
a ``kv_producer`` engine stores and never loads, a ``kv_consumer`` loads and never stores. The
hand-off is the store itself: a prefill request that asks ``do_remote_decode`` finishes with
``kv_transfer_params={"do_remote_prefill": true, "kdn": {"prefilled": n}}`` (``n`` prompt tokens its
store covers), which a proxy passes to the decode request; the decoder then waits, at most
``prefill_wait_s``, until its lookup finds the prefiller's whole chunks, and computes whatever is
still missing after that (a store that never lands, a prefiller that died, a decoder asked first).
It never serves part of a store as whole: a hit is whole chunks, each read and checked."""

from __future__ import annotations

import dataclasses
import time

from kdn._core import InvalidInputError

ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclasses.dataclass(frozen=True)
class Role:
    """What this engine does with the store (vLLM's ``kv_role``), and how long a consumer's request
    waits for its prefiller's store."""

    loads: bool = True
    stores: bool = True
    wait_s: float = 10.0

    @classmethod
    def of(cls, kv_role: str | None, wait_s: float) -> Role:
        role = kv_role or "kv_both"
        if role not in ROLES:
            raise InvalidInputError(f"kv_role {role!r}: kdn serves {', '.join(ROLES)}")
        return cls(role != "kv_producer", role != "kv_consumer", wait_s)


def _asked(request) -> dict:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def handed_off(role: Role, request, stored: bool) -> dict | None:
    """The ``kv_transfer_params`` a producer's finished request hands its decoder; ``prefilled`` is 0
    when its KV was not stored. None where kdn is not the hand-off: the request did not ask
    ``do_remote_decode``, or this engine is no ``kv_producer`` (beside a transfer connector in
    vLLM's MultiConnector, e.g. NIXL's ``kv_both``, the hand-off's parameters are that one's)."""
    if role.loads or not _asked(request).get("do_remote_decode"):
        return None
    prefilled = len(request.prompt_token_ids or []) if stored else 0
    return {"do_remote_prefill": True, "do_remote_decode": False, "kdn": {"prefilled": prefilled}}


def expected(request, chunk_size: int) -> int:
    """The tokens of a decode request's prompt its prefiller's store holds once landed: the whole
    chunks of ``prefilled`` (as the prefiller said), at most the prompt less its last token; 0 for
    a request that is no hand-off."""
    asked = _asked(request)
    kdn = asked.get("kdn") if isinstance(asked.get("kdn"), dict) else {}
    prefilled = kdn.get("prefilled")
    if not asked.get("do_remote_prefill") or isinstance(prefilled, bool) or not isinstance(prefilled, int):
        return 0
    n = min(prefilled, len(request.prompt_token_ids or []) - 1)
    return max(0, n // chunk_size * chunk_size)


class Handoffs:
    """A consumer's requests waiting for their prefiller's store: ``waits(req, hit, expected)`` is
    True while the hit falls short and ``wait_s`` has not passed since the request first asked
    (counted through ``count`` once as ``prefill_waits``; a wait that runs out as ``prefill_wait_timeouts``)."""

    def __init__(self, wait_s: float, count=lambda **counts: None, clock=time.monotonic):
        self.wait_s, self.count, self.clock = wait_s, count, clock
        self._since: dict[str, float] = {}
        self._given_up: set[str] = set()  # waited their bound: computed (a later lookup, after a preemption, too)

    def waits(self, req_id: str, hit: int, want: int) -> bool:
        if hit >= want or req_id in self._given_up:
            self._since.pop(req_id, None)
            return False
        now = self.clock()
        since = self._since.get(req_id)
        if since is None:
            self._since[req_id] = since = now
            self.count(prefill_waits=1)
        if now - since < self.wait_s:
            return True
        self._since.pop(req_id, None)
        self._given_up.add(req_id)
        self.count(prefill_wait_timeouts=1)
        return False

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._given_up.discard(req_id)
