"""Blending in vLLM: which requests ask for it and how their passages are named, and whether this
engine can blend. A request names its passages' token spans, ``kv_transfer_params={"kdn":
{"passages": [[start, end], ...], "recompute_ratio": 0.15}}``, or a text client's prompt carries the
separator ``blend_separator`` (kv_connector_extra_config: a string or token ids) between its
passages; the prompt is then served as :mod:`kdn.engine.passages` plans it."""

from __future__ import annotations

import dataclasses

from kdn._core import InvalidInputError
from kdn.engine.passages import DEFAULT_RATIO, check_passages, check_ratio


@dataclasses.dataclass
class Options:
    """How this engine blends: the prompt separator (token ids) if configured, what passages are
    keyed behind (BOS, as ``KDN.store_segments`` keys them), and whether vLLM's own prefix cache is
    on (then its blocks of a blended request would enter it: only a request with a ``cache_salt`` of
    its own, that no exact request shares, is blended)."""

    separator: list | None = None
    bos: list = dataclasses.field(default_factory=list)
    prefix_caching: bool = False

    @classmethod
    def of(cls, vllm_config, separator) -> Options:
        model = vllm_config.model_config
        bos = getattr(model.hf_text_config, "bos_token_id", None)
        return cls(separator_tokens(separator, str(model.model)), [bos] if isinstance(bos, int) else [],
                   bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False)))


def separator_tokens(separator, model_folder: str) -> list[int] | None:
    """``blend_separator`` as token ids: a list of ids as given, a string tokenized by the engine's
    tokenizer (no special tokens); None when no separator is configured."""
    if separator is None:
        return None
    if isinstance(separator, str) and separator:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_folder).encode(separator, add_special_tokens=False)
    elif isinstance(separator, list) and separator and all(isinstance(t, int) and t >= 0 for t in separator):
        ids = list(separator)
    else:
        raise InvalidInputError(f"kv_connector_extra_config blend_separator: a non-empty string or list of token ids, "
                                f"got {separator!r:.80}")
    if not ids:
        raise InvalidInputError(f"blend_separator {separator!r:.40} tokenizes to nothing")
    return ids


def split_at(tokens: list[int], separator: list[int]) -> list[tuple[int, int]]:
    """The passages of a prompt with ``separator`` between them: each span from just after one
    separator to the end of the next (the separator closes its passage); what follows the last
    separator is the question (computed, never blended). Empty when the separator occurs under twice.

    Example:
        >>> split_at([1, 7, 9, 5, 5, 8, 9, 6, 9, 2, 3], [9])
        [(3, 7), (7, 9)]
    """
    width, ends, i = len(separator), [], 0
    while i + width <= len(tokens):
        if tokens[i:i + width] == separator:
            ends.append(i + width)
            i += width
        else:
            i += 1
    return list(zip(ends, ends[1:]))


def asked(request, separator: list[int] | None) -> tuple | None:
    """``(spans, ratio, selection)`` of a request that asks to be blended, or None. Raises
    InvalidInputError naming what is wrong with what it asked."""
    params = getattr(request, "kv_transfer_params", None)
    kdn = params.get("kdn") if isinstance(params, dict) else None
    tokens = list(request.prompt_token_ids or [])
    kdn = kdn if isinstance(kdn, dict) else {}
    ratio, selection = check_ratio(kdn.get("recompute_ratio", DEFAULT_RATIO), kdn.get("selection", "kv"))
    if "passages" in kdn:
        return check_passages(kdn["passages"], len(tokens)), ratio, selection
    if separator is not None:
        spans = split_at(tokens, separator)
        return (spans, ratio, selection) if spans else None
    if "recompute_ratio" in kdn:
        raise InvalidInputError("recompute_ratio without passages (name them, or configure blend_separator)")
    return None
