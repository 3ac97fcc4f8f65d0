"""What kdn served a request (each running one of a serving engine's worker: :class:`ServedRequests`), and
the one rule on what of its KV may then be stored as exact.

Every face records what it served (:class:`Served`) and stores through :meth:`kdn.engine.ChunkIO.save`,
which asks :meth:`Served.unstorable` here, so the rule lives in one place:

* KV computed over a **lossy** prefix (a lossy codec, a delivery level, an accepted codec) is not
  the prompt's exact KV: never stored under exact keys (the lossy chunks themselves are already
  filed under their lossy addresses).
* After a **failed load** (a chunk evicted or damaged between lookup and load, a stream cut
  mid-way) the blocks that were never loaded hold whatever was there before, and the KV computed
  in that step is computed over them: nothing of the request is stored from that step. The engine
  recomputes the request (vLLM's ``kv_load_failure_policy="recompute"``, HF's ``generate``), and the
  recomputed KV is stored then.
* A **suspect** request (verification found its served KV differs from a recomputation) is not
  stored either: its KV was computed over the suspect chunks.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Served:
    """What kdn served one request.

    Attributes:
        tokens: leading prompt tokens whose KV kdn served (0: none).
        lossy: some of them came from a lossy coding.
        failed: a load of this request did not complete (its blocks after the loaded ones are stale).
        suspect: verification found the served KV different from a recomputation.
        checked: tokens ``[tokens, tokens + checked)`` were held back from the hit to be recomputed
            and compared with what is stored (:mod:`kdn.engine.verify`); they count as served for
            deciding whether the prompt is stored already.
    """

    tokens: int = 0
    lossy: bool = False
    failed: bool = False
    suspect: bool = False
    checked: int = 0

    def unstorable(self) -> str | None:
        """Why KV computed for this request must not be stored under exact keys, or None."""
        if self.failed:
            return "a load of this request failed: its KV was computed over blocks that were never loaded"
        if self.suspect:
            return "its served KV failed verification"
        if self.lossy:
            return "lossy KV was served: what was computed over it is not the prompt's exact KV"
        return None

    def covers(self, prompt_tokens: int, probe_step: int) -> bool:
        """True when kdn already holds (nearly) the whole prompt: storing it again would add nothing
        a lookup can use (less than one probe step)."""
        return self.tokens + self.checked >= prompt_tokens - max(probe_step, 1)


class ServedRequests:
    """What kdn served each running request of a serving engine's worker (a :class:`Served` each,
    from the step that starts it to its end), and where a windowed prefill's saves so far ended."""

    LOST = -1  # a windowed prefill's saves ended: nothing more of its prompt can be stored

    def __init__(self):
        self._served: dict[str, Served] = {}
        self._saved_to: dict[str, int] = {}

    def start(self, req_id: str) -> Served:
        """The request starts (again): nothing served yet, nothing of it saved."""
        self._saved_to.pop(req_id, None)
        served = self._served[req_id] = Served()
        return served

    def of(self, req_id: str) -> Served:
        """Its record (a new one for a request not started here)."""
        return self._served.setdefault(req_id, Served())

    def get(self, req_id: str) -> Served | None:
        """Its record, or None once it ended (aborted while a load ran)."""
        return self._served.get(req_id)

    def saved_to(self, req_id: str, final: bool) -> int:
        """Where its saves so far ended (0: none; :data:`LOST`); forgotten after its ``final`` save."""
        return self._saved_to.pop(req_id, 0) if final else self._saved_to.get(req_id, 0)

    def saved(self, req_id: str, to: int) -> None:
        self._saved_to[req_id] = to

    def step_ended(self) -> None:
        """The engine recomputes what failed in this step: a recomputed prefill is stored."""
        for served in self._served.values():
            served.failed = False

    def ended(self, req_ids) -> None:
        for req_id in req_ids:
            self._served.pop(req_id, None)
            self._saved_to.pop(req_id, None)
