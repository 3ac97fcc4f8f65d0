"""Delivery to HF models: caches over the engine's loads (:mod:`kdn.delivery.cache`), and the
engine's layer-wise streaming (:mod:`kdn.engine.stream`, :mod:`kdn.engine.plan`) under the names
users import."""

from kdn.delivery.cache import load_cache, streamed_cache
from kdn.engine.plan import Estimates, layer_groups
from kdn.engine.stream import DeliveryError, LayerStream

__all__ = ["DeliveryError", "Estimates", "LayerStream", "layer_groups", "load_cache", "streamed_cache"]
