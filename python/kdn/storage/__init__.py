"""Storage tiers of kdn (one protocol: :class:`Tier`): host memory, local disk, a remote store
(through a :mod:`~kdn.storage.transport`), and the manager that composes them."""

from kdn.storage.base import Tier
from kdn.storage.disk import DiskTier
from kdn.storage.manager import TierManager, build_tiers
from kdn.storage.memory import MemoryTier

__all__ = ["DiskTier", "MemoryTier", "Tier", "TierManager", "build_tiers"]
