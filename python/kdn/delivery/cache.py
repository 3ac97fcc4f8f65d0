"""A transformers cache over a layer-wise stream: layer i's attention waits for layer i alone."""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer

from kdn.layout import kv_list_to_cache


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

    cache = DynamicCache(config=model.config)
    return len(cache.layers) == layers and all(type(layer) is DynamicLayer for layer in cache.layers)
