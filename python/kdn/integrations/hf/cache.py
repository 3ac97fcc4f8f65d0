"""HF caches over the engine's loads: :func:`load_cache` (a whole read, a layer-wise stream, or a stored
edit) and :func:`streamed_cache` (layer i's attention waits for layer i alone), for every HF-side face."""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer

from kdn._core import InvalidInputError
from kdn.engine import Engine, HFLayers, HFTarget
from kdn.layout import kv_list_to_cache, latent_rank


class _ArrivingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are being written by a stream: anything that reads them
    (attention's ``update``, ``layer.keys``, beam reordering) waits for its layer first, then it is
    a plain DynamicLayer again. Its length is known without waiting."""

    def _arrive(self) -> None:
        stream, layer = self.__dict__["_kdn_stream"], self.__dict__["_kdn_layer"]
        stream.wait(layer)  # raises DeliveryError if the layer cannot be delivered
        self.__class__ = DynamicLayer
        del self._kdn_stream, self._kdn_layer

    def _tensor(name: str):  # noqa: N805 - a property factory, run in the class body
        def get(self):
            self._arrive()
            return self.__dict__[name]

        def put(self, value):
            self.__dict__[name] = value

        return property(get, put)

    keys = _tensor("keys")
    values = _tensor("values")
    del _tensor

    def get_seq_length(self) -> int:
        return self.__dict__["keys"].shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        self._arrive()
        return self.update(key_states, value_states, *args, **kwargs)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._arrive()
        self.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self._arrive()
        self.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        self._arrive()
        self.crop(tokens_to_remove)


def streamed_cache(model, stream):
    """A DynamicCache for ``model`` over ``stream``'s tensors (:class:`kdn.delivery.LayerStream`):
    its length is known at once, and each layer's attention waits only for that layer. Models with
    other layer kinds (sliding windows) wait for the whole stream first."""
    kv = stream.take_kv()
    if not _plain(model, len(kv) // 2):
        stream.wait_all()
        return kv_list_to_cache(model, kv)
    cache = kv_list_to_cache(model, kv)
    for i, layer in enumerate(cache.layers):
        layer.__class__ = _ArrivingLayer
        layer._kdn_stream, layer._kdn_layer = stream, i
    return cache


def _plain(model, layers: int) -> bool:
    from transformers import DynamicCache

    if latent_rank(model.config) is not None:  # an MLA model's cache is a copy of the vectors: made once they arrived
        return False
    cache = DynamicCache(config=model.config)
    return len(cache.layers) == layers and all(type(layer) is DynamicLayer for layer in cache.layers)


def load_cache(engine: Engine, model, tokens, limit: int, edits=None, started: float | None = None,
               namespace: str | None = None):
    """``(cache, load)``: the stored prefix of ``tokens`` (at most ``limit``) as an HF cache on the
    model's device (None on a miss) and what :meth:`kdn.engine.Engine.load` served. With ``edits``,
    the first edit stored for the prompt's leading chunks (a :class:`kdn.edits.stored.PrunedCache`);
    on the CPU a layer-wise stream when the engine delivers layer-wise (the cache's layer i waits
    for layer i); else a whole read. ``namespace``: the tenant read (:meth:`kdn.engine.Engine.session`)."""
    session = engine.session(model, namespace)
    device = next(model.parameters()).device
    engine.serving_on(device, min(limit, len(tokens)) * session.layout.bytes_per_token())  # the largest hit yet kept
    if edits and namespace is not None:
        raise InvalidInputError("edits are not served within a per-call namespace yet; set KDNConfig.namespace")
    if edits:
        from kdn.edits import parse_many

        for edit in parse_many(edits):  # the first edit stored for the prompt is served
            got = edit.kind.read(engine, model, tokens, limit, edit)
            if got is not None:
                return got
    layers = (lambda n: HFLayers(session, n)) if device.type == "cpu" else None
    load = engine.load(session, tokens, limit, HFTarget(device), layers, started)
    if not load.hit:
        return None, load
    if load.stream is not None:
        return streamed_cache(model, load.stream), load
    return kv_list_to_cache(model, load.result), load
