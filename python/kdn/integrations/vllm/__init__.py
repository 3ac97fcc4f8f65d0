"""kdn as a vLLM KV connector: engines look up, load and store prompt KV through kdn's tiers.

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model="/models/SmolLM2-135M-Instruct", dtype="float32", enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KDNConnector", kv_connector_module_path="kdn.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"disk_dir": "/var/cache/kdn"},
                  kv_load_failure_policy="recompute"))

``kv_connector_extra_config`` holds :class:`kdn.KDNConfig` settings (an unknown one stops the engine
at start-up with kdn's "did you mean"). The scheduler asks kdn how many leading prompt tokens it
holds (token-granular, never the last prompt token); the worker loads them into vLLM's paged
blocks before the forward that needs them and, once a prompt's prefill is done, copies its KV out
of the blocks and stores it from a background thread. Keys come from the checkpoint's files
(:func:`kdn.keys.checkpoint_fingerprint`), so an HF process serving the same checkpoint in the same
dtype shares hits with the engine both ways. A chunk that cannot be loaded is reported to vLLM,
which recomputes its blocks: never wrong KV. What is stored follows one rule
(:mod:`kdn.engine.served`): a prompt is stored from the blocks of the step that completed its
prefill, and only when that step's loads are known to have succeeded and nothing it was served was
lossy; after a failed load vLLM recomputes the request, and the recomputed prompt is stored then.
With ``verify_fraction`` a sampled hit's last tokens are held back, computed by vLLM and compared
with what kdn stores (:mod:`kdn.engine.verify`). Sliding-window models (Gemma, Mistral-style, every
layer or some) are served in vLLM's hybrid KV cache manager (a block table per KV cache group): a
hit lays a sliding layer's KV over its window only; a windowed prefill is stored chunk by chunk, in
the step that completes each, while its blocks hold it; its hits load before the request is
scheduled, and one that fails is recomputed whole. MLA models (their latent, on GPU MLA backends)
are served; a model kdn cannot serve (MLA on vLLM's CPU platform, mamba or linear-attention layers,
sliding layers allocated as full, a KV layout it does not know) is logged once at start-up, by name,
and served nothing. The
blocks may be the CPU 'vec' kernel's or a GPU backend's (:func:`kdn.engine.paged.vllm_layout`); on a
GPU, chunks are laid in and gathered out by kdn's CUDA paged copy on vLLM's current stream.
Scheduler and worker share one kdn store per process; where vLLM runs them in different processes
(``vllm serve``: the worker in a process of its own), the scheduler's lookups are answered by the
worker's process over a unix socket (:mod:`kdn.engine.channel`), so that a memory tier,
private to the worker, is seen.

The package, by role: :mod:`.connector` (the class vLLM instantiates; it delegates), :mod:`.scheduler`
(lookups, in-flight waits and claims, what each step loads and stores), :mod:`.worker` (loads into
the blocks, stores out of them), :mod:`.kv_layers` (vLLM's KV layers and their KV cache groups),
:mod:`.specs` (what one tells the other each step), :mod:`.process`
(what one process' connectors share), :mod:`.metrics` (counters on vLLM's /metrics) and
:mod:`kdn.engine.channel` (the scheduler's lookups answered in the worker's process).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KDNConnector", "drain", "stats", "unsupported_reason"]


def __getattr__(name: str) -> Any:
    """The connector and its process-wide helpers, imported on first use: importing this package
    (for :mod:`.blend`, say) does not import vLLM."""
    if name in ("KDNConnector", "unsupported_reason"):
        from kdn.integrations.vllm import connector

        return getattr(connector, name)
    if name in ("drain", "stats"):
        from kdn.integrations.vllm import process

        return getattr(process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
