"""Delivery: layer-wise pipelined loading of stored KV (transfer, decode and compute overlap) and
bandwidth-adaptive streaming from the remote tier with a text fallback (:mod:`kdn.delivery.plan`)."""

from kdn.delivery.cache import streamed_cache
from kdn.delivery.plan import Estimates, layer_groups
from kdn.delivery.stream import Deliverer, DeliveryError, LayerStream

__all__ = ["Deliverer", "DeliveryError", "Estimates", "LayerStream", "layer_groups", "streamed_cache"]
