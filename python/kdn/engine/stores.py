"""A serving engine's finished prefills on their way to the tiers: one background thread verifies
each one's held-back span, stores it under the fidelity rule, keeps it pinned as its request asked,
and remembers which requests' stores have ended (landed, refused or failed), so that nobody waits
for a store that cannot land. Engine-agnostic: a face hands it a :class:`StoreJob` per prefill."""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np

from kdn._core import InvalidInputError
from kdn.engine.core import Engine
from kdn.engine.retention import Retention
from kdn.engine.served import Served
from kdn.engine.session import ModelSession

log = logging.getLogger("kdn")


@dataclasses.dataclass
class StoreJob:
    """One prefill's store: ``tokens`` in ``session``, what kdn ``served`` the request, the span held
    back to be verified (``check``, compared with ``kv``: per-layer KV from position ``first``),
    ``packed`` what :meth:`kdn.engine.Engine.save` takes (or a callable that makes it on the store
    thread: a GPU's span sealed there; None: verify only), ``retain`` what its request asked kdn to keep,
    ``final``: False for a windowed prefill's earlier chunks (counted with its last, and not its end)."""

    req_id: str
    session: ModelSession
    tokens: np.ndarray
    served: Served
    packed: object = None
    check: tuple | None = None
    first: int = 0
    kv: list | None = None
    retain: Retention | None = None
    final: bool = True


class StoreQueue:
    """The store thread of one serving engine's worker over ``engine``: jobs in order, at most
    ``depth`` queued (a put waits beyond). ``count`` receives its counters (stores, stored_tokens,
    store/flush/CPU seconds, refused_stores, verify_checks and mismatches, retained_chunks,
    refused_retentions); the last ``keep_ended`` ended stores are kept until :meth:`ended` is asked."""

    def __init__(self, engine: Engine, count=lambda **counts: None, depth: int = 8, keep_ended: int = 4096):
        self.engine, self.count, self.keep_ended = engine, count, keep_ended
        self._jobs: queue.Queue = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._ended_lock = threading.Lock()
        self._warned_retention = False

    def put(self, job: StoreJob) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kdn-vllm-store", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def skip(self, req_id: str, session: ModelSession, tokens: np.ndarray, served: Served,
             retain: Retention | None = None, final: bool = True) -> None:
        """A prefill with nothing to store or check: refused (counted) when its KV is unstorable, else
        held already (kdn served it), kept as asked; its store has ended."""
        if served.unstorable() is not None:
            self.engine.save(session, tokens, [], served)  # refused: logged and counted there
            self.count(refused_stores=1)
        elif retain:
            self.retain(session, tokens, retain)
        if final:
            self.store_ended(req_id)

    def _run(self) -> None:
        _name_thread("kdn-store")
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._store(job)
            except Exception as exc:  # storing is best effort; the request is answered already
                log.warning("kdn: storing a prompt's KV failed (%s)", exc)
            finally:
                if job.final:
                    self.store_ended(job.req_id)
                self._jobs.task_done()

    def _store(self, job: StoreJob) -> None:
        began, cpu = time.perf_counter(), time.thread_time()
        served, check = job.served, job.check
        if check is not None:
            span = [t[:, :, check[0] - job.first:check[1] - job.first] for t in job.kv]
            verdict = self.engine.verify(job.session, job.tokens, check, span, served.lossy)
            served.suspect = verdict is False
            if verdict is not None:
                self.count(verify_checks=1, verify_mismatches=0 if verdict else 1)
        if job.packed is None:
            return
        packed = job.packed() if callable(job.packed) else job.packed
        stored = self.engine.save(job.session, job.tokens, packed, served)
        flushing = time.perf_counter()
        self.engine.flush()
        if served.unstorable() is not None:
            self.count(refused_stores=1)
            return
        done = time.perf_counter()
        self.count(stores=int(job.final), stored_tokens=stored if job.final else 0, store_seconds=done - began,
                   flush_seconds=done - flushing, store_cpu_seconds=time.thread_time() - cpu)
        if job.retain:
            self.retain(job.session, job.tokens, job.retain)

    def retain(self, session: ModelSession, tokens: np.ndarray, retention: Retention) -> None:
        """Keep a stored prompt as its request asked (pinned, prioritized), within the operator's bound (a refusal
        is counted as ``refused_retentions`` and logged once, never raised into the serving engine)."""
        try:
            self.count(retained_chunks=self.engine.retain(session, np.asarray(tokens, dtype=np.uint32), retention))
        except InvalidInputError as e:
            self.count(refused_retentions=1)
            if not self._warned_retention:
                self._warned_retention = True
                log.warning("kdn: a request's retention was refused (%s)", e)

    def store_ended(self, req_id: str) -> None:
        with self._ended_lock:
            self._ended[req_id] = None
            while len(self._ended) > self.keep_ended:  # nobody asks (the scheduler is in another process)
                self._ended.popitem(last=False)

    def ended(self) -> list[str]:
        """The requests whose store has ended (landed, refused or failed) since the last call."""
        with self._ended_lock:
            ended, self._ended = list(self._ended), collections.OrderedDict()
        return ended

    def drain(self) -> None:
        """Wait until every store queued so far is filed: each job flushes the tiers after its store
        (on disk, sent to a remote store, and what that store removed meanwhile logged for KV events)."""
        self._jobs.join()

    def shutdown(self) -> None:
        """Finish queued stores (they are on disk / sent when this returns)."""
        if self._thread is not None:
            self._jobs.join()
            self._jobs.put(None)
            self._thread.join(timeout=30)
            self._thread = None


def _name_thread(name: str) -> None:
    """Name the calling thread for the OS (``top -H``, /proc/<pid>/task/<tid>/comm: who paid for what)."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])
    except OSError:  # not Linux
        pass
