"""The engine under every face of kdn (the KDN facade, blending, editing, the HF integration, the
vLLM connector, evaluation): :class:`Engine` (lookup, load, save) over model sessions (identity,
layout, keys), the chunk reader/writer between the tiers and a target, and layer-wise delivery."""

from kdn.engine.chunks import Prefix
from kdn.engine.core import Engine, Load
from kdn.engine.session import ModelSession, Sessions
from kdn.engine.targets import HFLayers, HFTarget, PagedBlocks, Target

__all__ = ["Engine", "HFLayers", "HFTarget", "Load", "ModelSession", "PagedBlocks", "Prefix", "Sessions", "Target"]
