"""The engine under every face of kdn (the KDN facade, blending, the HF integration, evaluation):
model sessions (identity, layout, keys) and the chunk reader/writer between the tiers and a target."""

from kdn.engine.chunks import ChunkIO, HFTarget
from kdn.engine.session import ModelSession, Sessions

__all__ = ["ChunkIO", "HFTarget", "ModelSession", "Sessions"]
