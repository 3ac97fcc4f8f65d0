"""vLLM's real Scheduler with kdn's connector in-process, the worker half over paged CPU blocks
this harness fills itself (the model's forward), for the scenarios of tests/vllm_scheduler.py."""

from __future__ import annotations

import importlib

import numpy as np
import torch

import forge
from kdn.engine.paged import vllm_layout

BLOCK = 32  # the CPU "vec" kernel (a block size not a multiple of 32 selects "vec16")
STALE = 7.0  # what a previous request left in the blocks


class Harness:
    """vLLM's Scheduler with kdn's connector, and kdn's worker half over blocks held here."""

    def __init__(self, model: str, block: int = BLOCK, gpu_shape: str | None = None, kv_events: bool = False,
                 **kdn_settings):
        """``gpu_shape``: the worker's blocks in one of vLLM's GPU layouts (``"HND"``, ``"NHD"``: the
        packed view in either stride order; ``"kv-first"``, ``"blocks-first"``: the older shapes), as
        CPU tensors, the worker told they are a GPU backend's (no vLLM GPU engine here). ``kv_events``:
        vLLM's KV events on (and its prefix cache, whose own events are the reference), each published
        batch kept in :attr:`published`."""
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from kdn.integrations import vllm as connector

        model_config = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=4096)
        config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=kdn_settings.pop("batch", 2048),
                                             max_model_len=4096, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=block, enable_prefix_caching=kv_events),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
            kv_transfer_config=KVTransferConfig(kv_connector="KDNConnector",
                                                kv_connector_module_path="kdn.integrations.vllm",
                                                kv_role="kv_both", kv_connector_extra_config=kdn_settings,
                                                kv_load_failure_policy="recompute"),
            device_config=DeviceConfig("cpu"))
        hf = model_config.hf_text_config
        self.heads, self.dim, self.layers = hf.num_key_value_heads, hf.head_dim, hf.num_hidden_layers
        blocks = 400
        self.names = names = [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]
        kv_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            names, FullAttentionSpec(block_size=block, num_kv_heads=self.heads, head_size=self.dim,
                                     dtype=torch.float32))])
        config.cache_config.num_gpu_blocks = blocks
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config, log_stats=False,
                                   structured_output_manager=StructuredOutputManager(config), block_size=block)
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(block, hash_fn)  # as vLLM's engine core hashes a request's blocks
        self.requests: dict = {}  # every request added, by id (finished ones too)
        self.published: list = []  # KV event batches the scheduler published (kv_events)
        self.scheduler.kv_event_publisher.publish = self.published.append
        self.gpu_shape, self.block = gpu_shape, block
        worker = connector.KDNConnector if gpu_shape is None else _told_gpu(connector.KDNConnector)
        self.worker = worker(config, KVConnectorRole.WORKER, kv_config)
        self.caches = {n: _blocks(gpu_shape, blocks, self.heads, block, self.dim) for n in names}
        self.worker.register_kv_caches(self.caches)
        self.layout = vllm_layout(self.caches[names[0]], "vec" if gpu_shape is None else "gpu")
        assert self.worker.engine is not None, self.worker.reason
        self.io, self.session = forge.chunk_io(self.worker.engine), self.worker.session
        self.connector = connector
        self.policy = importlib.import_module("kdn.engine.requests").Requests  # its waits and leases (class attributes)

    def request(self, req_id: str, tokens: list, max_tokens: int = 4, cache_salt: str | None = None,
                lora=None, transfer: dict | None = None):
        """Add a request (``lora``: a vLLM ``LoRARequest``; ``transfer``: its ``kv_transfer_params``)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0,
                                extra_args={"kv_transfer_params": transfer} if transfer is not None else None)
        params.update_from_generation_config({}, 0)
        request = Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                          pooling_params=None, cache_salt=cache_salt, lora_request=lora, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        self.requests[req_id] = request
        return request

    def step(self, truth: dict, drop=None, invalid_from_worker: bool = True, drain: bool = True):
        """One engine step: schedule, the worker loads, the "model" writes ``truth[req_id]`` (the KV of
        its tokens, or None: garbage) into the rows this step computes, the worker saves (``drain``:
        waits until stored); then the scheduler reads the step's output. ``drop(io)`` runs between
        the lookup and the load."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        if drop is not None:
            drop(self.io)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        for layer in range(self.layers):
            self.worker.wait_for_layer_load(f"model.layers.{layer}.self_attn.attn")
        computed = self._computed(out)
        for req_id, (start, end) in computed.items():
            self._write(self.scheduler.requests[req_id], start, end, truth.get(req_id))
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        if drain:
            self.connector.drain()
        ids = list(out.num_scheduled_tokens)
        errors_out = errors if invalid_from_worker else set()
        events = self.worker.get_kv_connector_kv_cache_events()
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[5] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=None,
                                   kv_connector_output=KVConnectorOutput(invalid_block_ids=errors_out,
                                                                         kv_cache_events=events)
                                   if errors_out or events else None)
        self.scheduler.update_from_output(out, result)
        return meta, errors

    @staticmethod
    def _computed(out) -> dict:
        spans = {}
        for new in out.scheduled_new_reqs:
            done = new.num_computed_tokens
            spans[new.req_id] = (done, done + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            done = cached.num_computed_tokens[i]
            spans[req_id] = (done, done + out.num_scheduled_tokens[req_id])
        return spans

    def _write(self, request, start: int, end: int, truth) -> None:
        """The model's forward: rows [start, end) of the request's prompt get their true KV (or, with
        ``truth`` None, values that are not any prompt's KV)."""
        from kdn import _core

        end = min(end, len(request.prompt_token_ids))
        if end <= start:
            return
        kv = truth if truth is not None else [torch.full((1, self.heads, end, self.dim), 9.0)
                                              for _ in range(2 * self.layers)]
        blob = _core.pack_chunk(kv, 0, end, self.session.fingerprint, bytes(16))
        (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        layers = [self.caches[name] for name in self.names]
        _core.unpack_chunks_paged([blob], layers, np.asarray(block_ids, dtype=np.int64), start, end,
                                  layout=self.layout.as_dict())

    def hold_saves(self):
        """Hold the worker's stores until the returned event is set (a store still on its way)."""
        import threading

        gate, save = threading.Event(), self.worker.engine.save

        def held(*args, **kwargs):
            gate.wait(60)
            return save(*args, **kwargs)

        self.worker.engine.save = held
        return gate

    def stored(self, tokens: list, scope: bytes | None = None):
        """(hit, KV) of ``tokens`` as an exact reader of the store sees it (in a request ``scope``)."""
        from kdn.engine import HFTarget

        kv, hit = self.io.read(self.session.within(scope), np.asarray(tokens, dtype=np.uint32), len(tokens),
                               HFTarget())
        return hit, kv


def _told_gpu(base):
    class ToldGPU(base):
        """The worker half with its blocks declared a GPU backend's (they are CPU tensors here)."""

        def attention_kernel(self, layer):
            return "gpu"

    return ToldGPU


def _blocks(shape: str | None, blocks: int, heads: int, block: int, dim: int) -> torch.Tensor:
    """A layer's KV blocks as vLLM allocates them, filled with STALE."""
    if shape in (None, "HND"):
        return torch.full((blocks, heads, block, 2 * dim), STALE)
    if shape == "NHD":
        return torch.full((blocks, block, heads, 2 * dim), STALE).permute(0, 2, 1, 3)
    if shape == "kv-first":
        return torch.full((2, blocks, block, heads, dim), STALE)
    return torch.full((blocks, 2, block, heads, dim), STALE)  # blocks-first


def random_kv(h: Harness, n: int, seed: int) -> list:
    """The true KV of ``n`` tokens for the harness's model (random, by ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h.heads, n, h.dim, generator=g) for _ in range(2 * h.layers)]


def random_tokens(n: int, seed: int) -> list:
    """``n`` ordinary token ids (by ``seed``)."""
    return np.random.default_rng(seed).integers(10, 40000, n).tolist()


def stored_exactly(h: Harness, tokens: list, truth: list, scope: bytes | None = None) -> dict:
    """What an exact reader of the store gets of ``tokens`` (in a request ``scope``), against their true KV."""
    hit, kv = h.stored(tokens, scope)
    equal = hit > 0 and all(torch.equal(a, b[:, :, :hit]) for a, b in zip(kv, truth))
    return {"stored_tokens": hit, "equal_to_truth": bool(equal)}
