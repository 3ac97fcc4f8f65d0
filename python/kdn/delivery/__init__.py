"""Layer-wise delivery under the names users import: the engine's streams (:mod:`kdn.engine.stream`:
a layer group at a time, remote chunks as verified byte ranges) and their plan (:mod:`kdn.engine.plan`:
levels per group for a TTFT deadline). The HF caches over them: :mod:`kdn.integrations.hf.cache`."""

from kdn.engine.plan import Estimates, layer_groups
from kdn.engine.stream import DeliveryError, LayerStream

__all__ = ["DeliveryError", "Estimates", "LayerStream", "layer_groups"]
