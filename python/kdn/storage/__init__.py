"""Storage tiers of kdn: host memory, local disk, and the manager that composes them."""

from kdn.storage.disk import DiskTier
from kdn.storage.manager import TierManager
from kdn.storage.memory import MemoryTier

__all__ = ["DiskTier", "MemoryTier", "TierManager"]
