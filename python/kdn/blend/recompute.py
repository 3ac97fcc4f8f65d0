"""CacheBlend's selective recompute for HF Llama-family models: their modules as the
:class:`kdn.engine.recompute.LayerStack` that :mod:`kdn.engine.recompute` selects and recomputes
over (the rules, ``selection`` and ``ratio``, are described there)."""

from __future__ import annotations

import torch

from kdn.engine.recompute import SELECTIONS, missing_parts
from kdn.engine.recompute import selective_prefill as _recompute
from kdn.rope import UnsupportedModelError, inv_freq, shift_keys

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")


def check_supported(model) -> None:
    """Raise UnsupportedModelError naming the architecture and what is missing."""
    arch = type(model).__name__
    missing = missing_parts(model, ("embed_tokens", "layers", "norm", "rotary_emb"), _LAYER_PARTS, _ATTN_PARTS)
    if arch not in SUPPORTED or missing:
        reasons = ([] if arch in SUPPORTED else [f"architecture not in {', '.join(SUPPORTED)}"]) + missing
        raise UnsupportedModelError(f"{arch} cannot be blended: " + "; ".join(reasons))
    inv_freq(model)  # refuses unsupported RoPE scaling


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class HFStack:
    """An HF Llama-family model's layers as the engine's recompute runs them (and its RoPE, that
    :mod:`kdn.engine.passages` re-rotates stored keys with)."""

    def __init__(self, model):
        check_supported(model)
        self.model, self.inner, config = model, model.model, model.config
        self.layers = len(self.inner.layers)
        self.window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        self.device = next(model.parameters()).device
        self._cos = self._sin = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_tokens(ids)
        self._cos, self._sin = self.inner.rotary_emb(h, torch.arange(ids.shape[1], device=ids.device)[None])
        return h

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` ([1, kv_heads, n, head_dim] at positions p) rotated to p + ``delta``."""
        moved = [keys.contiguous().clone()]
        shift_keys(self.model, moved, delta)
        return moved[0]

    def qkv(self, index: int, h: torch.Tensor, positions: torch.Tensor) -> tuple:
        layer = self.inner.layers[index]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (1, len(positions), -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        c, s = self._cos[:, positions][:, None], self._sin[:, positions][:, None]
        return _rotate(q, c, s), _rotate(k, c, s), v, attn.scaling

    def finish(self, index: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        layer = self.inner.layers[index]
        h = h + layer.self_attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))


@torch.inference_mode()
def selective_prefill(model, ids: torch.Tensor, kv: list[torch.Tensor], n_cached: int, ratio: float,
                      check_layer: int = 1, selection: str = "kv",
                      segments: list[tuple[int, int]] | None = None) -> tuple[list[torch.Tensor], dict]:
    """:func:`kdn.engine.recompute.selective_prefill` over an HF model's own modules: the KV of ``ids``
    ([1, n]) reusing ``kv``'s first ``n_cached`` tokens where it can (``kv`` updated in place)."""
    return _recompute(HFStack(model), ids, kv, n_cached, ratio, check_layer, selection,
                      segments)


__all__ = ["SELECTIONS", "SUPPORTED", "HFStack", "check_supported", "selective_prefill"]
