"""Storage tiers of kdn (memory now; disk and remote tiers plug in behind the same interface)."""

from kdn.storage.memory import MemoryTier

__all__ = ["MemoryTier"]
