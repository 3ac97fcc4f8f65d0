"""What the vLLM connectors of one process share: one kdn engine per (config, model), the lookup
server of its worker, and the worker halves (to drain their stores and read their counters)."""

from __future__ import annotations

import logging
import threading
import weakref

from kdn.config import KDNConfig
from kdn.engine import Engine, ModelSession, passages
from kdn.engine.channel import LookupServer, socket_path
from kdn.engine.messages import Readiness
from kdn.integrations.vllm import metrics
from kdn.integrations.vllm.ranks import Rank
from kdn.layout import describe_checkpoint

log = logging.getLogger("kdn")

_lookup_servers: dict[str, LookupServer] = {}  # socket path -> the server of this process' worker
_admin_servers: dict = {}  # address -> this process' admin endpoint
_lock = threading.Lock()
_workers: weakref.WeakSet = weakref.WeakSet()  # this process' worker halves


def store_for(config: KDNConfig, vllm_config, rank: Rank) -> tuple[Engine, ModelSession, list[str]]:
    """This process' engine and session for (config, model) as ``rank`` holds it (its share of the KV
    heads), and the lookup socket of each rank's worker, as both of vLLM's processes derive them (the
    engine id names one vLLM engine)."""
    model = vllm_config.model_config
    # one engine per (config, model) in a process: the scheduler's lookups see the worker's stores
    engine, session = Engine.for_checkpoint(config, model.model, model.dtype,
                                            lambda: describe_checkpoint(model.model, model.dtype, model.hf_config),
                                            rank.heads)
    key = (repr(config), config.tenant_key(), str(model.model), str(model.dtype))  # repr hides the secret
    name = f"{getattr(vllm_config.kv_transfer_config, 'engine_id', None) or ''}|{key}"
    return engine, session, [socket_path(name if rank.ranks == 1 else f"{name}|rank {r}") for r in range(rank.ranks)]


def serve_lookups(path: str, engine: Engine, session: ModelSession) -> None:
    """Start this process' lookup server for its worker's store (once per socket)."""
    with _lock:
        if path not in _lookup_servers:
            def lookup(tokens, limit, scope):  # counted here: this process' counters reach vLLM's /metrics
                metrics.count(lookups=1)
                return engine.find(session.within(scope), tokens, limit, holders=True)

            _lookup_servers[path] = LookupServer(path, lookup, lambda: ended_stores(engine),
                                                 lambda keys: readiness(engine, keys) or Readiness(False))


def serve_admin(address: str, token: str | None, engine: Engine, session: ModelSession) -> None:
    """Start this process' admin endpoint (:mod:`kdn.admin`) on ``address`` (once per address)."""
    from kdn.admin import AdminServer

    with _lock:
        if address not in _admin_servers:
            _admin_servers[address] = AdminServer(engine, session, address, token)
            log.info("kdn: admin endpoint on %s", _admin_servers[address].url)


def refuse_lookups(path: str) -> None:
    """This process' worker refused its engine: the lookup server at ``path`` says so to the
    scheduler (in this process or vLLM's other one), which then serves requests without kdn."""
    with _lock:
        server = _lookup_servers.get(path)
    if server is not None:
        server.serving = False


def add_worker(worker) -> None:
    _workers.add(worker)


def worker_here(engine: Engine) -> bool:
    """Whether a worker half of this process holds ``engine`` (then its tiers are the scheduler's)."""
    return any(w.engine is engine for w in list(_workers))


def readiness(engine: Engine, keys: list[bytes]) -> Readiness | None:
    """Whether the worker of this process holding ``engine`` blends (it has the engine's layers,
    :mod:`kdn.integrations.vllm.layers`, and a prefill vouched for them), and how many of a prompt's
    piece ``keys``, from the first, its tiers hold; None where no worker of this process holds it."""
    for worker in list(_workers):
        if worker.engine is engine:
            if worker.stack is None:
                return Readiness(False, why=worker.blend_reason)
            return Readiness(True, worker.blend_vouched, passages.leading_held(engine, keys))
    return None


def ended_stores(engine: Engine) -> list[str]:
    """The requests whose store the workers of this process holding ``engine`` have ended (landed,
    refused or failed) since the last call: the scheduler waits no more for them."""
    return [r for w in list(_workers) if w.engine is engine for r in w.ended_stores()]


def tier_stats() -> list[dict]:
    """The tiers' own counters of every engine of this process."""
    return [engine.stats() for engine in Engine.checkpoint_engines()]


def tier_reads() -> dict[str, list[float]]:
    """The seconds of each batched tier read every engine of this process made since the last call."""
    reads: dict[str, list[float]] = {}
    for engine in Engine.checkpoint_engines():
        for tier, seconds in engine.take_read_times().items():
            reads.setdefault(tier, []).extend(seconds)
    return reads


def drain() -> None:
    """Wait until every connector of this process has stored what it queued (tests, benchmarks)."""
    for worker in list(_workers):
        worker.drain()


def stats() -> dict:
    """This process' connector counters (lookups, hit/loaded/stored tokens, load errors, seconds),
    the layout each worker reads vLLM's blocks as (:func:`kdn.engine.paged.vllm_layout`'s name: which
    one a GPU attention backend handed) and the tiers' own counters: ``{"connector": {...},
    "block_layouts": ["packed"], "memory": {...}, "disk": {...}, ...}``."""
    tiers = {name: s for t in tier_stats() for name, s in t.items()}
    layouts = sorted({w.layout.name for w in list(_workers)})
    return {"connector": metrics.totals(), "block_layouts": layouts, **tiers}
