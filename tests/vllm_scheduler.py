"""The connector's two halves driven in-process by vLLM's real Scheduler (as vLLM's own
tests/v1/kv_connector/unit do), with the worker half over paged CPU blocks the harness fills itself
(tests/vllm_harness.py): what a failed load, an aborted prefill and a verified hit store. Prints one
JSON line per scenario. Run in the vLLM venv by tests/test_vllm.py:

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
from vllm_events import events, hit_sources
from vllm_harness import Harness, random_kv, random_tokens, stored_exactly


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
        results["squatted_claim"] = squatted_claim(args.model, args.redis)
        results["carried_lookup"] = carried_lookup(args.model, args.redis)
    results["store_down"] = store_down(args.model)
    results["salted"] = salted(args.model)
    results["scoped"] = scoped(args.model)
    results["retained"] = retained(args.model)
    results["events"] = events(args.model)
    results["hit_sources"] = hit_sources(args.model)
    results["hit_sources_served"] = hit_sources(args.model, through_lookup_server=True)
    print("KDN-RESULT " + json.dumps(results), flush=True)


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
        doc, question = random_tokens(600, 1001 + 10 * i), random_tokens(20, 1002 + 10 * i)
        truth = random_kv(h, 620, 1003 + 10 * i)
        h.io.write(h.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :600] for t in truth])
        h.request("g", doc + question)
        meta, errors = h.step({"g": truth})
        (block_ids,) = h.scheduler.kv_cache_manager.get_block_ids("g")
        read = [_read_blocks(h, h.caches[name], block_ids, 620) for name in h.names]
        blocks_equal = all(torch.equal(k, truth[2 * layer]) and torch.equal(v, truth[2 * layer + 1])
                           for layer, (k, v) in enumerate(read))
        missed = random_tokens(300, 1004 + 10 * i)  # a miss: computed whole, gathered out of the blocks and stored
        missed_truth = random_kv(h, 300, 1005 + 10 * i)
        h.request("m", missed)
        h.step({"m": missed_truth})
        results[shape] = {"layout": h.worker.reason or h.layout.name, "loads": [[s.start, s.end] for s in meta.loads],
                          "load_errors": len(errors), "blocks_equal_to_truth": blocks_equal,
                          **stored_exactly(h, doc + question, truth),
                          "missed": stored_exactly(h, missed, missed_truth)}
    return results


def load_error(model: str, delivery: str) -> dict:
    """A stored document; a request for it + a question whose 2nd chunk is evicted between lookup and
    load; vLLM recomputes; then what an exact reader of the store gets."""
    h = Harness(model, chunk_size=256, delivery=delivery)
    doc, question = random_tokens(700, 1), random_tokens(40, 2)
    truth = random_kv(h, 740, 3)
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
    return {**first, **second, **stored_exactly(h, doc + question, truth)}


def aborted_prefill(model: str) -> dict:
    """A long prompt prefilled in chunks, aborted before its prefill completes: nothing is stored."""
    from vllm.v1.request import RequestStatus

    h = Harness(model, chunk_size=256, batch=256)
    tokens = random_tokens(700, 4)
    truth = random_kv(h, 700, 5)
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
    doc = random_tokens(600, 6)
    truth = random_kv(h, 620, 7)
    h.io.write(h.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :600] for t in truth])
    question = random_tokens(20, 8)
    h.request("r3", doc + question)
    meta, _ = h.step({"r3": truth})
    honest = {"loaded_to": meta.loads[0].end if meta.loads else 0, "check": meta.saves[0].check}
    before = dict(h.io.verifier.counters)
    # plant: the document's last (partial) chunk replaced by a valid blob of other KV under its key
    tokens = np.asarray(doc, dtype=np.uint32)
    key = h.session.prefix_keys(tokens, include_partial=True)[2]
    other = random_kv(h, 600, 9)
    forge.plant(h.worker.engine, key, _core.pack_chunk(other, 512, 88, h.session.fingerprint, key))
    h.request("r4", doc + random_tokens(20, 10))
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
    doc = random_tokens(600, 11)
    first, second = doc + random_tokens(20, 12), doc + random_tokens(20, 13)
    truth = random_kv(h, 620, 14)
    other = random_kv(h, 620, 15)
    truth2 = [torch.cat([a[:, :, :600], b[:, :, 600:]], dim=2) for a, b in zip(truth, other)]
    h.request("a", first)
    h.request("b", second)
    waits = h.connector.stats()["connector"]["in_flight_waits"]
    one, _ = h.step({"a": truth, "b": truth2})
    two, _ = h.step({"a": truth, "b": truth2})
    return {"first_step": one.fresh, "second_step": two.fresh,
            "second_loads": [[s.req_id, s.start, s.end] for s in two.loads],
            "waits": h.connector.stats()["connector"]["in_flight_waits"] - waits, **stored_exactly(h, second, truth2)}


def claimed_elsewhere(model: str, url: str) -> dict:
    """Two engines sharing a Redis store: engine A admits a document's first question and claims
    the chunk it computes (its prefill spans steps); engine B, asked the document's second question
    meanwhile, waits while the claim is live, then loads what A stored: prefilled once."""
    a = Harness(model, chunk_size=256, remote_url=url, batch=256)
    b = Harness(model, chunk_size=256, remote_url=url)
    a.io.remote.clear()
    doc = random_tokens(600, 21)
    truth = random_kv(a, 620, 22)
    other = random_kv(a, 620, 23)
    truth2 = [torch.cat([x[:, :, :600], y[:, :, 600:]], dim=2) for x, y in zip(truth, other)]
    a.request("a", doc + random_tokens(20, 24))
    a_first, _ = a.step({"a": truth})  # 256 of 620 prompt tokens: the claim is live, nothing stored yet
    key = a.worker.engine.computing_keys(a.session, np.asarray(doc, dtype=np.uint32), 0)[0]
    owner = a.io.remote.claims.claimant(key)
    b.request("b", doc + random_tokens(20, 25))
    b_waiting, _ = b.step({"b": truth2})
    while a.scheduler.requests["a"].num_computed_tokens < 620:
        a.step({"a": truth})
    a.io.flush()
    b_after, _ = b.step({"b": truth2})
    return {"a_first": a_first.fresh, "claimed_by_a": owner is not None and owner == a.worker.owner,
            "b_waiting": b_waiting.fresh, "b_after": b_after.fresh,
            "b_loads": [[s.req_id, s.start, s.end] for s in b_after.loads],
            **stored_exactly(b, doc + random_tokens(20, 25), truth2)}


def carried_lookup(model: str, url: str) -> dict:
    """A document another engine stored in Redis (this engine's memory holds none of it): the worker
    loads the chunks the scheduler's lookup found, with no lookup round trip of its own, and the
    request hashes each of its chunks once."""
    from kdn import KDNConfig
    from kdn.engine import Engine

    h = Harness(model, chunk_size=256, remote_url=url)
    doc, question = random_tokens(600, 81), random_tokens(20, 82)
    truth = random_kv(h, 620, 83)
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
            "chunks_hashed": h.session.recent.hashed - hashed, **stored_exactly(h, doc + question, truth)}


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
    h.policy.store_grace = 0.0
    doc = random_tokens(600, 31)
    truth = random_kv(h, 620, 32)
    truth2 = [torch.cat([t[:, :, :600], random_kv(h, 620, 33)[i][:, :, 600:]], dim=2) for i, t in enumerate(truth)]
    gate = h.hold_saves()
    h.request("a", doc + random_tokens(20, 34))
    one, _ = h.step({"a": truth}, drain=False)  # a's whole prompt in one step; its store is held
    h.request("b", doc + random_tokens(20, 35))
    two, _ = h.step({"a": truth, "b": truth2}, drain=False)
    gate.set()
    h.connector.drain()
    three, _ = h.step({"a": truth, "b": truth2})
    h.policy.store_grace = 10.0
    return {"first_step": one.fresh, "second_step": two.fresh, "third_step": three.fresh,
            "third_loads": [[s.req_id, s.start, s.end] for s in three.loads],
            **stored_exactly(h, doc + random_tokens(20, 35), truth2)}


def store_not_landed(model: str, worker_elsewhere: bool = False) -> dict:
    """A prompt whose store cannot land (its chunks fit no tier: a full or tiny memory tier): the next
    question of its document is scheduled at once, prefilled by the engine, not held Requests.store_grace
    (10 s) for a store that never comes. ``worker_elsewhere``: the scheduler is told so through the
    worker's lookup server, as when vLLM runs the worker in another process."""
    import time

    process = importlib.import_module("kdn.integrations.vllm.process")
    here = process.worker_here
    if worker_elsewhere:
        process.worker_here = lambda engine: False  # the scheduler asks the worker's socket
    try:
        h = Harness(model, chunk_size=256, memory_bytes="1MiB")  # an 11.8 MB chunk fits no tier
        doc = random_tokens(600, 41)
        truth = random_kv(h, 620, 42)
        h.request("a", doc + random_tokens(20, 43))
        h.step({"a": truth})
        h.request("b", doc + random_tokens(20, 44))
        began, waits = time.monotonic(), h.connector.stats()["connector"]["in_flight_waits"]
        second, _ = h.step({"a": truth, "b": truth})
    finally:
        process.worker_here = here
    return {"second_step": second.fresh, "second_loads": [[s.req_id, s.start, s.end] for s in second.loads],
            "seconds": time.monotonic() - began, "stored": h.stored(doc + random_tokens(20, 44))[0],
            "waits": h.connector.stats()["connector"]["in_flight_waits"] - waits}


def claimed_partly_stored(model: str, url: str) -> dict:
    """Two engines on one Redis: engine A claims every chunk it computes, so engine B, whose lookup
    finds A's first chunk stored and the rest still on their way, waits for them instead of
    claiming and computing the second chunk itself (a document prefilled twice, 256 tokens served)."""
    a = Harness(model, chunk_size=256, remote_url=url)
    b = Harness(model, chunk_size=256, remote_url=url)
    a.io.remote.clear()
    doc = random_tokens(600, 41)
    truth = random_kv(a, 620, 42)
    truth2 = [torch.cat([t[:, :, :600], random_kv(a, 620, 43)[i][:, :, 600:]], dim=2) for i, t in enumerate(truth)]
    gate = a.hold_saves()
    a.request("a", doc + random_tokens(20, 44))
    a.step({"a": truth}, drain=False)  # computed (claimed) in one step; its store is held
    tokens = np.asarray(doc, dtype=np.uint32)
    keys = a.worker.engine.computing_keys(a.session, tokens, 0)
    claimed = [a.io.remote.claims.claimant(k) == a.worker.owner for k in keys]  # (a lease A would renew as it steps)
    from kdn import _core

    # A's first chunk lands before the rest
    a.io.remote.put(keys[0], _core.pack_chunk(truth, 0, 256, a.session.fingerprint, keys[0]), wait=True)
    b.request("b", doc + random_tokens(20, 45))
    b_hit = b.worker.engine.lookup(b.session, tokens, 600)
    b_waiting, _ = b.step({"b": truth2})
    gate.set()
    a.connector.drain()
    a.io.flush()
    b_after, _ = b.step({"b": truth2})
    return {"b_hit_while_storing": b_hit, "claimed_by_a": claimed,
            "b_waiting": b_waiting.fresh, "b_after": b_after.fresh,
            "b_loads": [[s.req_id, s.start, s.end] for s in b_after.loads],
            **stored_exactly(b, doc + random_tokens(20, 45), truth2)}



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
    doc = random_tokens(600, 51) + random_tokens(20, 52)
    truth = random_kv(h, 620, 53)
    h.request("a", doc)
    start = time.monotonic()
    first, _ = h.step({"a": truth})
    return {"first_step": first.fresh, "seconds": time.monotonic() - start,
            "remote_state": h.worker.engine.stats()["remote"]["state"], **stored_exactly(h, doc, truth)}


def forged_claim(model: str, url: str) -> dict:
    """Issue 46, defect 2: a claim planted without a TTL under a document's first chunk (a shared
    system prompt, say) holds no request: it is removed, the request computes at once."""
    h = Harness(model, chunk_size=256, remote_url=url)
    h.io.remote.clear()
    doc = random_tokens(600, 61) + random_tokens(20, 62)
    truth = random_kv(h, 620, 63)
    key = h.worker.engine.computing_keys(h.session, np.asarray(doc, dtype=np.uint32), 0)[0]
    h.io.remote.transport.client.set(h.io.remote.claims.name(key), b"intruder")  # forever
    h.request("a", doc)
    first, _ = h.step({"a": truth})
    return {"first_step": first.fresh, "bad_claims": h.io.remote.stats()["bad_claims"],
            "claimed_by": h.io.remote.claims.claimant(key), "owner": h.worker.owner, **stored_exactly(h, doc, truth)}


def squatted_claim(model: str, url: str) -> dict:
    """Issue 62: "mallory" writes a claim as kdn writes one (a printable owner, a lease kdn would
    take) on a document's first chunk, computable from the model and a shared system prompt. A
    request waits on it at most ``Requests.progress_leases`` leases with nothing of its prompt stored
    meanwhile, then computes and stores the document exactly (it waited ``Requests.in_flight_wait``)."""
    import time

    h = Harness(model, chunk_size=256, remote_url=url)
    h.io.remote.clear()
    lease = h.policy.lease
    h.policy.lease = 0.3
    try:
        doc = random_tokens(600, 111) + random_tokens(20, 112)
        truth = random_kv(h, 620, 113)
        key = h.worker.engine.computing_keys(h.session, np.asarray(doc, dtype=np.uint32), 0)[0]
        h.io.remote.transport.client.set(h.io.remote.claims.name(key), b"mallory", px=30_000)
        h.request("a", doc)
        start, steps = time.monotonic(), 0
        while "a" not in h.step({"a": truth})[0].fresh and time.monotonic() - start < 20:
            steps += 1
            time.sleep(0.1)
        held = time.monotonic() - start
        bound = 0.3 * h.policy.progress_leases
        return {"held_seconds": held, "waited_steps": steps, "bound_seconds": bound, **stored_exactly(h, doc, truth)}
    finally:
        h.policy.lease = lease


def claim_lease(model: str, url: str) -> dict:
    """Issue 46, defect 2: a claim is a lease its engine renews while the prefill runs. Engine B
    waits on A's claim while A keeps stepping (past one lease), then loads what A stored; a claim
    whose engine stopped (never renewed, never released) holds B one lease at most."""
    import time

    a = Harness(model, chunk_size=256, remote_url=url, batch=256)
    b = Harness(model, chunk_size=256, remote_url=url)
    a.io.remote.clear()
    lease = a.policy.lease
    a.policy.lease = 0.6
    try:
        doc = random_tokens(600, 71)
        truth = random_kv(a, 620, 72)
        truth_b = [torch.cat([x[:, :, :600], y[:, :, 600:]], dim=2) for x, y in zip(truth, random_kv(a, 620, 73))]
        a.request("a", doc + random_tokens(20, 74))
        a.step({"a": truth})  # 256 of 620: claimed
        b.request("b", doc + random_tokens(20, 75))
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
                   **stored_exactly(b, doc + random_tokens(20, 75), truth_b)}

        doc2 = random_tokens(600, 76)
        a.request("a2", doc2 + random_tokens(20, 77))
        a.step({"a2": random_kv(a, 620, 78)})  # claimed; engine A then stops (never renews, never releases)
        b.request("b2", doc2 + random_tokens(20, 79))
        held = b.step({"b2": random_kv(b, 620, 80)})[0].fresh
        time.sleep(0.8)
        lapsed = b.step({"b2": random_kv(b, 620, 80)})[0].fresh
        return {**renewed, "b2_while_claim_live": held, "b2_after_lease": lapsed}
    finally:
        a.policy.lease = lease


def salted(model: str) -> dict:
    """Issue 46: requests with different ``cache_salt`` never share KV (the first question of a
    document in tenant-a stores it; tenant-b's and a request without a salt compute it whole, not
    even waiting on tenant-a's in-flight prefill); a second request of tenant-a loads it."""
    h = Harness(model, chunk_size=256)
    doc = random_tokens(600, 81)
    truth = random_kv(h, 620, 82)
    h.request("a", doc + random_tokens(20, 83), cache_salt="tenant-a")
    first, _ = h.step({"a": truth})
    h.request("b", doc + random_tokens(20, 84), cache_salt="tenant-b")
    h.request("n", doc + random_tokens(20, 85))
    others, _ = h.step({"b": random_kv(h, 620, 86), "n": random_kv(h, 620, 87)})
    truth_c = [torch.cat([x[:, :, :600], y[:, :, 600:]], dim=2) for x, y in zip(truth, random_kv(h, 620, 88))]
    h.request("c", doc + random_tokens(20, 89), cache_salt="tenant-a")
    same, _ = h.step({"c": truth_c})
    lookup = h.worker.engine.lookup
    tokens = np.asarray(doc, dtype=np.uint32)
    return {"first": first.fresh, "others": sorted(others.fresh), "others_loads": len(others.loads),
            "same_loads": [[s.req_id, s.start, s.end] for s in same.loads],
            "held": {salt or "none": lookup(h.session.within(salt), tokens, 600)
                     for salt in ("tenant-a", "tenant-b", None)}}


def scoped(model: str) -> dict:
    """Issue 62: what vLLM puts in a block hash is in kdn's keys. A base request stores a document; a
    request with LoRA adapter A (by its files) is not served it and stores its own; the same files
    under another name and id are served A's; adapter B (other files) is served neither. A salt of
    2,000 characters and one holding a lone surrogate are tenants like any other (stored, then served
    within), never an exception into vLLM's scheduler."""
    import shutil
    import tempfile
    from pathlib import Path

    from vllm.lora.request import LoRARequest

    folder = Path(tempfile.mkdtemp())
    for name, seed in (("a", 1), ("b", 2)):  # what kdn reads of an adapter: its files
        (folder / name).mkdir()
        (folder / name / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
        (folder / name / "adapter_model.safetensors").write_bytes(bytes(random_tokens(64, seed)[i] % 256
                                                                         for i in range(64)))
    shutil.copytree(folder / "a", folder / "a-copy")
    h = Harness(model, chunk_size=256)
    doc = random_tokens(600, 90)
    truth = {name: random_kv(h, 620, 91 + i) for i, name in enumerate(("base", "a", "b", "long", "odd"))}
    served = {}

    def ask(req_id: str, truth_of: str, **kw) -> None:
        h.request(req_id, doc + random_tokens(20, 100 + len(served)), **kw)
        meta, _ = h.step({req_id: truth[truth_of]})
        served[req_id] = [[s.start, s.end] for s in meta.loads]

    ask("base", "base")
    ask("a", "a", lora=LoRARequest("adapter-a", 1, str(folder / "a")))
    ask("a-renamed", "a", lora=LoRARequest("another-name", 7, str(folder / "a-copy")))
    ask("b", "b", lora=LoRARequest("adapter-b", 2, str(folder / "b")))
    ask("base-again", "base")
    for salt, name in (("s" * 2000, "long"), ("odd \udc80 salt", "odd")):
        ask(f"{name}-1", name, cache_salt=salt)
        ask(f"{name}-2", name, cache_salt=salt)
    from kdn.keys import adapter_fingerprint, request_scope

    scopes = {"base": None, "a": request_scope(adapter=adapter_fingerprint(folder / "a")),
              "b": request_scope(adapter=adapter_fingerprint(folder / "b")), "long": request_scope("s" * 2000)}
    return {"served": served, "stored": {name: stored_exactly(h, doc[:512], truth[name], scope)
                                         for name, scope in scopes.items()}}


def retained(model: str) -> dict:
    """Issue 64: ``kv_transfer_params={"kdn": {"retain": 60}}`` pins the stored prompt in the worker's
    memory; ``{"priority": -3}`` orders its chunks in the tiers without a pin; ``{"store": false}`` is
    served and stores nothing; a value kdn cannot use is ignored (stored, not kept), never an
    exception into vLLM's scheduler."""
    from kdn.integrations.vllm import metrics

    h = Harness(model, chunk_size=256)
    memory = h.worker.engine.tier("memory")
    out = {}
    for name, transfer, seed in (("kept", {"kdn": {"retain": 60}}, 120), ("ephemeral", {"kdn": {"store": False}}, 121),
                                 ("bad", {"kdn": {"retain": "forever"}}, 122), ("low", {"kdn": {"priority": -3}}, 123),
                                 ("bad-priority", {"kdn": {"priority": 1.5}}, 124)):
        doc = random_tokens(600, seed)
        before = metrics.totals()["retained_chunks"]
        h.request(name, doc, transfer=transfer)
        meta, _ = h.step({name: random_kv(h, 600, seed)})
        out[name] = {"saves": len(meta.saves), "stored_tokens": h.stored(doc)[0],
                     "retained_chunks": metrics.totals()["retained_chunks"] - before,
                     "pinned_bytes": memory.stats()["pinned_bytes"]}
    # an ephemeral request over a stored document is loaded its hit (its blocks, read with vLLM's own
    # indexing, hold the stored KV) and stores nothing of its own
    g = Harness(model, block=16, gpu_shape="HND", chunk_size=256)
    doc = random_tokens(600, 125)
    truth = random_kv(g, 620, 126)
    g.io.write(g.session, np.asarray(doc, dtype=np.uint32), [t[:, :, :600] for t in truth])
    g.request("ephemeral-hit", doc + random_tokens(20, 127), transfer={"kdn": {"store": False}})
    meta, _ = g.step({"ephemeral-hit": truth})
    (block_ids,) = g.scheduler.kv_cache_manager.get_block_ids("ephemeral-hit")
    read = [_read_blocks(g, g.caches[name], block_ids, 620) for name in g.names]
    equal = all(torch.equal(k, truth[2 * i]) and torch.equal(v, truth[2 * i + 1]) for i, (k, v) in enumerate(read))
    out["ephemeral-hit"] = {"loads": [[s.start, s.end] for s in meta.loads], "saves": len(meta.saves),
                            "blocks_equal_to_truth": equal}
    return out


if __name__ == "__main__":
    main()
