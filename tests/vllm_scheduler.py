"""The connector's two halves driven in-process by vLLM's real Scheduler (as vLLM's own
tests/v1/kv_connector/unit do), with the worker half over paged CPU blocks that this script fills
itself: what a failed load, an aborted prefill and a verified hit store. Prints one JSON line per
scenario. Run in the vLLM venv by tests/test_vllm.py:

    python tests/vllm_scheduler.py --model DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import numpy as np
import torch

import forge
from kdn.engine.paged import vllm_layout

BLOCK = 32  # the CPU "vec" kernel (a block size not a multiple of 32 selects "vec16")
STALE = 7.0  # what a previous request left in the blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--redis", default=None, help="a Redis URL: run the two-engine scenario on it")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = {}
    for delivery in ("whole", "layerwise"):
        results[f"load_error_{delivery}"] = load_error(args.model, delivery)
    results["aborted_prefill"] = aborted_prefill(args.model)
    results["verified_hit"] = verified_hit(args.model)
    results["in_flight"] = in_flight(args.model)
    results["in_flight_slow_step"] = in_flight_slow_step(args.model)
    results["store_not_landed"] = store_not_landed(args.model)
    results["store_not_landed_worker_elsewhere"] = store_not_landed(args.model, worker_elsewhere=True)
    results["gpu_layouts"] = gpu_layouts(args.model)
    if args.redis:
        results["claimed_elsewhere"] = claimed_elsewhere(args.model, args.redis)
        results["claimed_partly_stored"] = claimed_partly_stored(args.model, args.redis)
        results["forged_claim"] = forged_claim(args.model, args.redis)
        results["claim_lease"] = claim_lease(args.model, args.redis)
        results["carried_lookup"] = carried_lookup(args.model, args.redis)
    results["store_down"] = store_down(args.model)
    results["salted"] = salted(args.model)
    print("KDN-RESULT " + json.dumps(results), flush=True)


class Harness:
    """vLLM's Scheduler with kdn's connector, and kdn's worker half over blocks held here."""

    def __init__(self, model: str, block: int = BLOCK, gpu_shape: str | None = None, **kdn_settings):
        """``gpu_shape``: the worker's blocks in one of vLLM's GPU layouts (``"HND"``, ``"NHD"``: the
        packed view in either stride order; ``"kv-first"``, ``"blocks-first"``: the older shapes), as
        CPU tensors, the worker told they are a GPU backend's (no vLLM GPU engine here)."""
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
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
            cache_config=CacheConfig(block_size=block, enable_prefix_caching=False),
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
        self.gpu_shape, self.block = gpu_shape, block
        worker = connector.KDNConnector if gpu_shape is None else _told_gpu(connector.KDNConnector)
        self.worker = worker(config, KVConnectorRole.WORKER, kv_config)
        self.caches = {n: _blocks(gpu_shape, blocks, self.heads, block, self.dim) for n in names}
        self.worker.register_kv_caches(self.caches)
        self.layout = vllm_layout(self.caches[names[0]], "vec" if gpu_shape is None else "gpu")
        assert self.worker.engine is not None, self.worker.reason
        self.io, self.session = forge.chunk_io(self.worker.engine), self.worker.session
        self.connector = connector
        self.scheduler_module = importlib.import_module("kdn.integrations.vllm.scheduler")  # its waits and leases

    def request(self, req_id: str, tokens: list, max_tokens: int = 4, cache_salt: str | None = None):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        params.update_from_generation_config({}, 0)
        request = Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                          pooling_params=None, cache_salt=cache_salt)
        self.scheduler.add_request(request)
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
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[5] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=None,
                                   kv_connector_output=KVConnectorOutput(invalid_block_ids=errors)
                                   if errors and invalid_from_worker else None)
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

    def stored(self, tokens: list):
        """(hit, KV) of ``tokens`` as an exact reader of the store sees it."""
        from kdn.engine import HFTarget

        kv, hit = self.io.read(self.session, np.asarray(tokens, dtype=np.uint32), len(tokens), HFTarget())
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


def _read_blocks(h: Harness, layer: torch.Tensor, block_ids: list, n: int) -> tuple:
    """Rows [0, n) of a request's K and V ([1, heads, n, dim]) read with vLLM's reference connector
    indexing (``layer[block_ids, :, offsets]`` for the packed view), not with kdn's layout."""
    p = torch.arange(n)
    ids, offsets = torch.as_tensor(block_ids)[p // h.block], p % h.block
    if h.gpu_shape in ("HND", "NHD"):
        rows = layer[ids, :, offsets]  # [n, heads, 2 * dim]
        k, v = rows[..., :h.dim], rows[..., h.dim:]
    elif h.gpu_shape == "kv-first":
        k, v = layer[0, ids, offsets], layer[1, ids, offsets]  # [n, heads, dim]
    else:
        k, v = layer[ids, 0, offsets], layer[ids, 1, offsets]
    return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)


def gpu_layouts(model: str) -> dict:
    """The worker half over blocks in each of vLLM's GPU layouts (CPU tensors, 16-token blocks): a
    stored document is loaded into the blocks (read back with vLLM's own indexing), the question
    computed, and the whole prompt gathered out of the blocks and stored: what an exact reader gets."""
    results = {}
    for i, shape in enumerate(("HND", "NHD", "kv-first", "blocks-first")):  # a store per process: own tokens
        h = Harness(model, block=16, gpu_shape=shape, chunk_size=256)
        doc, question = _tokens(600, 1001 + 10 * i), _tokens(20, 1002 + 10 * i)
        truth = _random_kv(h, 620, 1003 + 10 * i)
        h.io.write(h.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :600] for t in truth])
        h.request("g", doc + question)
        meta, errors = h.step({"g": truth})
        (block_ids,) = h.scheduler.kv_cache_manager.get_block_ids("g")
        read = [_read_blocks(h, h.caches[name], block_ids, 620) for name in h.names]
        blocks_equal = all(torch.equal(k, truth[2 * layer]) and torch.equal(v, truth[2 * layer + 1])
                           for layer, (k, v) in enumerate(read))
        missed = _tokens(300, 1004 + 10 * i)  # a miss: computed whole, gathered out of the blocks and stored
        missed_truth = _random_kv(h, 300, 1005 + 10 * i)
        h.request("m", missed)
        h.step({"m": missed_truth})
        results[shape] = {"layout": h.worker.reason or h.layout.name, "loads": [[s.start, s.end] for s in meta.loads],
                          "load_errors": len(errors), "blocks_equal_to_truth": blocks_equal,
                          **_exact(h, doc + question, truth),
                          "missed": _exact(h, missed, missed_truth)}
    return results


def _random_kv(h: Harness, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h.heads, n, h.dim, generator=g) for _ in range(2 * h.layers)]


def _tokens(n: int, seed: int) -> list:
    return np.random.default_rng(seed).integers(10, 40000, n).tolist()


def _exact(h: Harness, tokens: list, truth: list) -> dict:
    hit, kv = h.stored(tokens)
    equal = hit > 0 and all(torch.equal(a, b[:, :, :hit]) for a, b in zip(kv, truth))
    return {"stored_tokens": hit, "equal_to_truth": bool(equal)}


def load_error(model: str, delivery: str) -> dict:
    """A stored document; a request for it + a question whose 2nd chunk is evicted between lookup and
    load; vLLM recomputes; then what an exact reader of the store gets."""
    h = Harness(model, chunk_size=256, delivery=delivery)
    doc, question = _tokens(700, 1), _tokens(40, 2)
    truth = _random_kv(h, 740, 3)
    h.io.write(h.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :700] for t in truth])
    request = h.request("r1", doc + question)

    def evict_second_chunk(io):
        tokens = np.asarray(doc, dtype=np.uint32)
        io.drop_chunks(h.session, tokens, io.find(h.session, tokens, 700), [1])

    steps = [h.step({"r1": truth}, drop=evict_second_chunk)]  # the 'model' sees stale blocks: garbage
    first = {"loads": len(steps[0][0].loads), "first_saves": len(steps[0][0].saves),
             "load_errors": len(steps[0][1]), "after_failed_step": h.stored(doc + question)[0]}
    steps.append(h.step({"r1": truth}))  # vLLM recomputes from the first failed block
    second = {"second_saves": len(steps[1][0].saves), "computed": request.num_computed_tokens}
    return {**first, **second, **_exact(h, doc + question, truth)}


def aborted_prefill(model: str) -> dict:
    """A long prompt prefilled in chunks, aborted before its prefill completes: nothing is stored."""
    from vllm.v1.request import RequestStatus

    h = Harness(model, chunk_size=256, batch=256)
    tokens = _tokens(700, 4)
    truth = _random_kv(h, 700, 5)
    h.request("r2", tokens)
    meta, _ = h.step({"r2": truth})
    h.scheduler.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    h.step({})
    return {"saves": len(meta.saves), "stored_tokens": h.stored(tokens)[0]}


def verified_hit(model: str) -> dict:
    """verify_fraction=1: a stored prompt's hit holds its last 16 tokens back; the engine computes them
    and kdn compares. Honest KV passes; then the stored chunk holding those rows, replaced by another
    prompt's KV (this harness's "model" does not attend, so the forgery must cover the checked rows;
    the real engine's test plants anywhere), fails, and the hit's chunks are dropped."""
    from kdn import _core

    h = Harness(model, chunk_size=256, verify_fraction=1.0)
    doc = _tokens(600, 6)
    truth = _random_kv(h, 620, 7)
    h.io.write(h.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :600] for t in truth])
    question = _tokens(20, 8)
    h.request("r3", doc + question)
    meta, _ = h.step({"r3": truth})
    honest = {"loaded_to": meta.loads[0].end if meta.loads else 0, "check": meta.saves[0].check}
    before = dict(h.io.verifier.counters)
    # plant: the document's last (partial) chunk replaced by a valid blob of other KV under its key
    tokens = np.asarray(doc, dtype=np.uint32)
    key = h.session.prefix_keys(tokens, include_partial=True)[2]
    other = _random_kv(h, 600, 9)
    for address in h.io.tiers.addresses(key):
        h.io.tiers.drop(address)
    h.io.tiers.put(key, _core.pack_chunk(other, 512, 88, h.session.fingerprint, key))
    h.request("r4", doc + _tokens(20, 10))
    h.step({"r4": truth})
    after = dict(h.io.verifier.counters)
    return {**honest, "honest_checks": before["checks"], "honest_mismatches": before["mismatches"],
            "planted_mismatches": after["mismatches"] - before["mismatches"],
            "stored_after": h.stored(doc)[0], "refused_stores": h.io.refused_stores}


def in_flight(model: str) -> dict:
    """Two questions of one document kdn does not hold arrive together: the second waits (vLLM asks
    again each step) while the first prefills, then loads the document from kdn: prefilled once;
    what it loaded is what an exact reader of the store gets, the first request's KV."""
    h = Harness(model, chunk_size=256)
    doc = _tokens(600, 11)
    first, second = doc + _tokens(20, 12), doc + _tokens(20, 13)
    truth = _random_kv(h, 620, 14)
    other = _random_kv(h, 620, 15)
    truth2 = [torch.cat([a[:, :, :600], b[:, :, 600:]], dim=2) for a, b in zip(truth, other)]
    h.request("a", first)
    h.request("b", second)
    waits = h.connector.stats()["connector"]["in_flight_waits"]
    one, _ = h.step({"a": truth, "b": truth2})
    two, _ = h.step({"a": truth, "b": truth2})
    return {"first_step": one.fresh, "second_step": two.fresh,
            "second_loads": [[s.req_id, s.start, s.end] for s in two.loads],
            "waits": h.connector.stats()["connector"]["in_flight_waits"] - waits, **_exact(h, second, truth2)}


def claimed_elsewhere(model: str, url: str) -> dict:
    """Two engines sharing a Redis store: engine A admits a document's first question and claims
    the chunk it computes (its prefill spans steps); engine B, asked the document's second question
    meanwhile, waits while the claim is live, then loads what A stored: prefilled once."""
    a = Harness(model, chunk_size=256, remote_url=url, batch=256)
    b = Harness(model, chunk_size=256, remote_url=url)
    a.io.remote.clear()
    doc = _tokens(600, 21)
    truth = _random_kv(a, 620, 22)
    other = _random_kv(a, 620, 23)
    truth2 = [torch.cat([x[:, :, :600], y[:, :, 600:]], dim=2) for x, y in zip(truth, other)]
    a.request("a", doc + _tokens(20, 24))
    a_first, _ = a.step({"a": truth})  # 256 of 620 prompt tokens: the claim is live, nothing stored yet
    key = a.worker.engine.computing_keys(a.session, np.asarray(doc, dtype=np.uint32), 0)[0]
    owner = a.io.remote.claims.claimant(key)
    b.request("b", doc + _tokens(20, 25))
    b_waiting, _ = b.step({"b": truth2})
    while a.scheduler.requests["a"].num_computed_tokens < 620:
        a.step({"a": truth})
    a.io.flush()
    b_after, _ = b.step({"b": truth2})
    return {"a_first": a_first.fresh, "claimed_by_a": owner is not None and owner == a.worker.owner,
            "b_waiting": b_waiting.fresh, "b_after": b_after.fresh,
            "b_loads": [[s.req_id, s.start, s.end] for s in b_after.loads],
            **_exact(b, doc + _tokens(20, 25), truth2)}


def carried_lookup(model: str, url: str) -> dict:
    """A document another engine stored in Redis (this engine's memory holds none of it): the worker
    loads the chunks the scheduler's lookup found, with no lookup round trip of its own, and the
    request hashes each of its chunks once."""
    from kdn import KDNConfig
    from kdn.engine import Engine

    h = Harness(model, chunk_size=256, remote_url=url)
    doc, question = _tokens(600, 81), _tokens(20, 82)
    truth = _random_kv(h, 620, 83)
    writer = Engine(KDNConfig(chunk_size=256, remote_url=url))  # another engine: its own memory
    writer.save(h.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :600] for t in truth])
    writer.flush()
    calls, loading = [], [False]
    for name in ("exists", "get", "get_ranges"):
        _count_calls(h.io.remote.transport, name, calls, loading)
    start_load = h.worker.start_load_kv

    def load(*args):
        loading[0] = True
        try:
            return start_load(*args)
        finally:
            loading[0] = False

    h.worker.start_load_kv = load
    hashed = h.session.recent.hashed
    h.request("c", doc + question)
    meta, errors = h.step({"c": truth})
    return {"loads": [[s.start, s.end] for s in meta.loads], "load_errors": len(errors),
            "lookups_while_loading": sum(1 for n, during in calls if during and n == "exists"),
            "reads_while_loading": sum(1 for n, during in calls if during and n != "exists"),
            "chunks_hashed": h.session.recent.hashed - hashed, **_exact(h, doc + question, truth)}


def _count_calls(transport, name: str, calls: list, loading: list) -> None:
    """Record each ``transport.<name>`` call and whether the worker was loading then."""
    call = getattr(transport, name)

    def counted(*args):
        calls.append((name, loading[0]))
        return call(*args)

    setattr(transport, name, counted)


def in_flight_slow_step(model: str) -> dict:
    """The step that completes a prefill outlasts the store grace (a loaded host; the grace is 0
    here) and its store has not landed: a question of that document asked now still waits for it,
    then loads what was stored (it did not: the grace ran from when the step was scheduled, and a
    document was prefilled twice under load)."""
    h = Harness(model, chunk_size=256)
    h.scheduler_module.STORE_GRACE_S = 0.0
    doc = _tokens(600, 31)
    truth = _random_kv(h, 620, 32)
    truth2 = [torch.cat([t[:, :, :600], _random_kv(h, 620, 33)[i][:, :, 600:]], dim=2) for i, t in enumerate(truth)]
    gate = h.hold_saves()
    h.request("a", doc + _tokens(20, 34))
    one, _ = h.step({"a": truth}, drain=False)  # a's whole prompt in one step; its store is held
    h.request("b", doc + _tokens(20, 35))
    two, _ = h.step({"a": truth, "b": truth2}, drain=False)
    gate.set()
    h.connector.drain()
    three, _ = h.step({"a": truth, "b": truth2})
    h.scheduler_module.STORE_GRACE_S = 10.0
    return {"first_step": one.fresh, "second_step": two.fresh, "third_step": three.fresh,
            "third_loads": [[s.req_id, s.start, s.end] for s in three.loads],
            **_exact(h, doc + _tokens(20, 35), truth2)}


def store_not_landed(model: str, worker_elsewhere: bool = False) -> dict:
    """A prompt whose store cannot land (its chunks fit no tier: a full or tiny memory tier): the next
    question of its document is scheduled at once, prefilled by the engine, not held STORE_GRACE_S
    (10 s) for a store that never comes. ``worker_elsewhere``: the scheduler is told so through the
    worker's lookup server, as when vLLM runs the worker in another process."""
    process = importlib.import_module("kdn.integrations.vllm.process")
    here = process.worker_here
    if worker_elsewhere:
        process.worker_here = lambda engine: False  # the scheduler asks the worker's socket
    try:
        return _store_not_landed(model)
    finally:
        process.worker_here = here


def _store_not_landed(model: str) -> dict:
    import time

    h = Harness(model, chunk_size=256, memory_bytes="1MiB")  # an 11.8 MB chunk fits no tier
    doc = _tokens(600, 41)
    truth = _random_kv(h, 620, 42)
    h.request("a", doc + _tokens(20, 43))
    h.step({"a": truth})
    h.request("b", doc + _tokens(20, 44))
    began, waits = time.monotonic(), h.connector.stats()["connector"]["in_flight_waits"]
    second, _ = h.step({"a": truth, "b": truth})
    return {"second_step": second.fresh, "second_loads": [[s.req_id, s.start, s.end] for s in second.loads],
            "seconds": time.monotonic() - began, "stored": h.stored(doc + _tokens(20, 44))[0],
            "waits": h.connector.stats()["connector"]["in_flight_waits"] - waits}


def claimed_partly_stored(model: str, url: str) -> dict:
    """Two engines on one Redis: engine A claims every chunk it computes, so engine B, whose lookup
    finds A's first chunk stored and the rest still on their way, waits for them instead of
    claiming and computing the second chunk itself (a document prefilled twice, 256 tokens served)."""
    a = Harness(model, chunk_size=256, remote_url=url)
    b = Harness(model, chunk_size=256, remote_url=url)
    a.io.remote.clear()
    doc = _tokens(600, 41)
    truth = _random_kv(a, 620, 42)
    truth2 = [torch.cat([t[:, :, :600], _random_kv(a, 620, 43)[i][:, :, 600:]], dim=2) for i, t in enumerate(truth)]
    gate = a.hold_saves()
    a.request("a", doc + _tokens(20, 44))
    a.step({"a": truth}, drain=False)  # computed (claimed) in one step; its store is held
    tokens = np.asarray(doc, dtype=np.uint32)
    keys = a.worker.engine.computing_keys(a.session, tokens, 0)
    claimed = [a.io.remote.claims.claimant(k) == a.worker.owner for k in keys]  # (a lease A would renew as it steps)
    from kdn import _core

    # A's first chunk lands before the rest
    a.io.remote.put(keys[0], _core.pack_chunk(truth, 0, 256, a.session.fingerprint, keys[0]), wait=True)
    b.request("b", doc + _tokens(20, 45))
    b_hit = b.worker.engine.lookup(b.session, tokens, 600)
    b_waiting, _ = b.step({"b": truth2})
    gate.set()
    a.connector.drain()
    a.io.flush()
    b_after, _ = b.step({"b": truth2})
    return {"b_hit_while_storing": b_hit, "claimed_by_a": claimed,
            "b_waiting": b_waiting.fresh, "b_after": b_after.fresh,
            "b_loads": [[s.req_id, s.start, s.end] for s in b_after.loads],
            **_exact(b, doc + _tokens(20, 45), truth2)}



def store_down(model: str) -> dict:
    """Issue 46, defect 1: the remote store cannot be used (nothing listens on its port): a new
    document's request is scheduled at once, computed and stored in the other tiers (its claim
    answered "cannot tell", which never makes a request wait)."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    h = Harness(model, chunk_size=256, remote_url=f"redis://127.0.0.1:{port}/0", remote_timeout=0.2)
    doc = _tokens(600, 51) + _tokens(20, 52)
    truth = _random_kv(h, 620, 53)
    h.request("a", doc)
    start = time.monotonic()
    first, _ = h.step({"a": truth})
    return {"first_step": first.fresh, "seconds": time.monotonic() - start,
            "remote_state": h.worker.engine.stats()["remote"]["state"], **_exact(h, doc, truth)}


def forged_claim(model: str, url: str) -> dict:
    """Issue 46, defect 2: a claim planted without a TTL under a document's first chunk (a shared
    system prompt, say) holds no request: it is removed, the request computes at once."""
    h = Harness(model, chunk_size=256, remote_url=url)
    h.io.remote.clear()
    doc = _tokens(600, 61) + _tokens(20, 62)
    truth = _random_kv(h, 620, 63)
    key = h.worker.engine.computing_keys(h.session, np.asarray(doc, dtype=np.uint32), 0)[0]
    h.io.remote.transport.client.set(h.io.remote.claims.name(key), b"intruder")  # forever
    h.request("a", doc)
    first, _ = h.step({"a": truth})
    return {"first_step": first.fresh, "bad_claims": h.io.remote.stats()["bad_claims"],
            "claimed_by": h.io.remote.claims.claimant(key), "owner": h.worker.owner, **_exact(h, doc, truth)}


def claim_lease(model: str, url: str) -> dict:
    """Issue 46, defect 2: a claim is a lease its engine renews while the prefill runs. Engine B
    waits on A's claim while A keeps stepping (past one lease), then loads what A stored; a claim
    whose engine stopped (never renewed, never released) holds B one lease at most."""
    import time

    a = Harness(model, chunk_size=256, remote_url=url, batch=256)
    b = Harness(model, chunk_size=256, remote_url=url)
    a.io.remote.clear()
    lease = a.scheduler_module.CLAIM_LEASE_S
    a.scheduler_module.CLAIM_LEASE_S = 0.6
    try:
        doc = _tokens(600, 71)
        truth = _random_kv(a, 620, 72)
        truth_b = [torch.cat([x[:, :, :600], y[:, :, 600:]], dim=2) for x, y in zip(truth, _random_kv(a, 620, 73))]
        a.request("a", doc + _tokens(20, 74))
        a.step({"a": truth})  # 256 of 620: claimed
        b.request("b", doc + _tokens(20, 75))
        waits = []
        for _ in range(2):  # 0.8 s in all: past the lease, renewed by A's steps
            time.sleep(0.4)
            a.step({"a": truth}) if a.scheduler.requests["a"].num_computed_tokens < 512 else None
            waits.append(b.step({"b": truth_b})[0].fresh)
        while a.scheduler.requests["a"].num_computed_tokens < 620:
            a.step({"a": truth})
        a.io.flush()
        after, _ = b.step({"b": truth_b})
        renewed = {"b_while_a_runs": waits, "b_after": after.fresh,
                   "b_loads": [[s.req_id, s.start, s.end] for s in after.loads],
                   **_exact(b, doc + _tokens(20, 75), truth_b)}

        doc2 = _tokens(600, 76)
        a.request("a2", doc2 + _tokens(20, 77))
        a.step({"a2": _random_kv(a, 620, 78)})  # claimed; engine A then stops (never renews, never releases)
        b.request("b2", doc2 + _tokens(20, 79))
        held = b.step({"b2": _random_kv(b, 620, 80)})[0].fresh
        time.sleep(0.8)
        lapsed = b.step({"b2": _random_kv(b, 620, 80)})[0].fresh
        return {**renewed, "b2_while_claim_live": held, "b2_after_lease": lapsed}
    finally:
        a.scheduler_module.CLAIM_LEASE_S = lease


def salted(model: str) -> dict:
    """Issue 46: requests with different ``cache_salt`` never share KV (the first question of a
    document in tenant-a stores it; tenant-b's and a request without a salt compute it whole, not
    even waiting on tenant-a's in-flight prefill); a second request of tenant-a loads it."""
    h = Harness(model, chunk_size=256)
    doc = _tokens(600, 81)
    truth = _random_kv(h, 620, 82)
    h.request("a", doc + _tokens(20, 83), cache_salt="tenant-a")
    first, _ = h.step({"a": truth})
    h.request("b", doc + _tokens(20, 84), cache_salt="tenant-b")
    h.request("n", doc + _tokens(20, 85))
    others, _ = h.step({"b": _random_kv(h, 620, 86), "n": _random_kv(h, 620, 87)})
    truth_c = [torch.cat([x[:, :, :600], y[:, :, 600:]], dim=2) for x, y in zip(truth, _random_kv(h, 620, 88))]
    h.request("c", doc + _tokens(20, 89), cache_salt="tenant-a")
    same, _ = h.step({"c": truth_c})
    lookup = h.worker.engine.lookup
    tokens = np.asarray(doc, dtype=np.uint32)
    return {"first": first.fresh, "others": sorted(others.fresh), "others_loads": len(others.loads),
            "same_loads": [[s.req_id, s.start, s.end] for s in same.loads],
            "held": {salt or "none": lookup(h.session.within(salt), tokens, 600)
                     for salt in ("tenant-a", "tenant-b", None)}}


if __name__ == "__main__":
    main()
