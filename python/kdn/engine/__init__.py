"""The engine under every face of kdn (the KDN facade, blending, editing, the HF integration, the
vLLM connector, evaluation): :class:`Engine` (lookup, load, save) over model sessions (identity,
layout, keys), the chunk reader/writer between the tiers and a target, layer-wise delivery, and a
serving engine's requests from lookup to finish (:class:`Requests`) with their store thread
(:class:`StoreQueue`)."""

from kdn.engine.chunks import Prefix
from kdn.engine.core import Engine, Load
from kdn.engine.requests import Request, Requests
from kdn.engine.retention import Retention
from kdn.engine.session import ModelSession, Sessions
from kdn.engine.stores import StoreJob, StoreQueue
from kdn.engine.stream import DeliveryError, LayerStream
from kdn.engine.targets import HFLayers, HFTarget, PagedBlocks, Target

__all__ = ["DeliveryError", "Engine", "HFLayers", "HFTarget", "LayerStream", "Load", "ModelSession", "PagedBlocks",
           "Prefix", "Request", "Requests", "Retention", "Sessions", "StoreJob", "StoreQueue", "Target"]
