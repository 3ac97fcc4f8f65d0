"""The README's headline comparisons, one command each: every configuration of a comparison runs in
one run of its benchmark (interleaved where the benchmark can), and the record lands in the results
folder the README quotes, holding the commit, command, versions, CPU and the load average.

    python benchmarks/headline.py --list        # the comparisons and the commands they run
    python benchmarks/headline.py vllm          # one comparison (run from anywhere)
    python benchmarks/headline.py vllm serving-32 --dry-run

Long ones (hours on 2 cores) say so in their description; run them in the background. Each comparison
waits for a quiet machine first (the 1-minute load average at most ``--max-load``, default 0.75 per
core) and refuses to start if it stays busy: two timed runs on 2 cores oversubscribe each other's
threads, and each would time both.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = "results"  # relative to benchmarks/, where every command runs

# LMCache at its defaults is left out of the serving runs: its 4K hit takes 3.4 s here (the ``vllm``
# comparison measures it), which would make it most of each run; its tuned rows are the peer.
SERVING = ["bench_serving.py", "--concurrency", "4", "--questions", "4"]
PEERS = "vllm-prefix,kdn-disk,lmcache-tuned,lmcache-tuned-fs"

COMPARISONS: dict[str, tuple[str, list[str]]] = {
    "ttft": ("a kdn memory hit vs a full prefill (SmolLM2, 1K-7K tokens and a question, alternating) and "
             "retrieve vs a clone of its bytes",
             ["bench_ttft.py", "--lengths", "1024,2048,4096,7168", "--repeats", "3", "--out", f"{RESULTS}/ttft"]),
    "ttft-qwen15": ("the same on Qwen2.5-Coder-1.5B at 8K tokens and a 30-token question (~15 min)",
                    ["bench_ttft.py", "--model", "qwen2.5-coder-1.5b", "--lengths", "8192", "--repeats", "3",
                     "--out", f"{RESULTS}/ttft/qwen15"]),
    "tiers": ("the memory and disk tiers against numpy copies, torch.save and safetensors; eviction policies",
              ["bench_tiers.py", "--repeats", "7", "--out", f"{RESULTS}/tiers"]),
    "vllm": ("a 4K-token hit in a new vLLM engine: vLLM alone, vLLM's prefix cache, kdn memory / disk / Redis / "
             "Mooncake, LMCache defaults / tuned / fs (SmolLM2 fp32, 3 interleaved rounds; ~25 min)",
             ["bench_vllm.py", "--docs", "2", "--questions", "4", "--tokens", "4000", "--repeats", "3",
              "--out", f"{RESULTS}/vllm/peers"]),
    "vllm-bf16": ("the same with every engine in bf16 (half the KV bytes)",
                  ["bench_vllm.py", "--docs", "2", "--questions", "4", "--tokens", "4000", "--repeats", "3",
                   "--dtype", "bfloat16", "--out", f"{RESULTS}/vllm/peers-bf16"]),
    "serving-32": ("serving docqa, 32 documents x 4 questions, 4 clients: vLLM alone (sampled), its prefix cache, "
                   "kdn disk (and alone again, 3 times: --replay prices a hit), LMCache tuned in L1 / with fs L2 "
                   "(~45 min)",
                   [*SERVING, "--replay", "--configs", f"vllm,{PEERS}", "--docs", "32", "--workloads", "docqa",
                    "--vllm-sample", "12",
                    "--out", f"{RESULTS}/serving/peers-32"]),
    "serving-128": ("the same at 128 documents, LMCache with its fs L2 only: its L1 alone (kdn's memory tier's "
                    "size) holds 8 of the 128 documents and would repeat the prefix cache's hour (~2 h)",
                    [*SERVING, "--replay", "--configs", "vllm,vllm-prefix,kdn-disk,lmcache-tuned-fs", "--docs", "128",
                     "--workloads", "docqa",
                     "--vllm-sample", "12",
                     "--out", f"{RESULTS}/serving/peers-128"]),
    "serving-bf16": ("serving docqa at 32 documents with every engine in bf16 (half the bytes a store moves): "
                     "vLLM alone (sampled), its prefix cache, kdn disk and its replays (~65 min)",
                     [*SERVING, "--replay", "--configs", "vllm,vllm-prefix,kdn-disk", "--docs", "32",
                      "--workloads", "docqa", "--vllm-sample", "12", "--dtype", "bfloat16",
                      "--out", f"{RESULTS}/serving/bf16"]),
    "hits-first": ("hits not held behind misses: kdn with priority for likely hits, alone and with vLLM's "
                   "per-prefill cap at 64 / 128 / 256 tokens, and vLLM alone at each cap (~40 min)",
                   [*SERVING, "--replay", "--configs", "vllm,vllm+lp64,vllm+lp128,vllm+lp256,kdn-disk+prio,"
                    "kdn-disk+lp64+prio,kdn-disk+lp128+prio,kdn-disk+lp256+prio", "--docs", "32",
                    "--workloads", "docqa", "--vllm-sample", "12", "--out", f"{RESULTS}/serving/hits-first"]),
    "chat-32": ("serving chat, 32 sessions x 4 rounds, 4 clients: vLLM's prefix cache, kdn disk, LMCache tuned "
                "in L1 / with fs L2 (~30 min)",
                [*SERVING, "--configs", PEERS, "--workloads", "chat", "--sessions", "32",
                 "--out", f"{RESULTS}/serving/peers-chat"]),
    "fleet": ("two engines behind a router that knows nothing of caches (round-robin) and behind a document-"
              "affinity router: vLLM alone, vLLM's prefix cache, kdn with one node tier (~35 min)",
              ["bench_serving.py", "--docs", "8,16", "--questions", "4", "--tokens", "1000", "--concurrency", "4",
               "--workloads", "docqa", "--configs",
               "vllm+x2,vllm-prefix+x2,vllm-prefix+x2+aff,kdn-node+x2,kdn-node+x2+aff", "--out", f"{RESULTS}/fleet"]),
    "codecs": ("codec size against quality (KL, greedy agreement) and speed, kvtc calibrated on disjoint contexts",
               ["bench_codecs.py", "--kvtc-ratios", "6,8,10,12,16", "--out", f"{RESULTS}/codecs"]),
    "blend": ("blending passages cached separately: selective recompute against full prefill (MuSiQue, 30 questions)",
              ["bench_blend.py", "--questions", "30", "--ratios", "0.15", "--out", f"{RESULTS}/blend"]),
    "editing": ("KV edited at deposit (kvzip keeps x codecs): bytes stored against answers",
                ["bench_editing.py", "--keeps", "1,0.5,0.3,0.2", "--codecs", "raw,int4",
                 "--out", f"{RESULTS}/editing"]),
    "verify": ("what verified reuse costs: a hit unchecked and checked (verify_fraction=1), interleaved",
               ["bench_verify.py", "--tokens", "2000", "--hits", "8", "--out", f"{RESULTS}/verify"]),
    "miss": ("what a miss costs: kdn's lookup and store beside a plain HF prefill",
             ["bench_miss.py", "--sizes", "1000,3000,8000", "--repeats", "5", "--out", f"{RESULTS}/miss"]),
}


class BusyMachine(RuntimeError):
    """The machine stayed busier than a timing run allows."""


def wait_for_quiet(max_load: float, wait_s: float, load=lambda: os.getloadavg()[0], sleep=time.sleep,
                   poll_s: float = 10.0) -> float:
    """Block until the 1-minute load average is at most ``max_load``; returns it. Raises
    :class:`BusyMachine` after ``wait_s`` seconds above it."""
    waited = 0.0
    while (now := load()) > max_load:
        if waited >= wait_s:
            raise BusyMachine(f"load average {now:.2f} > {max_load:.2f} after {waited:.0f} s: another process is "
                              "using the CPU, and a timing beside it measures both (--max-load, --force)")
        if not waited:
            print(f"headline: load {now:.2f} > {max_load:.2f}, waiting up to {wait_s:.0f} s for a quiet machine",
                  flush=True)
        sleep(poll_s)
        waited += poll_s
    return now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="comparisons to run (--list names them)")
    parser.add_argument("--list", action="store_true", help="print the comparisons and their commands")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    parser.add_argument("--max-load", type=float, default=0.75 * (os.cpu_count() or 1),
                        help="start a comparison only when the 1-minute load average is at most this")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for that before refusing")
    parser.add_argument("--force", action="store_true", help="run whatever the load")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in COMPARISONS]
    if unknown:
        parser.error(f"unknown comparison(s) {unknown}; known: {', '.join(COMPARISONS)}")
    if args.list or not args.names:
        for name, (what, argv) in COMPARISONS.items():
            print(f"{name:12s} {what}\n{'':12s} cd benchmarks && python {shlex.join(argv)}")
        return
    for name in args.names:
        argv = [sys.executable, *COMPARISONS[name][1]]
        print(f"headline {name}: cd benchmarks && {shlex.join(argv)}", flush=True)
        if args.dry_run:
            continue
        if not args.force:
            try:
                wait_for_quiet(args.max_load, args.wait)
            except BusyMachine as e:
                sys.exit(f"headline {name}: {e}")
        subprocess.run(argv, cwd=HERE, check=True)


if __name__ == "__main__":
    main()
