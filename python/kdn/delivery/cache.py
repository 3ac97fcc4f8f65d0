"""HF caches over the engine's loads: :func:`load_cache` (a whole read, a layer-wise stream, or a stored
edit) and :func:`streamed_cache` (layer i's attention waits for layer i alone), for every HF-side face."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kdn._core import InvalidInputError
from kdn.engine import Engine, HFLayers, HFTarget, Load
from kdn.layout import kv_list_to_cache

GROWTH = 256  # tokens of room a served cache gets past its prompt, and each time it runs out


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose tensors are the first rows of larger ones kdn allocated: appending a
    token writes it in place instead of concatenating (DynamicLayer's ``update`` copies the whole
    cache at every step: at 4K tokens of SmolLM2 most of a hit's first step). Out of room, or
    handed tensors of its own (beam reordering, a batch change), it moves into new tensors with
    :data:`GROWTH` or an eighth more rows, once. What it returns is what DynamicLayer's would be."""

    @staticmethod
    def adopt(layer: DynamicLayer) -> None:
        layer.__class__ = GrowingLayer
        layer._kdn_rows = layer.keys.stride(1) // layer.keys.stride(2) if layer.keys.dim() == 4 else 0

    def _room(self, new: int) -> bool:
        k, v = self.keys, self.values
        return (k.dim() == 4 and k.stride() == v.stride() and k.stride(3) == 1 and k.stride(2) == k.shape[3]
                and k.stride(1) == self._kdn_rows * k.shape[3] and k.shape[-2] + new <= self._kdn_rows)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized or any(t.requires_grad for t in (key_states, value_states, self.keys)):
            return super().update(key_states, value_states, *args, **kwargs)  # a graph through the cache
        with torch.no_grad():  # the tensors are kdn's buffers, written in place: nothing to differentiate
            return self._append(key_states, value_states)

    def _append(self, key_states, value_states):
        n, new = self.keys.shape[-2], key_states.shape[-2]
        if not self._room(new):
            rows = n + new + max(GROWTH, (n + new) // 8)
            grown = [t.new_empty(*t.shape[:2], rows, t.shape[3]) for t in (self.keys, self.values)]
            for full, old in zip(grown, (self.keys, self.values)):
                full[:, :, :n].copy_(old)
            self.keys, self.values, self._kdn_rows = grown[0][:, :, :n], grown[1][:, :, :n], rows
        shape = (*self.keys.shape[:2], n + new, self.keys.shape[3])
        self.keys = self.keys.as_strided(shape, self.keys.stride())
        self.values = self.values.as_strided(shape, self.values.stride())
        self.keys[:, :, n:].copy_(key_states)
        self.values[:, :, n:].copy_(value_states)
        return self.keys, self.values


def _growing(cache):
    """``cache`` with its plain layers appending in place (:class:`GrowingLayer`)."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized:
            GrowingLayer.adopt(layer)
    return cache


class _ArrivingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are being written by a stream: anything that reads them
    (attention's ``update``, ``layer.keys``, beam reordering) waits for its layer first, then it is
    a :class:`GrowingLayer`. Its length is known without waiting."""

    def _arrive(self) -> None:
        stream, layer = self.__dict__["_kdn_stream"], self.__dict__["_kdn_layer"]
        stream.wait(layer)  # raises DeliveryError if the layer cannot be delivered
        del self._kdn_stream, self._kdn_layer
        GrowingLayer.adopt(self)

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
        return _growing(kv_list_to_cache(model, kv))
    cache = kv_list_to_cache(model, kv)
    for i, layer in enumerate(cache.layers):
        layer.__class__ = _ArrivingLayer
        layer._kdn_stream, layer._kdn_layer = stream, i
    return cache


def _plain(model, layers: int) -> bool:
    from transformers import DynamicCache

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
    if edits and namespace is not None:
        raise InvalidInputError("edits are not served within a per-call namespace yet; set KDNConfig.namespace")
    if edits:
        from kdn.edits import parse_many, stored

        for edit in parse_many(edits):  # the first edit stored for the prompt is served
            if edit.name == "steer":  # the exact KV, read whole, and the sidecars' biases
                found = stored.steering(engine, model, tokens, limit, edit)
                load = engine.load(session, tokens, limit, HFTarget(device)) if found else Load()
                if load.hit:
                    return kv_list_to_cache(model, load.result), Load(load.hit, lossy=True, edit=edit.spec,
                                                                      bias=found[0])
                continue
            cache, hit, spec, bias = stored.read(engine, model, tokens, limit, [edit])
            if hit:
                return cache, Load(hit, lossy=True, edit=spec, bias=bias)
    rows = len(tokens) + GROWTH  # the prompt's rest and what is generated append in place
    layers = (lambda n: HFLayers(session, n, rows)) if device.type == "cpu" else None
    load = engine.load(session, tokens, limit, HFTarget(device, rows), layers, started)
    if not load.hit:
        return None, load
    if load.stream is not None:
        return streamed_cache(model, load.stream), load
    return _growing(kv_list_to_cache(model, load.result)), load
