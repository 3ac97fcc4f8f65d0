"""What trust costs: the model fingerprint over every weight byte (first call, cached call) against
the old 4096-value sample, SmolLM2 load from the GGUF vs the cached safetensors, and the keyed
BLAKE3 tag (secret=) against the plain XXH64 checksum on the same bytes.

    python benchmarks/bench_trust.py [--model smollm2-135m] [--out bench_out]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import kdn
from kdn import _core
from kdn.keys import model_fingerprint
from timing import save_result, timed


def sampled_fingerprint(model) -> bytes:
    """The first round's identity (a baseline only): 4096 evenly spaced values per tensor."""
    parts = []
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        if flat.numel() > 4096:
            flat = flat[torch.arange(4096) * (flat.numel() - 1) // 4095]
        parts += [name.encode(), flat.float().numpy().tobytes()]
    return _core.blake3(b"\0".join(parts), 16)


def load_seconds(name: str, imports_first: bool = False) -> float:
    """Seconds for kdn.models.load in a fresh interpreter (what every process pays); with
    ``imports_first``, transformers' Llama model and tokenizer code is imported before the clock
    starts (what the load costs a process that already uses transformers)."""
    warm = ("import transformers; from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, "
            "PreTrainedTokenizerFast; import transformers.core_model_loading; "
            "from transformers.models.llama import configuration_llama; ") if imports_first else ""
    code = (f"import time, kdn; {warm}t = time.perf_counter(); kdn.models.load({name!r}); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()

    model, _ = kdn.models.load(args.model)
    distinct = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    weight_bytes = sum(distinct.values())  # tied embeddings once
    first = timed(lambda: model_fingerprint(model, refresh=True), args.repeats)
    cached = timed(lambda: model_fingerprint(model), 50)
    sample = timed(lambda: sampled_fingerprint(model), args.repeats)
    gbs = weight_bytes / first / 1e9
    seven_b = 14e9 / (weight_bytes / first)
    print(f"model {args.model}: {weight_bytes / 1e6:.0f} MB of weights, {torch.get_num_threads()} threads")
    print("| identity | first call | cached call | covers |")
    print("|---|---:|---:|---|")
    print(f"| every weight byte (BLAKE3, multithreaded) | {first * 1e3:.0f} ms ({gbs:.1f} GB/s) | "
          f"{cached * 1e3:.2f} ms | all {weight_bytes / 1e6:.0f} MB |")
    print(f"| old sample (4096 values per tensor) | {sample * 1e3:.0f} ms | - | a sample |")
    print(f"7B model in fp16 (14 GB) at this rate: {seven_b:.1f} s once per model object")

    blob = os.urandom(64 << 20)
    key = os.urandom(32)
    xxh = timed(lambda: _core.xxh64(blob), args.repeats)
    mac = timed(lambda: _core.blake3(blob, 32, key=key), args.repeats)
    print(f"\nper-blob integrity on 64 MiB, one core: XXH64 checksum {len(blob) / xxh / 1e9:.2f} GB/s, "
          f"keyed BLAKE3 tag (secret=) {len(blob) / mac / 1e9:.2f} GB/s")

    loads = {}
    if args.model.startswith("smollm2"):
        from kdn.models.smollm2 import converted_dir, gguf_path

        cached_dir = converted_dir(gguf_path())
        moved = cached_dir.with_name(cached_dir.name + ".bench-moved")
        if cached_dir.exists():
            cached_dir.rename(moved)
        try:
            loads["gguf (first load, converts and caches)"] = load_seconds(args.model)
        finally:
            if moved.exists():
                import shutil

                shutil.rmtree(cached_dir, ignore_errors=True)
                moved.rename(cached_dir)
        loads["cached safetensors (every later load)"] = min(load_seconds(args.model) for _ in range(3))
        loads["cached safetensors, transformers already imported"] = min(load_seconds(args.model, True)
                                                                         for _ in range(3))
        print("\n| SmolLM2 load in a new process | seconds |")
        print("|---|---:|")
        for what, s in loads.items():
            print(f"| {what} | {s:.2f} |")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "weight_bytes": weight_bytes, "fingerprint_first_s": first,
              "fingerprint_cached_s": cached, "sampled_fingerprint_s": sample, "fingerprint_gbs": gbs,
              "fingerprint_7b_fp16_s": seven_b, "xxh64_gbs": len(blob) / xxh / 1e9,
              "keyed_blake3_gbs": len(blob) / mac / 1e9, "load_s": loads, "date": time.strftime("%Y-%m-%d")}
    save_result(out / "bench_trust.json", result)
    print(f"\nwrote {out / 'bench_trust.json'}")


if __name__ == "__main__":
    main()
