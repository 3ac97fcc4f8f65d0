"""The model's KV layout as the engine sees it (layers, KV heads, head dim, dtype; MLA latent and a
hybrid's recurrent layers), read from no model library: a face reads it from its model
(:func:`kdn.layout.layout_of` for transformers, :func:`kdn.layout.layout_from_config` for a serving
engine's config) and hands it to the engine."""

from __future__ import annotations

import dataclasses

import torch

from kdn import _core
from kdn._core import InvalidInputError

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    """kdn's name of a KV dtype (``"float32"``, ``"float16"``, ``"bfloat16"``); InvalidInputError for another."""
    if dtype not in DTYPES:
        raise InvalidInputError(f"model dtype {dtype} is not supported (float32, float16, bfloat16)")
    return DTYPES[dtype]


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """The KV shape of a decoder: layers, KV heads, head dim, dtype name, vocabulary size.

    ``latent``: an MLA model (DeepSeek-V2/V3, Kimi, GLM): a serving engine caches one latent vector
    per token and layer (``kv_lora_rank + qk_rope_head_dim``, 576 for DeepSeek), stored once, its
    first half as the "K" plane and its second as the "V" plane of one head (so every codec and copy
    that works on K and V planes works on it unchanged). HF's cache of such a model holds the same
    vector as a "key" (the normalised latent) and a "value" (the RoPE key): :func:`kdn.layout.cache_to_kv_list`
    and :func:`kdn.layout.kv_list_to_cache` join and split them, so HF and vLLM store the same bytes.

    ``recurrent``: a hybrid model's mamba or linear-attention layers, whose state is no KV: ``layers``
    and the chunks hold its attention layers alone, and the HF face keeps the recurrent layers' state
    at each prompt's last chunk boundary beside them (:mod:`kdn.integrations.hf.hybrid`).

    Example:
        >>> layout = ModelLayout(layers=30, kv_heads=3, head_dim=64, dtype="float32", vocab_size=49152)
        >>> layout.bytes_per_token()   # SmolLM2-135M: K and V of 30 layers, 3 heads of 64 floats
        46080
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int
    latent: bool = False
    recurrent: tuple = ()  # a hybrid model's recurrent layers (their indices); ``layers`` counts the others

    @property
    def torch_dtype(self) -> torch.dtype:
        return {v: k for k, v in DTYPES.items()}[self.dtype]

    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.torch_dtype.itemsize


def empty_kv_list(layout: ModelLayout, num_tokens: int) -> list[torch.Tensor]:
    """``2 * layers`` uninitialised CPU tensors ``[1, kv_heads, num_tokens, head_dim]`` (K, V per layer).

    They are views of one pooled kdn host buffer, so a retrieve writes into warm pages instead
    of faulting in fresh ones (the largest cost of a copy into new memory; see buffer_pool.h).
    """
    shape = (2 * layout.layers, 1, layout.kv_heads, num_tokens, layout.head_dim)
    nbytes = layout.bytes_per_token() * num_tokens
    flat = torch.frombuffer(_core.host_array(nbytes), dtype=layout.torch_dtype)
    return list(flat.view(shape).unbind(0))
