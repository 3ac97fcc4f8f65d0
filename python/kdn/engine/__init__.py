"""The engine under every face of kdn (the KDN facade, blending, the HF integration, evaluation):
model sessions (identity, layout, keys) and the chunk reader/writer between the tiers and a target."""

from kdn.engine.chunks import ChunkIO
from kdn.engine.session import ModelSession, Sessions
from kdn.engine.targets import HFLayers, HFTarget, PagedBlocks, Target

__all__ = ["ChunkIO", "HFLayers", "HFTarget", "ModelSession", "PagedBlocks", "Sessions", "Target"]
