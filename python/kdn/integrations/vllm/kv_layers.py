"""vLLM's KV layers as kdn reads them: a layer's index from its name, the CPU attention kernel whose
blocks they are, and what the KV cache groups (vLLM's hybrid KV cache manager) mean: each layer's
block table, and the sliding window below which a windowed layer's blocks are given back."""

from __future__ import annotations

import dataclasses
import re

from kdn.engine.layout import ModelLayout

SERVED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """``specs``: each group's KV cache spec class name; ``layers``: layer name -> its group;
    ``window``: the smallest sliding window of a group, in tokens (None: no windowed group);
    ``kinds``: each group's ``(kind, sliding window)`` as vLLM's own KV events name them (empty where
    this vLLM's events name no group)."""

    specs: tuple = ("FullAttentionSpec",)
    layers: dict = dataclasses.field(default_factory=dict)
    window: int | None = None
    kinds: tuple = ()

    @classmethod
    def of(cls, kv_cache_config) -> KVGroups:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if not groups:
            return cls()
        specs = tuple(type(g.kv_cache_spec).__name__ for g in groups)
        windows = [g.kv_cache_spec.sliding_window for g, spec in zip(groups, specs) if spec == "SlidingWindowSpec"]
        layers = {name: i for i, g in enumerate(groups) for name in getattr(g, "layer_names", ())}
        return cls(specs, layers, min(windows) if windows else None, _event_kinds(groups))

    @property
    def windowed(self) -> bool:
        """Whether some layers keep only a window: their blocks come one table per group, with vLLM's
        null block outside the window, and a load that fails is recomputed whole."""
        return self.window is not None

    def table_of(self, layer_names: list[str]) -> tuple | None:
        """Each of ``layer_names``' group (in that order), or None when every layer shares one table
        that keeps every position (what kdn's paged copies take without groups)."""
        if len(self.specs) == 1 and not self.windowed:
            return None
        return tuple(self.layers[name] for name in layer_names)

    def kept_from(self, computed: int, block_size: int) -> int:
        """The first position a windowed layer still holds in a step that starts with ``computed``
        tokens computed (vLLM frees the blocks wholly before ``computed - window + 1``); 0 when none is
        windowed."""
        if self.window is None:
            return 0
        return max(0, computed - self.window + 1) // block_size * block_size


def _event_kinds(groups: list) -> tuple:
    """Each group's ``(kind, sliding window)`` by vLLM's own naming (``get_kv_cache_spec_kind``), as its
    offloading tiers announce a group's blocks; empty for a vLLM without group kinds."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:
        return ()
    return tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                 for g in groups)


def layer_index(name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else 0


def cpu_attention_isa(vllm_config, layout: ModelLayout) -> str:
    """The CPU attention kernel vLLM picks for this engine ('vec', 'vec16', 'amx', 'neon', ...)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # not vLLM's CPU build
        return "unknown (not vLLM's CPU backend)"
    return _get_attn_isa(vllm_config.model_config.dtype, vllm_config.cache_config.block_size, layout.head_dim,
                         vllm_config.cache_config.cache_dtype)
