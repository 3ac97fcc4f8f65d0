"""Tiny random-weight decoders (Llama, Mistral, Qwen2) for tests: GQA and several head dims."""

from __future__ import annotations

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")


def tiny_model(arch: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               head_dim: int = 16, vocab_size: int = 128, seed: int = 0, dtype=torch.float32,
               rope_parameters: dict | None = None):
    """A randomly initialised causal LM of the given architecture, in eval mode.

    ``rope_parameters`` (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``) sets RoPE scaling;
    ``rope_theta`` 10000 is the default.

    Example:
        >>> model = tiny_model("qwen2", head_dim=32)
        >>> model.config.num_key_value_heads
        2
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    }
    if arch not in classes:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    config_cls, model_cls, extra = classes[arch]
    if rope_parameters is not None:
        extra = {**extra, "rope_parameters": {"rope_theta": 10000.0, **rope_parameters}}
    config = config_cls(
        hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab_size,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # larger-than-default weights so logits differ clearly between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model.to(dtype).eval()
