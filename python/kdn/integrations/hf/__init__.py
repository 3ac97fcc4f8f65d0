"""kdn for HF transformers models, in one room: the :class:`KDN` facade (lookup, store, retrieve,
generate, deposit, blend; :mod:`.facade`), generate with kdn as the KV-cache provider and a TTFT
timer (:mod:`.generate`), and the HF caches over the engine's loads (:mod:`.cache`: whole,
layer-wise, or a stored edit)."""

from kdn.integrations.hf.cache import load_cache, streamed_cache
from kdn.integrations.hf.facade import KDN
from kdn.integrations.hf.generate import FirstTokenTimer, generate

__all__ = ["KDN", "FirstTokenTimer", "generate", "load_cache", "streamed_cache"]
