"""Sends a running `vllm serve` a prompt over its length and a request it leaves mid-stream, then
asks it the same document twice through the real openai client (streamed,
so the first chunk's arrival is the TTFT), then two questions of a new document at once, and reads
its /metrics; prints one JSON line. Run in the
vLLM venv by tests/test_vllm.py:

    python tests/vllm_client.py --url http://127.0.0.1:8000 --model DIR --document doc.txt
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--document", required=True)
    args = parser.parse_args()
    from openai import OpenAI

    client = OpenAI(base_url=args.url + "/v1", api_key="unused")
    document = open(args.document).read()
    # bad input first: a prompt over the engine's length, and a client that leaves mid-stream
    try:
        client.completions.create(model=args.model, prompt=document * 8, max_tokens=4)
        too_long = "accepted"
    except Exception as e:  # openai.BadRequestError: the server refused it and keeps serving
        too_long = type(e).__name__
    stream = client.completions.create(model=args.model, prompt=document[::-1][:3000], max_tokens=64, stream=True)
    next(iter(stream))
    stream.close()  # the client disconnects after the first chunk
    answers = []
    for question in ("Who founded the city?", "How long does the ferry take?"):
        t0 = time.perf_counter()
        ttft, text = None, ""
        stream = client.completions.create(model=args.model, prompt=document + "\nQuestion: " + question,
                                           max_tokens=8, temperature=0, stream=True)
        for chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += chunk.choices[0].text
        answers.append({"ttft": ttft, "text": text})
    # two questions about a new document at once: the second waits for the first's prefill (counted
    # by the scheduler's process, reported on /metrics with the worker's counters). The pair must
    # reach the engine before the first's KV is stored (else the second is a plain hit, also right):
    # the document is the whole text rotated, twice over (a new chain, a prefill longer than one
    # step's 2,048 tokens, so that the second arrives while the first is still prefilling; kdn files
    # a finished prefill's chunks within milliseconds), a fresh rotation per try
    for attempt in range(3):
        shift = len(document) * (attempt + 1) // 4
        other = (document[shift:] + document[:shift]) * 2 + "\nQuestion: "
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda q, other=other: client.completions.create(
                model=args.model, prompt=other + q, max_tokens=4, temperature=0).choices[0].text,
                ("Where is the harbour?", "What is the oldest bridge?")))
        kdn = kdn_metrics(args.url)
        if kdn.get("vllm:kdn_in_flight_waits_total", 0) >= 1:
            break
    print("KDN-RESULT " + json.dumps({"answers": answers, "together": together, "metrics": kdn,
                                           "names": metric_names(args.url), "too_long": too_long,
                                           "pair_tries": attempt + 1}), flush=True)


def kdn_metrics(url: str) -> dict:
    """kdn's counters on vLLM's Prometheus /metrics, summed over labels."""
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    kdn = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:kdn_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            kdn[name] = kdn.get(name, 0.0) + float(value)
    return kdn


def metric_names(url: str) -> list[str]:
    """Every sample's name on vLLM's /metrics (what a dashboard's queries may name)."""
    metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sorted({line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line and line[0] != "#"})


if __name__ == "__main__":
    main()
