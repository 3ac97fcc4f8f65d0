"""A vLLM engine's own model layers as the :class:`kdn.engine.recompute.LayerStack` that blending's
selective recompute runs (:mod:`kdn.integrations.vllm.blend`): found beside the KV blocks vLLM
registers, checked module by module at first use, refused by name where kdn cannot vouch for them."""

from __future__ import annotations

import inspect

import torch

from kdn.engine.recompute import missing_parts, selective_prefill
from kdn.rope import UnsupportedModelError

# vLLM model classes whose layers compute as LlamaDecoderLayer does (Qwen2's adds q/k/v biases in qkv_proj)
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTN_PARTS = ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "scaling", "head_dim")
# RoPE whose rotations compose (R(p + d) = R(d) R(p)) as vLLM's rotary embedding computes them: YaRN's
# is refused too, since vLLM folds its magnitude scale into cos/sin (a key rotated twice is scaled twice)
ROPE_TYPES = ("default", "linear", "llama3")


def runner_model(depth: int = 8):
    """The model of the vLLM model runner that is calling (``register_kv_caches`` is called by the
    runner that holds the KV blocks and the model), or None."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            runner = frame.f_locals.get("self")
            model = getattr(runner, "model", None)
            if isinstance(model, torch.nn.Module) and hasattr(runner, "kv_caches"):
                return model
        return None
    finally:
        del frame


def unblendable(model, vllm_config) -> str | None:
    """Why kdn cannot recompute with this engine's model (None: it can)."""
    if model is None:
        return "the model runner's model was not found beside its KV blocks"
    arch = type(model).__name__
    if arch not in SUPPORTED:
        return f"{arch} is not one of {', '.join(SUPPORTED)}"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA adapters are enabled (vLLM's LoRA layers compute each request's adapter inside its forward)"
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "tensor_parallel_size", 1) > 1 or getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return "a tensor- or pipeline-parallel engine (each rank holds a share of the weights)"
    hf = vllm_config.model_config.hf_text_config
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        return "sliding-window attention"
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        return (f"RoPE scaling {kind!r} (its stored keys cannot be re-rotated exactly by the engine's rotary "
                f"embedding; blended: {', '.join(ROPE_TYPES)})")
    missing = missing_parts(model, ("embed_tokens", "layers"), _LAYER_PARTS, _ATTN_PARTS)
    if missing:
        return f"{arch}'s modules lack {', '.join(missing)}"
    return None


class VLLMStack:
    """A vLLM Llama-family model's layers as the engine's recompute runs them: its own qkv/o
    projections, norms, rotary embedding and MLP (attention itself is the recompute's: over the
    blended cache, not vLLM's paged kernel)."""

    def __init__(self, model):
        self.inner = model.model
        self.layers = len(self.inner.layers)
        self.window = None
        self.device = next(model.parameters()).device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids[0])[None]

    def qkv(self, index: int, h: torch.Tensor, positions: torch.Tensor) -> tuple:
        attn = self.inner.layers[index].self_attn
        x = self.inner.layers[index].input_layernorm(h[0])
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        return (_heads(q, attn.head_dim), _heads(k, attn.head_dim), _heads(v, attn.head_dim), attn.scaling)

    def finish(self, index: int, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        layer = self.inner.layers[index]
        out, _ = layer.self_attn.o_proj(attended[0])
        h = h + out[None]
        return h + layer.mlp(layer.post_attention_layernorm(h[0]))[None]

    def rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` ([1, kv_heads, n, head_dim], rotated at their positions p) rotated to p + ``delta``
        by the engine's own rotary embedding (RoPE's rotations compose: R(p + d) = R(d) R(p))."""
        if not delta:
            return keys
        attn = self.inner.layers[0].self_attn
        n, dim = keys.shape[2], keys.shape[3]
        flat = keys[0].transpose(0, 1).reshape(n, -1).contiguous()
        positions = torch.full((n,), int(delta), dtype=torch.long, device=keys.device)
        _, moved = attn.rotary_emb(positions, torch.zeros((n, attn.q_size), dtype=flat.dtype, device=flat.device),
                                   flat)
        return moved.view(n, -1, dim).transpose(0, 1)[None]


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[tokens, heads * head_dim] as [1, heads, tokens, head_dim]."""
    return x.view(x.shape[0], -1, head_dim).transpose(0, 1)[None]


def stack_of(model, vllm_config) -> VLLMStack:
    """The stack of ``model``; raises UnsupportedModelError naming why kdn cannot."""
    why = unblendable(model, vllm_config)
    if why:
        raise UnsupportedModelError(f"kdn cannot blend in this engine: {why}")
    return VLLMStack(model)


VOUCH_TOKENS = 32


def vouch(stack: VLLMStack, tokens, computed: list[torch.Tensor]) -> str | None:
    """Compare the KV ``stack`` computes for a prompt's first tokens with ``computed``, what the
    engine's own forward wrote into its blocks for them (HF per-layer ``[1, kv_heads, >= n,
    head_dim]``): None when they agree within the dtype's rounding, else what differs. Blending waits
    for this (once per engine): kdn reads vLLM's modules, and says so by name where a release
    computes otherwise."""
    n = min(len(tokens), VOUCH_TOKENS, computed[0].shape[2])
    ref = [t[:, :, :n].to(torch.float32) for t in computed]
    ours = [torch.zeros(t.shape, dtype=computed[0].dtype, device=stack.device) for t in ref]
    ids = torch.as_tensor([int(t) for t in tokens[:n]], device=stack.device)[None]
    selective_prefill(stack, ids, ours, 0, 1.0)
    tolerance = 1e-3 if computed[0].dtype == torch.float32 else 5e-2
    for index, (a, b) in enumerate(zip(ours, ref)):
        error = (a.to(torch.float32).cpu() - b.cpu()).abs().max().item() / max(b.abs().max().item(), 1e-6)
        if not error <= tolerance:
            side = "K" if index % 2 == 0 else "V"
            return (f"the engine's layers as kdn runs them give layer {index // 2}'s {side} {error:.2g} (relative) "
                    f"away from the engine's own forward (tolerance {tolerance:g})")
    return None
