"""RoPE facts of a model for re-rotating cached keys: inverse frequencies, convention, refusals."""

from __future__ import annotations

import torch

from kdn import _core
from kdn._core import InvalidInputError

# rope types whose frequencies do not depend on the sequence length: re-rotation is exact
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(InvalidInputError):
    """The model cannot be blended; the message names the architecture and what is missing."""


def rope_parameters(model) -> dict:
    config = model.config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


def inv_freq(model) -> torch.Tensor:
    """The model's own RoPE inverse frequencies (CPU float32, head_dim/2), after checking its scaling."""
    arch = type(model).__name__
    rope_type = rope_parameters(model).get("rope_type", rope_parameters(model).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: RoPE scaling '{rope_type}' is not supported for blending (frequencies that change with "
            f"the sequence length cannot be re-rotated exactly); supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise UnsupportedModelError(f"{arch}: no model.model.rotary_emb.inv_freq (a shared rotary embedding)")
    return rotary.inv_freq.detach().to("cpu", torch.float32).contiguous()


def shift_keys(model, kv: list[torch.Tensor], delta: int) -> None:
    """Move the keys of a per-layer KV list (``[k0, v0, k1, v1, ...]``) by ``delta`` positions, in place.

    Example:
        >>> from kdn.layout import cache_to_kv_list
        >>> kv = cache_to_kv_list(model(ids, use_cache=True).past_key_values)
        >>> shift_keys(model, kv, 100)    # keys computed at positions p now sit at p + 100
        >>> moved = model(ids, position_ids=torch.arange(100, 100 + ids.shape[1])[None], use_cache=True)
        >>> torch.allclose(kv[0], cache_to_kv_list(moved.past_key_values)[0], atol=1e-5)
        True
    """
    if delta:
        stream = torch.cuda.current_stream().cuda_stream if kv[0].is_cuda else 0
        _core.rope_shift(kv[0::2], inv_freq(model), int(delta), "rotate_half", stream)
