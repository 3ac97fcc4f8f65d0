"""kdn as a vLLM KV connector: engines look up, load and store prompt KV through kdn's tiers.

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model="/models/SmolLM2-135M-Instruct", dtype="float32", enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KDNConnector", kv_connector_module_path="kdn.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"disk_dir": "/var/cache/kdn"},
                  kv_load_failure_policy="recompute"))

``kv_connector_extra_config`` holds :class:`kdn.KDNConfig` settings (an unknown one stops the engine
at start-up with kdn's "did you mean"). The scheduler asks kdn how many leading prompt tokens it
holds (token-granular, never the last prompt token); the worker loads them into vLLM's paged
blocks before the forward that needs them and, once a prompt's prefill is done, copies its KV out
of the blocks and stores it from a background thread. Keys come from the checkpoint's files
(:func:`kdn.keys.checkpoint_fingerprint`), so an HF process serving the same checkpoint in the same
dtype shares hits with the engine both ways. A chunk that cannot be loaded is reported to vLLM,
which recomputes its blocks: never wrong KV. What is stored follows one rule
(:mod:`kdn.engine.served`): a prompt is stored from the blocks of the step that completed its
prefill, and only when that step's loads are known to have succeeded and nothing it was served was
lossy; after a failed load vLLM recomputes the request, and the recomputed prompt is stored then.
With ``verify_fraction`` a sampled hit's last tokens are held back, computed by vLLM and compared
with what kdn stores (:mod:`kdn.engine.verify`). A model kdn cannot serve (sliding window, MLA, hybrid
or mamba layers, a KV layout it does not know) is logged once at start-up and served nothing. The
blocks may be the CPU 'vec' kernel's or a GPU backend's (:func:`kdn.engine.paged.vllm_layout`); on a
GPU, chunks are laid in and gathered out by kdn's CUDA paged copy on vLLM's current stream.
Scheduler and worker share one kdn store per process; where vLLM runs them in different processes
(``vllm serve``: the worker in a process of its own), the scheduler's lookups are answered by the
worker's process over a unix socket (:mod:`kdn.integrations.lookups`), so that a memory tier,
private to the worker, is seen.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kdn._core import InvalidInputError
from kdn.config import KDNConfig
from kdn.delivery import DeliveryError
from kdn.engine import Engine, HFTarget, ModelSession
from kdn.engine.paged import PagedLayout, vllm_layout
from kdn.engine.served import Served
from kdn.engine.targets import PagedBlocks
from kdn.engine.verify import plane_error
from kdn.integrations import vllm_metrics as metrics
from kdn.integrations.lookups import LookupClient, LookupServer, socket_path
from kdn.keys import checkpoint_fingerprint
from kdn.layout import ModelLayout

log = logging.getLogger("kdn")

# one store per (config, model) in a process: the scheduler's lookups see the worker's stores
_stores: dict[tuple, tuple[Engine, ModelSession]] = {}
_lookup_servers: dict[str, LookupServer] = {}  # socket path -> the server of this process' worker
_stores_lock = threading.Lock()
_connectors: weakref.WeakSet = weakref.WeakSet()
# a request whose next chunk another request is prefilling (in this engine, or claimed in the remote
# store by another) waits for it (asked again each step) at most this long; a prefill that completed
# (its last step executed, not scheduled: a step may take longer than this on a loaded host) is
# waited on this long more, while its store lands. A claim in the remote store is a lease of
# CLAIM_LEASE_S that its engine renews while the prefill runs: a claim whose engine died, or that
# nobody renews, stops holding anyone within seconds; a store that cannot be used holds no one.
IN_FLIGHT_WAIT_S, STORE_GRACE_S, CLAIM_LEASE_S = 120.0, 10.0, 5.0
_COMPLETING = float("inf")  # an admitted request whose prefill's last step is scheduled, not yet run


def drain() -> None:
    """Wait until every connector of this process has stored what it queued (tests, benchmarks)."""
    for connector in list(_connectors):
        connector._saves.join()


def stats() -> dict:
    """This process' connector counters (lookups, hit/loaded/stored tokens, load errors, seconds)
    and the tiers' own counters: ``{"connector": {...}, "memory": {...}, "disk": {...}, ...}``."""
    with _stores_lock:
        tiers = {name: s for engine, _ in _stores.values() for name, s in engine.chunks.stats().items()}
        return {"connector": metrics.totals(), **tiers}


@dataclasses.dataclass
class LoadSpec:
    """Load tokens [start, end) of ``tokens`` from kdn into ``block_ids`` (the request's tenant:
    its ``cache_salt``, None for none)."""

    req_id: str
    tokens: list
    start: int
    end: int
    block_ids: list
    namespace: str | None = None


@dataclasses.dataclass
class SaveSpec:
    """Store the KV of ``tokens`` (a prefill this step completed), held in ``block_ids``; with
    ``check = (start, end)``, first compare the rows [start, end) vLLM computed with kdn's."""

    req_id: str
    tokens: list
    block_ids: list
    check: tuple | None = None
    namespace: str | None = None


@dataclasses.dataclass
class KDNConnectorMetadata(KVConnectorMetadata):
    loads: list = dataclasses.field(default_factory=list)
    saves: list = dataclasses.field(default_factory=list)
    fresh: list = dataclasses.field(default_factory=list)  # requests (re)started from scratch this step


@dataclasses.dataclass
class _Request:
    tokens: list
    block_ids: list
    check: tuple | None = None  # (start, end): hit tokens held back to be verified
    namespace: str | None = None  # its cache_salt: a tenant shares KV only within it


def unsupported_reason(vllm_config, kv_cache_config) -> str | None:
    """Why kdn cannot serve this engine's model, or None."""
    model = vllm_config.model_config
    hf = model.hf_text_config
    if getattr(model, "use_mla", False):
        return "MLA attention (latent KV) is not supported"
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        return "sliding-window attention is not supported (its KV is not a plain prefix)"
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        return "hybrid models (several KV cache groups: mamba or mixed attention) are not supported"
    if groups and type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec":
        return f"{type(groups[0].kv_cache_spec).__name__} layers are not supported (full attention only)"
    folder = Path(model.model)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return f"{model.model} is not a local HF checkpoint folder (kdn fingerprints the checkpoint's files)"
    return None


def _store_for(config: KDNConfig, vllm_config) -> tuple[Engine, ModelSession, str]:
    """This process' engine and session for (config, model), and the lookup socket both of vLLM's
    processes derive for them (the engine id names one vLLM engine)."""
    model = vllm_config.model_config
    key = (repr(config), config.tenant_key(), str(model.model), str(model.dtype))  # repr hides the secret
    with _stores_lock:
        if key not in _stores:
            engine = Engine(config)
            layout = ModelLayout.from_config(model.hf_config, model.dtype)
            _stores[key] = (engine, engine.checkpoint_session(layout, checkpoint_fingerprint(model.model, model.dtype)))
        engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or ""
        return (*_stores[key], socket_path(f"{engine_id}|{key}"))


def _serve_lookups(path: str, engine: Engine, session: ModelSession) -> None:
    """Start this process' lookup server for its worker's store (once per socket)."""
    with _stores_lock:
        if path not in _lookup_servers:
            def lookup(tokens, limit, namespace):  # counted here: this process' counters reach vLLM's /metrics
                metrics.count(lookups=1)
                return engine.lookup(session.within(namespace), tokens, limit)

            _lookup_servers[path] = LookupServer(path, lookup)


class KDNConnector(KVConnectorBase_V1):
    """vLLM's ``KVConnectorBase_V1`` served by kdn (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = KDNConfig(**extra)  # an unknown setting: InvalidInputError with "did you mean"
        self.block_size = vllm_config.cache_config.block_size
        self.reason = unsupported_reason(vllm_config, kv_cache_config)
        self.engine = self.session = None  # one Engine per config and model in this process (both roles)
        if self.reason:
            if role == KVConnectorRole.SCHEDULER:
                log.warning("kdn: not serving %s: %s; requests run without kdn", vllm_config.model_config.model,
                            self.reason)
        else:
            self.engine, self.session, lookups = _store_for(self.config, vllm_config)
            if role == KVConnectorRole.WORKER:
                _serve_lookups(lookups, self.engine, self.session)
            else:
                self._lookups = LookupClient(lookups)
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if role == KVConnectorRole.SCHEDULER and policy != "recompute":
                log.warning("kdn: kv_load_failure_policy=%r: a chunk evicted or damaged between lookup and load "
                            "fails its request; set kv_load_failure_policy='recompute' so that vLLM recomputes it",
                            policy)
        # scheduler side
        self._pending: dict[str, int] = {}  # req_id -> external tokens to load
        self._checks: dict[str, tuple] = {}  # req_id -> (start, end) of a hit held back for verification
        self._waiting: dict[str, float] = {}  # req_id -> since when it waits for another's prefill
        # req_id -> [prompt tokens, prefill completed at (None: running, _COMPLETING), claimed keys];
        # kept STORE_GRACE_S past its request's end, while its store lands
        self._admitted: dict[str, list] = {}
        self._claims: dict[str, list[bytes]] = {}  # req_id -> the chunks it will compute (claimed)
        self._salts: dict[str, str | None] = {}  # req_id -> its cache_salt (its tenant)
        engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or f"kdn-{id(self)}"
        self._owner = re.sub(r"[^\x21-\x7e]", "_", str(engine_id))[:200]  # a claim's owner: printable ASCII
        self._renewed = 0.0  # when the claims of running prefills were last renewed
        self._requests: dict[str, _Request] = {}
        # worker side
        self._blocks: list[torch.Tensor] = []
        self._layout: PagedLayout | None = None  # how kdn reads and writes them (set with the blocks)
        self._errors: set[int] = set()
        self._served: dict[str, Served] = {}  # what kdn served each running request
        self._streams: list = []  # (load spec, LayerStream) of this step's layer-wise loads
        self._saves: queue.Queue = queue.Queue(maxsize=8)
        self._saver: threading.Thread | None = None
        _connectors.add(self)

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.engine is None:
            return 0, False
        tokens = np.asarray(request.prompt_token_ids or [], dtype=np.uint32)
        salt = self._salts[request.request_id] = getattr(request, "cache_salt", None) or None
        session = self.session.within(salt)  # vLLM's cache_salt: tenants never share KV
        began = time.perf_counter()
        hit = None  # the last token is computed: limit len - 1
        if not self._worker_here():  # ask the worker's process: its memory tier is its own
            hit = self._lookups.lookup(tokens, len(tokens) - 1, salt)
        if hit is None:
            hit = self.engine.lookup(session, tokens, len(tokens) - 1)
            metrics.count(lookups=1)
        metrics.count(lookup_seconds=time.perf_counter() - began)
        if self._prefilled_elsewhere(request.request_id, tokens, hit, session):
            return None, False  # vLLM skips the request this step and asks again
        span = self.engine.chunks.verifier.sample(hit - num_computed_tokens)  # verified: vLLM computes the last ones
        if span:
            self._checks[request.request_id] = (hit - span, hit)
        else:
            self._checks.pop(request.request_id, None)
        return max(0, hit - span - num_computed_tokens), False

    def _prefilled_elsewhere(self, req_id: str, tokens: np.ndarray, hit: int, session: ModelSession) -> bool:
        """Whether another request is computing at least one more chunk of this prompt than kdn
        holds (two questions of one document arriving together): one admitted in this engine, or,
        with a remote store, one another engine claimed there. Then this request waits for that KV
        to be stored, so the document is prefilled once (at most ``IN_FLIGHT_WAIT_S``); otherwise
        it has claimed the chunk it will compute (until ``STORE_GRACE_S`` after it finishes: its
        stores to a remote tier are queued, and a claim dropped at once let another engine miss)."""
        need = hit + session.chunk_size
        now = time.monotonic()
        for done in [r for r, (_, at, _, _) in self._admitted.items() if at is not None and now - at > STORE_GRACE_S]:
            del self._admitted[done]  # prefilled and stored (or refused) already: nothing to wait for
        busy, keys = False, []
        salt = self._salts.get(req_id)
        if need < len(tokens):
            for other_id, (other, _, _, other_salt) in self._admitted.items():
                if (other_id != req_id and other_salt == salt and len(other) >= need
                        and np.array_equal(other[:need], tokens[:need])):
                    busy = True
                    break
            keys = self.engine.computing_keys(session, tokens, hit)
            if not busy and keys:  # claimed now, at lookup: of two engines asked at once, one computes
                # False: another engine's live claim; None (the store cannot tell): computes now
                busy = self.engine.claim(keys, self._owner, CLAIM_LEASE_S) is False
        if busy:
            first = self._waiting.setdefault(req_id, now)
            if now - first < IN_FLIGHT_WAIT_S:
                return True
            keys = []  # waited long enough: computes it too, without a claim
        self._claims[req_id] = keys
        if self._waiting.pop(req_id, None) is not None:
            metrics.count(in_flight_waits=1)
        return False

    def _worker_here(self) -> bool:
        """Whether a worker connector of this process holds the same store (then its tiers are ours)."""
        return any(c.role == KVConnectorRole.WORKER and c.engine is self.engine for c in list(_connectors))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        # admitted: the next request's lookup in this very step sees that this one prefills its prompt
        keys = self._claims.pop(request.request_id, [])  # claimed at its lookup: renewed when it finishes
        self._admitted[request.request_id] = [np.asarray(request.prompt_token_ids or [], dtype=np.uint32), None, keys,
                                              self._salts.get(request.request_id)]
        if num_external_tokens > 0:
            self._pending[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KDNConnectorMetadata()
        if self.engine is None:
            return meta
        self._renew_claims()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req = self._requests[new.req_id] = _Request(list(new.prompt_token_ids or []), list(new.block_ids[0]),
                                                        self._checks.pop(new.req_id, None),
                                                        self._salts.get(new.req_id))
            meta.fresh.append(new.req_id)
            external = self._pending.pop(new.req_id, 0)
            if external:
                start = new.num_computed_tokens - external
                meta.loads.append(LoadSpec(new.req_id, req.tokens[:new.num_computed_tokens], start,
                                           new.num_computed_tokens, req.block_ids, req.namespace))
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if new_blocks is not None:
                req.block_ids = list(new_blocks[0]) if resumed else req.block_ids + list(new_blocks[0])
            admitted = self._admitted.get(req_id)
            if admitted is not None and admitted[1] == _COMPLETING and cached.num_computed_tokens[i] >= len(req.tokens):
                admitted[1] = time.monotonic()  # the step that completed its prefill has run
            if resumed:  # preempted, now recomputed (and perhaps loaded) from scratch
                meta.fresh.append(req_id)
                req.check = self._checks.pop(req_id, None)
            external = self._pending.pop(req_id, 0)
            if external:  # resumed after preemption with a fresh load
                done = cached.num_computed_tokens[i]
                meta.loads.append(LoadSpec(req_id, req.tokens[:done], done - external, done, req.block_ids,
                                           req.namespace))
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
            self.engine.renew_claims(keys, self._owner, CLAIM_LEASE_S)

    def _maybe_save(self, meta: KDNConnectorMetadata, req_id: str, computed: int, scheduled: int) -> None:
        """A step that completes a prompt's prefill (``computed`` tokens before it, ``scheduled`` in
        it) stores it; the worker refuses it if a load of that step failed or lossy KV was served
        (:mod:`kdn.engine.served`). A prefill recomputed after a failed load, or after preemption,
        completes again, and is stored then."""
        req = self._requests[req_id]
        n = len(req.tokens)
        if not computed < n <= computed + scheduled:
            return
        check = req.check if req.check is not None and computed <= req.check[0] else None
        if req_id in self._admitted:
            self._admitted[req_id][1] = _COMPLETING
        meta.saves.append(SaveSpec(req_id, req.tokens, req.block_ids[: -(-n // self.block_size)], check,
                                   req.namespace))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._salts.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._checks.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        admitted = self._admitted.get(request.request_id)
        keys = self._claims.pop(request.request_id, None) or (admitted[2] if admitted is not None else [])
        if admitted is not None:
            if admitted[1] is None:  # ended before its prefill completed: nothing of it is on its way
                del self._admitted[request.request_id]
            else:  # its store may still be on its way: others wait STORE_GRACE_S more for it
                admitted[1] = min(admitted[1], time.monotonic())
        if keys:  # kept STORE_GRACE_S more, not dropped: its KV may still be on its way to the store
            self.engine.claim(keys, self._owner, STORE_GRACE_S)
        return False, None  # the KV was copied out in the step that finished the prefill

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.engine is None:
            return
        ordered = sorted(kv_caches.items(), key=lambda item: _layer_index(item[0]))
        try:
            self._layout = self._describe([t for _, t in ordered])
        except InvalidInputError as e:
            self.reason = f"vLLM's KV layout is not one kdn reads: {e}"
            log.warning("kdn: not serving this engine: %s", self.reason)
            self.engine = None
            return
        # kdn's C++ core copies chunks in and out of the blocks by the strides that describe them
        # (kdn.engine.paged, kdn/paged.h); on a GPU with the CUDA twin, on vLLM's current stream
        self._blocks = [t for _, t in ordered]

    def attention_kernel(self, layer: torch.Tensor) -> str:
        """Whose blocks ``layer`` is: the CPU kernel vLLM picked (``"vec"``, ``"vec16"``, ``"amx"``, ...)
        or ``"gpu"`` for a CUDA tensor (every GPU backend hands connectors the same views)."""
        if layer.device.type == "cpu":
            return _cpu_attention_isa(self._vllm_config, self.session.layout)
        return "gpu" if layer.is_cuda else layer.device.type

    def _describe(self, layers: list[torch.Tensor]) -> PagedLayout:
        """One layout for every layer's tensor, checked against the model and vLLM's block size."""
        model = self.session.layout
        if len(layers) != model.layers:
            raise InvalidInputError(f"{len(layers)} KV tensors for a model of {model.layers} layers")
        first = layers[0]
        layout = vllm_layout(first, self.attention_kernel(first))
        found = (layout.kv_heads, layout.head_dim, layout.block_size)
        if found != (model.kv_heads, model.head_dim, self.block_size):
            raise InvalidInputError(f"{tuple(first.shape)} holds {found[0]} heads x {found[1]} dims in blocks of "
                                    f"{found[2]}; the model has {model.kv_heads} x {model.head_dim}, vLLM's blocks "
                                    f"are {self.block_size} tokens")
        odd = [i for i, t in enumerate(layers) if (t.shape, t.stride(), t.dtype, t.device)
               != (first.shape, first.stride(), first.dtype, first.device)]
        if odd:
            raise InvalidInputError(f"layer {odd[0]}'s tensor {tuple(layers[odd[0]].shape)} is not laid out "
                                    f"like layer 0's {tuple(first.shape)}")
        return layout

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.engine is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for req_id in meta.fresh:
            self._served[req_id] = Served()
        for spec in meta.loads:
            began = time.perf_counter()
            served = self._served.setdefault(spec.req_id, Served())
            tokens = np.asarray(spec.tokens, dtype=np.uint32)
            blocks = PagedBlocks(self._blocks, self._layout, spec.block_ids, spec.start)
            # layer-wise when the engine streams: layers arrive while the model computes the ones before
            load = self.engine.load(self.session.within(spec.namespace), tokens, spec.end, blocks,
                                    lambda _, blocks=blocks: blocks, began)
            hit = load.hit
            served.lossy |= load.lossy  # a stream's is known when it ends (_finish_streams)
            if load.stream is not None:
                self._streams.append((spec, load.stream))
            upto = min(hit, spec.end)
            served.tokens = max(served.tokens, upto)
            if upto < spec.end:  # evicted or unusable since the lookup: vLLM recomputes these blocks
                self._load_failed(spec, max(upto, spec.start), "evicted or damaged since the lookup")
            metrics.count(loads=1, loaded_tokens=max(0, upto - spec.start), hit_tokens=max(0, upto - spec.start),
                   load_seconds=time.perf_counter() - began)

    def _load_failed(self, spec: LoadSpec, start: int, why: str) -> None:
        """Tokens [start, spec.end) of a request were not loaded: vLLM recomputes their blocks."""
        first = start // self.block_size
        self._errors.update(spec.block_ids[first: -(-spec.end // self.block_size)])
        self._served.setdefault(spec.req_id, Served()).failed = True  # nothing of it is stored this step
        log.warning("kdn: %d of %d tokens could not be loaded (%s); vLLM recomputes them", spec.end - start,
                    spec.end - spec.start, why)
        metrics.count(load_errors=1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._streams:
            return  # loaded whole by start_load_kv
        layer = _layer_index(layer_name)
        for spec, stream in self._streams:
            try:
                stream.wait(layer)
            except DeliveryError as e:  # reported after the forward; vLLM recomputes the request's blocks
                log.debug("kdn: layer %d of request %s not delivered: %s", layer, spec.req_id, e)

    def _finish_streams(self) -> None:
        """After the forward: every stream of this step has ended; a failed one's blocks are reported."""
        streams, self._streams = self._streams, []
        for spec, stream in streams:
            try:
                stream.wait_all()
            except DeliveryError as e:
                self._load_failed(spec, spec.start, f"delivery failed: {e}")
            if stream.stats.get("lossy", False):  # known once its last group arrived
                self._served.setdefault(spec.req_id, Served()).lossy = True

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # wait_for_save copies finished prompts out after the forward

    def wait_for_save(self) -> None:
        if self.engine is None or not self.has_connector_metadata():
            return
        self._finish_streams()  # every load of this step has ended: the rule below sees its failures
        for spec in self._get_connector_metadata().saves:
            n = len(spec.tokens)
            session = self.session.within(spec.namespace)
            served = self._served.get(spec.req_id) or Served()
            if spec.check is not None:
                served.checked = spec.check[1] - spec.check[0]
            store = served.unstorable() is None and not served.covers(n, self.session.probe_step)
            check = spec.check if not served.failed else None  # a failed step's blocks are stale: no check
            if not store and check is None:
                if served.unstorable() is not None:
                    self.engine.save(session, np.asarray(spec.tokens, dtype=np.uint32), [], served)  # refused
                    metrics.count(refused_stores=1)
                continue  # else kdn served this prompt: it holds its KV already
            # copies: the blocks are vLLM's to reuse once this returns. The chunks to store are sealed
            # straight from the blocks (those a local tier holds already are skipped); the store
            # thread files them
            began = time.perf_counter()
            tokens = np.asarray(spec.tokens, dtype=np.uint32)
            blocks = PagedBlocks(self._blocks, self._layout, spec.block_ids)
            packed = self.engine.pack(session, tokens, blocks) if store else None
            first, kv = blocks.emit(*check) if check is not None else (0, None)
            metrics.count(gather_seconds=time.perf_counter() - began)
            self._start_saver()
            self._saves.put((session, tokens, first, kv, dataclasses.replace(served), check, packed))
        for served in self._served.values():
            served.failed = False  # vLLM recomputes what failed: the recomputed prefill is stored

    def _start_saver(self) -> None:
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="kdn-vllm-store", daemon=True)
            self._saver.start()

    def _save_loop(self) -> None:
        _name_thread("kdn-store")
        while True:
            item = self._saves.get()
            if item is None:
                return
            began, cpu = time.perf_counter(), time.thread_time()
            try:
                session, tokens, first, kv, served, check, packed = item
                if check is not None:
                    served.suspect = not self._verify(session, tokens, first, kv, check, served)
                if packed is None:
                    continue
                stored = self.engine.save(session, tokens, packed, served)
                flushing = time.perf_counter()
                self.engine.flush()
                if served.unstorable() is None:
                    done = time.perf_counter()
                    metrics.count(stores=1, stored_tokens=stored, store_seconds=done - began,
                                  flush_seconds=done - flushing, store_cpu_seconds=time.thread_time() - cpu)
                else:
                    metrics.count(refused_stores=1)
            except Exception as exc:  # storing is best effort; the request is answered already
                log.warning("kdn: storing a prompt's KV failed (%s)", exc)
            finally:
                self._saves.task_done()

    def _verify(self, session: ModelSession, tokens: np.ndarray, first: int, kv: list, check: tuple,
                served: Served) -> bool:
        """Compare the rows [start, end) vLLM computed (``kv`` holds tokens from ``first``) with the
        KV kdn stores for them; on a mismatch drop every chunk of the hit (vLLM cannot recompute the
        prefix on the side to tell which one is wrong; the next request recomputes and stores it)."""
        start, end = check
        load = self.engine.load(session, tokens[:end], end, HFTarget())
        stored, hit = load.result, load.hit
        verifier = self.engine.chunks.verifier
        tolerance = verifier.tolerance(self.session.layout.torch_dtype, served.lossy or load.lossy)
        if hit < end or tolerance is None:
            return True  # evicted since, or not judged
        error = plane_error([t[:, :, start:end] for t in stored], [t[:, :, start - first:end - first] for t in kv])
        ok = verifier.judge(error, tolerance)
        metrics.count(verify_checks=1, verify_mismatches=0 if ok else 1)
        if not ok:
            found = self.engine.chunks.find(session, tokens[:end], end)
            keys = self.engine.chunks.drop_chunks(session, tokens, found, list(range(len(found.keys))))
            verifier.dropped(keys, f"vLLM's KV of tokens [{start}, {end}) differs from kdn's by {error:.3g} "
                                   f"(tolerance {tolerance:.3g})")
        return ok

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            self._served.pop(req_id, None)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- metrics ----------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # both halves report (vLLM sums them): under `vllm serve` the scheduler's counts (its own
        # lookups, in-flight waits) live in another process than the worker's; in one process the
        # first caller takes the increments and the other finds none
        with _stores_lock:
            tiers = [engine.chunks.stats() for engine, _ in _stores.values()]
        delta = metrics.increments({f"{tier}_chunks": sum(t.get(tier, {}).get("served", 0) for t in tiers)
                                    for tier in ("memory", "disk", "remote")})
        return metrics.KDNStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        return metrics.KDNStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return metrics.KDNPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish queued stores (they are on disk / sent when this returns)."""
        if self._saver is not None:
            self._saves.join()
            self._saves.put(None)
            self._saver.join(timeout=30)
            self._saver = None


def _cpu_attention_isa(vllm_config, layout: ModelLayout) -> str:
    """The CPU attention kernel vLLM picks for this engine ('vec', 'vec16', 'amx', 'neon', ...)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # not vLLM's CPU build
        return "unknown (not vLLM's CPU backend)"
    return _get_attn_isa(vllm_config.model_config.dtype, vllm_config.cache_config.block_size, layout.head_dim,
                         vllm_config.cache_config.cache_dtype)


def _name_thread(name: str) -> None:
    """Name the calling thread for the OS (``top -H``, /proc/<pid>/task/<tid>/comm: who paid for what)."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])
    except OSError:  # not Linux
        pass


def _layer_index(name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else 0
