"""Adapters that plug kdn into model runtimes: HF transformers (hf), vLLM (vllm/), SGLang HiCache (sglang)."""
