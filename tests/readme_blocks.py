"""Runs the code blocks of README.md and the docs pages (in mkdocs.yml's order) as a reader would, top
to bottom, one page after the other: Python blocks in one namespace,
shell blocks in bash, YAML blocks through ``KDNConfig.load``. A block says what it needs in a comment
on the line above its fence: ``<!-- readme-test: skip (why) -->`` (not run here; the reason names
where it is run), ``<!-- readme-test: redis (...) -->`` (run against ``--redis URL``: every Redis
URL's host and password replaced) or ``<!-- readme-test: vllm (...) -->`` (a Python block run alone
by ``--vllm-python``, with ``/models/SmolLM2-135M-Instruct`` replaced by ``--checkpoint``).
``/var/cache/kdn`` is the disk tier the blocks above stored into (``$XDG_CACHE_HOME/kdn``).

    python tests/readme_blocks.py README.md docs/*.md --redis redis://127.0.0.1:6390   # exit 0: every block ran

``--serve`` takes the pages one at a time on stdin (tests/test_readme.py: one test per page, in order).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

MARKER = re.compile(r"<!-- readme-test: (skip|redis|vllm)\b(.*?)-->")
REDIS_URL = re.compile(r"redis://(?::[^@\s\"']*@)?[A-Za-z0-9._-]+:\d+")


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    needs: str  # "", "skip" or "redis"
    why: str


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the marker of the line above each."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = lines[i - 1] if i else ""
        marker = MARKER.search(above)
        found.append(Block(i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else "", marker.group(2).strip(" ()") if marker else ""))
        i = end + 1
    return found


def pages(root: Path) -> list[Path]:
    """The README, then the docs site's pages in the order of mkdocs.yml's nav."""
    import yaml

    site = yaml.safe_load((root / "mkdocs.yml").read_text())

    def walk(items):  # a nav item is {title: page} or {title: [items]} (a section)
        for item in items:
            value = next(iter(item.values()))
            yield from walk(value) if isinstance(value, list) else [root / site["docs_dir"] / value]

    return [root / "README.md", *walk(site["nav"])]


def runnable(block: Block, args) -> str:
    """The block's code as it runs here (URLs and paths replaced as its marker says)."""
    code = block.code
    if block.needs in ("redis", "vllm") and args.redis:
        code = REDIS_URL.sub(args.redis, code)
    if block.needs == "vllm":
        code = code.replace("/models/SmolLM2-135M-Instruct", args.checkpoint)
    if block.lang == "bash" or block.needs == "vllm":
        code = code.replace("/var/cache/kdn", str(Path(os.environ["XDG_CACHE_HOME"]) / "kdn"))
    return code


def run_page(markdown: str, args, namespace: dict) -> tuple[int, int]:
    """Run one page's blocks in ``namespace`` (the names earlier pages defined); ``(ran, skipped)``.
    A block that fails raises (the page's later blocks do not run)."""
    ran = skipped = 0
    for block in blocks(Path(markdown).read_text(encoding="utf-8")):
        where = f"{markdown}:{block.line} ({block.lang or 'text'})"
        if block.lang not in ("python", "bash", "yaml"):
            continue
        missing = {"skip": block.why, "redis": not args.redis and "no --redis",
                   "vllm": not args.vllm_python and "no --vllm-python"}.get(block.needs)
        if missing:
            print(f"--- skipped {where}: {missing}", flush=True)
            skipped += 1
            continue
        code = runnable(block, args)
        print(f"--- running {where}", flush=True)
        started = time.perf_counter()
        if block.needs == "vllm":  # alone, in the vLLM venv, with a small KV space for this machine
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
            subprocess.run([args.vllm_python, "-c", code], check=True, env=env, timeout=900)
        elif block.lang == "python":
            exec(compile(code, where, "exec"), namespace)
        elif block.lang == "bash":
            subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True)
        else:
            from kdn import KDNConfig

            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                f.write(code)
            print(KDNConfig.load(f.name))
            os.unlink(f.name)
        print(f"--- ok {where} in {time.perf_counter() - started:.1f} s", flush=True)
        ran += 1
    return ran, skipped


PAGE_DONE = "--- page done:"  # what --serve prints after each page: "ok RAN SKIPPED" or "failed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("markdown", nargs="*", help="the pages, in the order a reader reads them")
    parser.add_argument("--serve", action="store_true",
                        help="read page paths from stdin, one a line, and run each as it comes (one namespace), "
                             f"printing '{PAGE_DONE} ok RAN SKIPPED' or '{PAGE_DONE} failed' after each")
    parser.add_argument("--redis", help="a Redis URL for the blocks marked redis (else they are skipped)")
    parser.add_argument("--vllm-python", help="the vLLM venv's python for the blocks marked vllm (else skipped)")
    parser.add_argument("--checkpoint", help="an HF checkpoint folder of SmolLM2-135M-Instruct (with --vllm-python)")
    args = parser.parse_args()
    namespace: dict = {"__name__": "__readme__"}
    if args.serve:
        for line in sys.stdin:
            try:
                ran, skipped = run_page(line.strip(), args, namespace)
                print(f"{PAGE_DONE} ok {ran} {skipped}", flush=True)
            except (Exception, SystemExit):  # a block's failure is the page's verdict; the next page still runs
                traceback.print_exc(file=sys.stdout)
                print(f"{PAGE_DONE} failed", flush=True)
        return 0
    ran = skipped = 0
    for markdown in args.markdown:
        counts = run_page(markdown, args, namespace)
        ran, skipped = ran + counts[0], skipped + counts[1]
    print(f"README and docs blocks: {ran} ran, {skipped} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
