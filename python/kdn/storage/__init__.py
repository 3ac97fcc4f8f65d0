"""Storage tiers of kdn (one protocol: :class:`Tier`): host memory, local disk, a remote store
(through a :mod:`~kdn.storage.transport`), and the manager that composes them.

The names below load on first use, so that :mod:`kdn.config` can ask :mod:`kdn.storage.transport`
which URL schemes exist without importing the manager (which needs the config).
"""

import importlib

_EXPORTS = {"Tier": "base", "DiskTier": "disk", "MemoryTier": "memory", "TierManager": "manager",
            "build_tiers": "manager"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kdn.storage' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kdn.storage.{_EXPORTS[name]}"), name)
