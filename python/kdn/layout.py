"""The transformers adapter: a model's KV layout read from its config, and conversions between HF
caches and kdn's per-layer KV lists (the engine, :mod:`kdn.engine.layout`, reads no model library)."""

from __future__ import annotations

import re

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kdn._core import InvalidInputError
from kdn.engine.layout import DTYPES, ModelLayout, dtype_name

# transformers 5.24 renamed forward's and generate's ``past_key_values`` (argument and output field) to
# ``cache``; the old name warns until its removal (5.40). kdn speaks the installed version's name.
_MAJOR_MINOR = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2])
CACHE_ARG = "cache" if _MAJOR_MINOR >= (5, 24) else "past_key_values"

def layout_of(model: torch.nn.Module) -> ModelLayout:
    """The KV layout of a live transformers ``model`` (:func:`layout_from_config` of its config and
    parameters' dtype); an MLA model is refused by name where this transformers caches K and V per head.

    Example:
        >>> layout_of(model) == layout_from_config(model.config, next(model.parameters()).dtype)
        True
    """
    layout = layout_from_config(model.config, next(model.parameters()).dtype)
    if layout.latent and not all(hasattr(m, "expand_kv") for m in model.modules() if hasattr(m, "kv_b_proj")):
        raise InvalidInputError(f"this transformers ({transformers.__version__}) caches an MLA model's K and V "
                                "per head; kdn stores the latent vector, which transformers >= 5.15 caches")
    return layout


def layout_from_config(config, dtype: torch.dtype) -> ModelLayout:
    """The layout of a model of HF ``config`` run in ``dtype`` (what a serving engine knows); a model
    with recurrent layers (:func:`recurrent_layers`) is a hybrid one (:attr:`ModelLayout.recurrent`) where
    HF's cache keeps their state beside attention layers, and refused by name otherwise."""
    config = config.get_text_config()
    states = ()
    if recurrent := recurrent_layers(config):
        states = _state_layers(config)
        if states is None or getattr(config, "model_type", None) not in RESUMING_HYBRIDS:
            raise InvalidInputError(
                f"{type(config).__name__} has {', '.join(recurrent)} layers (a hybrid or recurrent model): kdn "
                f"serves the hybrid models whose recurrent state it reads and HF resumes exactly "
                f"({', '.join(RESUMING_HYBRIDS)}; docs/models.md), not this one")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    name = dtype_name(dtype)
    rank = getattr(config, "kv_lora_rank", None)
    if rank:  # MLA: one latent vector (and its RoPE key) per token, split in two planes of one head
        width = rank + config.qk_rope_head_dim
        if width % 2:
            raise InvalidInputError(f"an MLA latent of {width} values (odd) is not supported")
        return ModelLayout(layers=config.num_hidden_layers, kv_heads=1, head_dim=width // 2, dtype=name,
                           vocab_size=config.vocab_size, latent=True)
    return ModelLayout(layers=config.num_hidden_layers - len(states),
                       kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                       dtype=name, vocab_size=config.vocab_size, recurrent=states)


def describe_checkpoint(folder, dtype: torch.dtype, config=None) -> tuple[ModelLayout, bytes]:
    """The layout and fingerprint (:func:`kdn.keys.checkpoint_fingerprint`) of the HF checkpoint in
    ``folder`` run in ``dtype``, its ``config`` read from the folder when not given: what
    :meth:`kdn.engine.Engine.for_checkpoint` asks of a serving engine's model on first use."""
    from transformers import AutoConfig

    from kdn.keys import checkpoint_fingerprint

    config = AutoConfig.from_pretrained(folder) if config is None else config
    return layout_from_config(config, dtype), checkpoint_fingerprint(folder, dtype)


def full_kv(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The KV of one forward of ``model`` over ``ids`` (``[1, n]``), on the CPU, as kdn lists it
    (:func:`cache_to_kv_list`): the reference a stored chunk is compared with."""
    with torch.inference_mode():
        return [t.cpu() for t in cache_to_kv_list(prefill_cache(model, ids.to(next(model.parameters()).device)))]


def cache_arg(cache) -> dict:
    """The keyword arguments that hand ``cache`` to a model's forward or generate (none for None)."""
    return {} if cache is None else {CACHE_ARG: cache}


def output_cache(out):
    """The cache a forward's or generate's output carries (None when it has none)."""
    return getattr(out, CACHE_ARG, None)


def prefill_cache(model, ids: torch.Tensor, **kwargs):
    """The cache of one forward over ``ids`` when only its KV is wanted: the logits of the last
    position alone are computed (every position's is a vocabulary-wide row: 1.2 GB of fp32 for 2K
    tokens of Qwen2.5's 151,936-token vocabulary, and the output head's multiply-adds)."""
    if CACHE_ARG not in kwargs and "past_key_values" not in kwargs:
        kwargs.update(cache_arg(full_cache(model)))
    return output_cache(model(ids, use_cache=True, logits_to_keep=1, **kwargs))


def cache_to_kv_list(cache) -> list[torch.Tensor]:
    """Flatten a DynamicCache (or legacy tuple of (k, v), or this function's own flat list) into
    [k0, v0, k1, v1, ...].

    Each tensor is [batch, kv_heads, seq, head_dim] as HF stores it.
    """
    if hasattr(cache, "layers"):  # a hybrid model's recurrent layers hold no KV: its attention layers', as stored
        pairs = [(layer.keys, layer.values) for layer in cache.layers if type(layer).__name__ != RECURRENT_CACHE_LAYER]
    elif isinstance(cache, (tuple, list)) and cache and all(isinstance(t, torch.Tensor) for t in cache):
        if len(cache) % 2:
            raise InvalidInputError(f"past_key_values as a flat list holds [k0, v0, k1, v1, ...]: an even number "
                                    f"of tensors, got {len(cache)}")
        pairs = list(zip(cache[0::2], cache[1::2]))
    elif isinstance(cache, (tuple, list)):
        if not all(isinstance(kv, (tuple, list)) and len(kv) >= 2 for kv in cache):
            raise InvalidInputError("past_key_values as a tuple holds one (k, v) pair per layer")
        pairs = [(kv[0], kv[1]) for kv in cache]
    else:
        raise InvalidInputError(
            f"past_key_values must be a DynamicCache or tuple of (k, v), got {type(cache).__name__}"
        )
    out = []
    for i, (k, v) in enumerate(pairs):
        if k is None or v is None:
            raise InvalidInputError(f"past_key_values layer {i} is empty")
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidInputError(f"past_key_values layer {i} {name} must be a torch tensor, got "
                                        f"{type(t).__name__}")
            if t.device.type == "meta":
                raise InvalidInputError(f"past_key_values layer {i} {name} is on the meta device (no data)")
        if k.shape[-1] != v.shape[-1]:  # an MLA layer (latent, RoPE key): kdn's two halves of the vector
            joined = torch.cat([k.detach(), v.detach()], -1)
            half = joined.shape[-1] // 2
            out += [joined[..., :half], joined[..., half:]]
        else:
            out += [k.detach(), v.detach()]
    return out


RECURRENT_WORDS = ("mamba", "linear", "conv", "ssm", "recurrent", "rwkv", "delta", "gdn", "hybrid")

# Hybrid models (``model_type``) whose HF forward resumes a prefill from a cached state exactly: a
# prefill in two pieces gives one pass's logits (tests/test_model_families.py checks each). Jamba's
# does not in transformers 5.24 (its full-sequence scan is given no initial state): refused, as is
# Falcon-H1's, whose layers run mamba and attention side by side in one cache layer.
RESUMING_HYBRIDS = ("granitemoehybrid", "qwen3_next")
RECURRENT_CACHE_LAYER = "LinearAttentionLayer"  # HF's cache layer of a recurrent layer: conv and SSM states


def recurrent_layers(config) -> list[str]:
    """The layer types of an HF text ``config`` that keep a recurrent state instead of attention KV
    (mamba, linear attention, short convolutions: Jamba, Qwen3-Next, Granite-4-H, Mamba; Falcon-H1's
    "hybrid" layers, mamba beside attention in each), as its ``layer_types`` (or Jamba's
    ``layers_block_type``) name them; a model with a state-space size and no such layer type is named
    by its ``model_type``. Empty for attention-only models."""
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or ()
    found = sorted({str(t) for t in types if any(w in str(t).lower() for w in RECURRENT_WORDS)})
    if not found and any(hasattr(config, a) for a in ("ssm_state_size", "mamba_d_state", "state_size")):
        found = [str(getattr(config, "model_type", "") or type(config).__name__)]
    return found


def _state_layers(config) -> tuple | None:
    """The indices of the layers whose HF cache layer keeps a recurrent state (conv and SSM states: a
    ``LinearAttentionLayer``) in a model of ``config`` with plain attention layers beside them; None
    when its cache has other layer kinds or no attention layer."""
    try:
        kinds = [type(layer).__name__ for layer in DynamicCache(config=config).layers]
    except Exception:  # a config HF's cache cannot lay out
        return None
    states = tuple(i for i, kind in enumerate(kinds) if kind == RECURRENT_CACHE_LAYER)
    plain = [i for i, kind in enumerate(kinds) if kind == "DynamicLayer"]
    if not states or not plain or len(states) + len(plain) != config.num_hidden_layers:
        return None
    return states


def latent_rank(config) -> int | None:
    """An MLA model's latent width (``kv_lora_rank``: what HF caches as its "keys"), or None."""
    return getattr(config.get_text_config(), "kv_lora_rank", None) or None


def check_kv_matches(layout: ModelLayout, kv: list[torch.Tensor], num_tokens: int) -> None:
    """Raise InvalidInputError unless ``kv`` is a batch-1 cache of this model holding num_tokens."""
    if len(kv) != 2 * layout.layers:
        raise InvalidInputError(
            f"cache has {len(kv) // 2} layers but the model has {layout.layers}: is it from a different model?"
        )
    want = (layout.kv_heads, layout.head_dim)
    for i, t in enumerate(kv):
        if t.dim() != 4 or t.shape[0] != 1 or (t.shape[1], t.shape[3]) != want:
            raise InvalidInputError(
                f"cache layer {i // 2} has shape {tuple(t.shape)}, expected [1, {want[0]}, seq, {want[1]}]: "
                "is it from a different model (or a batch larger than 1)?"
            )
        if DTYPES.get(t.dtype) != layout.dtype:
            raise InvalidInputError(f"cache dtype {t.dtype} differs from the model dtype {layout.dtype}")
        if t.shape[2] < num_tokens:
            raise InvalidInputError(f"cache holds {t.shape[2]} tokens but {num_tokens} token ids were given")


def windowed(config) -> bool:
    """Whether a model of HF ``config`` has sliding-window layers (Mistral-style, or Gemma's
    alternating sliding and full layers), whose HF cache keeps only each window's last tokens (a
    hybrid's recurrent layers are not windows)."""
    cache = DynamicCache(config=config)
    return any(type(layer) is not DynamicLayer and type(layer).__name__ != RECURRENT_CACHE_LAYER
               for layer in cache.layers)


def full_cache(model: torch.nn.Module) -> DynamicCache | None:
    """A cache that keeps every token of every layer, for a model with sliding-window layers (None
    for another model: its own cache does). The model still attends within each layer's window (its
    masks come from its config, not from the cache): what kdn stores is then the prompt's KV at
    every position, as a later hit that ends anywhere needs it."""
    return DynamicCache() if windowed(model.config) else None


def check_length(cache, length: int, what: str) -> None:
    """Raise :class:`kdn.compat.UnvouchedError` unless every layer of the HF ``cache`` that counts
    tokens, and the cache itself (what ``generate`` derives positions from), says ``length``: a
    structural check that a release changing how a cache counts (transformers 5.25's state layers)
    cannot pass."""
    from kdn.compat import UnvouchedError

    counts = [int(layer.get_seq_length()) for layer in cache.layers if hasattr(layer, "get_seq_length")]
    whole = int(cache.get_seq_length())
    if whole != length or any(n != length for n in counts):
        raise UnvouchedError(f"{what} holds {length} tokens, but transformers {transformers.__version__} counts "
                             f"{whole} (its layers: {counts}): kdn does not know this release's cache bookkeeping")


def kv_list_to_cache(model: torch.nn.Module, kv: list[torch.Tensor]) -> DynamicCache:
    """Build a DynamicCache for ``model`` that holds the tensors of ``kv`` without copying them
    (every layer a plain one for a model with sliding windows: :func:`full_cache`; an MLA model's
    vectors are split back into HF's latent and RoPE key, a copy)."""
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(kv) // 2 or any(type(layer) is not DynamicLayer for layer in cache.layers):
        cache = DynamicCache()  # every layer a plain one (sliding windows: see full_cache)
    rank = latent_rank(model.config)
    for i in range(len(kv) // 2):
        k, v = kv[2 * i], kv[2 * i + 1]
        if rank is not None:  # an MLA layer: the vector split back into HF's latent and RoPE key (a copy)
            joined = torch.cat([k, v], -1)
            k, v = joined[..., :rank], joined[..., rank:]
        if i < len(cache.layers) and type(cache.layers[i]) is DynamicLayer:
            layer = cache.layers[i]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:  # sliding-window and other layer kinds keep their own bookkeeping
            cache.update(k, v, i)
    return cache
