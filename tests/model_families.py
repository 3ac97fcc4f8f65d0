"""Small random-weight checkpoints of the model families beyond plain full attention (issue 63),
saved with SmolLM2's tokenizer so a vLLM engine can serve them: greedy tokens must equal vLLM
alone's whatever the weights, and the weights are scaled up until those tokens vary."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def gemma3_config(window: int = 128) -> transformers.PretrainedConfig:
    """Gemma 3's text model, small: five sliding layers (``window`` tokens) to one full, twice."""
    return transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=window, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def mistral_config(window: int = 128) -> transformers.PretrainedConfig:
    """Mistral's attention, every layer windowed (``window`` tokens), small."""
    return transformers.MistralConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=window, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama_config(kv_heads: int = 4) -> transformers.PretrainedConfig:
    """Llama's attention with ``kv_heads`` KV heads (grouped-query: 8 query heads), small: a model a
    tensor-parallel engine splits by heads (two ranks: two KV heads each)."""
    return transformers.LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)


def save_random(config, tokenizer_folder, folder, scale: float = 4.0, seed: int = 0) -> str:
    """A random-weight model of ``config`` (its linear weights ``scale`` times the initializer's, so
    that greedy decoding does not repeat one token) saved in fp32 to ``folder`` beside the tokenizer
    files of ``tokenizer_folder``; the folder's path."""
    model = random_model(config, scale, seed)
    folder = Path(folder)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_folder) / name).exists():
            shutil.copy(Path(tokenizer_folder) / name, folder / name)
    return str(folder)


def random_model(config, scale: float = 4.0, seed: int = 0) -> torch.nn.Module:
    """A random-weight fp32 model of ``config``, its linear weights ``scale`` times the initializer's."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(scale)
    return model


def qwen3_next_config() -> transformers.PretrainedConfig:
    """Qwen3-Next's layout, small: gated delta-net (linear attention) layers beside full attention, MoE."""
    return transformers.Qwen3NextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def deepseek_v2_config() -> transformers.PretrainedConfig:
    """DeepSeek-V2's attention (MLA: a 512-dim latent and a 64-dim RoPE key per token, the only head
    size vLLM's MLA kernels take), small everywhere else; dense MLPs."""
    return transformers.DeepseekV2Config(
        vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def granite_hybrid_config() -> transformers.PretrainedConfig:
    """Granite-4-H's layout, small: mamba2 layers beside attention layers (a hybrid: recurrent state
    and KV), dense MLPs."""
    return transformers.GraniteMoeHybridConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, shared_intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=0, num_experts_per_tok=0,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8, mamba_d_head=32,
        mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=256,
        position_embedding_type="rope", max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
