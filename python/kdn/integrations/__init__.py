"""Adapters that plug kdn into model runtimes (HF transformers today)."""
