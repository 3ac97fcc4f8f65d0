"""The clients of bench_serving.py: concurrent streamed completions against running vLLM servers
through the `openai` async client (run in the vLLM venv, which has it). Reads a JSON job, prints one
JSON line ``KDN-RESULT {...}`` with a record per request.

Job: ``{"urls": [...], "model": DIR, "concurrency": C, "max_tokens": M, "workload": "docqa",
"prompts": [[ids], ...]}`` (prompts sent in order, at most C in flight, request i to server
i % len(urls), or ``route[i]`` when the job has ``"route"``) or ``{"workload": "chat", "sessions":
[[opening ids], ...], "turns": [[ids], ...]}``
(round r: every session sends its history + turn r, C at a time; its reply joins its history).
``"keep_replies": true`` keeps each request's reply token ids in its record. ``"priority_prefix": P``
sends each request with vLLM's ``priority``: 0 when the first P tokens of its prompt began a prompt
sent before (a prefix-aware router's guess that it is a hit), else 1; the record keeps it.

    python benchmarks/serving_client.py job.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


def _engine_times(chunk) -> dict:
    """The engine's own times of a request (vLLM's ``--enable-per-request-metrics``: on the final usage
    chunk): queue wait (arrival to first scheduled, where a request kdn holds back waits), scheduled to
    first token (its prefill, or the load and its question) and first to last token, in seconds."""
    metrics = getattr(chunk, "metrics", None) or (chunk.model_extra or {}).get("metrics")
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        metrics = metrics.model_dump() if hasattr(metrics, "model_dump") else dict(metrics)
    names = {"queue_time_ms": "queue_s", "time_to_first_token_ms": "scheduled_to_first_token_s",
             "generation_time_ms": "decode_s"}
    return {ours: metrics[theirs] / 1e3 for theirs, ours in names.items() if metrics.get(theirs) is not None}


async def complete(client, model: str, prompt: list[int], max_tokens: int, priority: int | None = None) -> dict:
    """One streamed request: TTFT (first chunk), latency, prompt and cached tokens, reply ids, and the
    engine's own times when it reports them."""
    t0 = time.perf_counter()
    ttft, reply, usage, engine = None, [], None, {}
    extra = {"return_token_ids": True, **({"priority": priority} if priority is not None else {})}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.choices:
            if ttft is None:
                ttft = time.perf_counter() - t0
            reply += getattr(chunk.choices[0], "token_ids", None) or []
        if chunk.usage is not None:
            usage = chunk.usage
            engine = _engine_times(chunk)
    details = getattr(usage, "prompt_tokens_details", None)
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details is not None else 0, "reply": reply,
            "start": t0, **engine}


async def run_all(clients: list, job: dict, prompts: list[list[int]], sent: set) -> list[dict]:
    """``prompts`` in order, at most ``concurrency`` in flight; request i goes to server ``route[i]`` (or i % servers).
    ``sent``: the prompt prefixes sent so far (``priority_prefix`` tokens each), updated."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    out: list = [None] * len(prompts)
    route = job.get("route")

    def server(i: int) -> int:
        return route[i] if route else i % len(clients)

    async def worker() -> None:
        while not queue.empty():
            i, prompt = queue.get_nowait()
            priority = None
            if job.get("priority_prefix"):
                head = tuple(prompt[:job["priority_prefix"]])
                priority = 0 if head in sent else 1
                sent.add(head)
            try:
                out[i] = await complete(clients[server(i)], job["model"], prompt, job["max_tokens"], priority)
            except Exception as e:  # a failed request is a result, not the end of the run
                out[i] = {"error": repr(e)[:300]}
            out[i]["server"] = server(i)
            if priority is not None:
                out[i]["priority"] = priority

    await asyncio.gather(*[worker() for _ in range(job["concurrency"])])
    return out


async def main(job: dict) -> dict:
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=3600, max_retries=0)
               for url in job["urls"]]
    t0, t0_epoch, sent = time.perf_counter(), time.time(), set()
    if job["workload"] == "docqa":
        records = await run_all(clients, job, job["prompts"], sent)
    else:  # chat: rounds; a session's reply joins its history before its next turn
        histories = [list(s) for s in job["sessions"]]
        records = []
        for r, turn in enumerate(job["turns"]):
            prompts = [h + turn for h in histories]
            done = await run_all(clients, job, prompts, sent)
            for s, (prompt, rec) in enumerate(zip(prompts, done)):
                rec.update(session=s, round=r, prior_tokens=len(histories[s]) if r else 0)
                histories[s] = prompt + rec.get("reply", [])
            records += done
    wall = time.perf_counter() - t0
    for rec in records:
        if not job.get("keep_replies"):
            rec.pop("reply", None)
        rec["start"] = rec.get("start", t0) - t0
    return {"wall": wall, "t0_epoch": t0_epoch, "records": records}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = asyncio.run(main(json.load(f)))
    print("KDN-RESULT " + json.dumps(result), flush=True)
