"""SGLang HiCache's storage tier over kdn: SGLang's pages (its L3 storage, addressed by page hashes)
kept in kdn's tiers, sealed and verified, shared by processes and machines like any kdn blob.

Start SGLang with the dynamic backend naming this class; ``kdn`` holds :class:`kdn.KDNConfig`
settings (an unknown one stops the start-up with a "did you mean")::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kdn", "module_path": "kdn.integrations.sglang", "class_name": "KDNHiCacheStorage",
          "kdn": {"disk_dir": "/var/cache/kdn", "remote_url": "redis://10.0.0.5:6379/0"}}'

A page is filed under a hash of the model's identity (its name, and the tensor-parallel shard a rank
holds: an MLA model's pages are shared by every rank, as SGLang's file backend does) and SGLang's
page hash; a page of another model, another shard, another tenant (``namespace``, ``secret``) or
damaged in a shared store is a miss, never served.
"""

from __future__ import annotations

import logging

import torch

from kdn import _core
from kdn.config import KDNConfig
from kdn.engine import Engine

log = logging.getLogger("kdn")

try:  # SGLang's own abstract class when SGLang is installed (its backend factory checks for it)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # kdn's face needs nothing of SGLang's: the same methods, checked by kdn's tests
    _Base = object


def shard_identity(storage_config) -> bytes:
    """The 16-byte identity of the pages one SGLang rank stores: the model and its shard (pipeline
    and context-parallel ranks always; tensor-parallel ranks unless the model is MLA)."""
    c = storage_config
    shard = [f"pp{c.pp_rank}/{c.pp_size}", f"cp{getattr(c, 'attn_cp_rank', 0)}/{getattr(c, 'attn_cp_size', 1)}"]
    if not c.is_mla_model:
        shard.append(f"tp{c.tp_rank}/{c.tp_size}")
    text = "\0".join(["kdn/sglang", str(c.model_name or ""), *shard, f"mla={bool(c.is_mla_model)}"])
    return _core.blake3(text.encode(), 16)


class KDNHiCacheStorage(_Base):
    """SGLang's ``HiCacheStorage`` (``get``/``batch_get`` into the host pool's page tensors,
    ``set``/``batch_set`` from them, ``exists``/``batch_exists`` over page hashes) on a kdn engine:
    :meth:`kdn.engine.Engine.pages`."""

    def __init__(self, storage_config, kwargs=None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = KDNConfig(**dict(extra.get("kdn") or {}))
        self.engine = Engine(self.config)
        self.pages = self.engine.pages(shard_identity(storage_config))
        self.writer = getattr(storage_config, "is_storage_writer", True)  # MLA: one rank writes

    def get(self, key: str, target_location: torch.Tensor | None = None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: list | None = None, target_sizes=None) -> list:
        """Each page read into its target tensor (returned), None from the first that is not stored."""
        if target_locations is None or any(t is None for t in target_locations):
            raise ValueError("kdn's HiCache storage reads pages into the host pool's tensors: target_locations")
        loaded = self.pages.load(keys, list(target_locations))
        return [t if i < loaded else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: torch.Tensor | None = None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: list | None = None, target_locations=None,
                  target_sizes=None) -> bool:
        """Store every page (pages held already are kept); True when all are stored."""
        if not self.writer:
            return True  # another rank of this MLA model writes the shared pages
        pages = [v.contiguous() for v in (values or [])]
        return self.pages.save(keys, pages) == len(keys)

    def exists(self, key: str) -> bool:
        return self.pages.lookup([key]) == 1

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """How many leading pages are stored (one round trip per tier)."""
        return self.pages.lookup(keys)

    def clear(self) -> None:
        self.engine.clear()

    def get_stats(self):
        return self.engine.stats()
