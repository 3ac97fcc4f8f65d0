"""A cache kdn serves to an HF model appends in place (no copy of the whole cache per step) and
answers as a full prefill and as HF's own DynamicCache would."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig
from kdn.delivery.cache import GROWTH, GrowingLayer


def _layers(rows: int, n: int, heads: int = 2, dim: int = 8):
    """A GrowingLayer over the first ``n`` of ``rows`` rows, and a DynamicLayer over a copy."""
    full = torch.randn(2, 1, heads, rows, dim, generator=torch.Generator().manual_seed(0))
    grow, plain = DynamicLayer(), DynamicLayer()
    for layer, (k, v) in ((grow, (full[0][:, :, :n], full[1][:, :, :n])),
                          (plain, (full[0][:, :, :n].clone(), full[1][:, :, :n].clone()))):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    GrowingLayer.adopt(grow)
    return grow, plain


def _step(grow, plain, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(*plain.keys.shape[:2], tokens, plain.keys.shape[3], generator=g) for _ in range(2))
    got, want = grow.update(k, v), plain.update(k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(grow.keys, plain.keys) and torch.equal(grow.values, plain.values)


def test_a_growing_layer_appends_in_place_and_returns_what_concatenation_would():
    grow, plain = _layers(rows=40, n=30)
    at = grow.keys.data_ptr()
    for step in range(10):  # 10 rows of room: every append lands in the same tensors
        _step(grow, plain, 1, step)
        assert grow.keys.data_ptr() == at and grow.get_seq_length() == 31 + step
    _step(grow, plain, 1, 10)  # out of room: moved once into tensors with GROWTH more rows
    moved = grow.keys.data_ptr()
    assert moved != at and grow._kdn_rows >= 41 + GROWTH
    _step(grow, plain, 3, 11)
    assert grow.keys.data_ptr() == moved
    for layer in (grow, plain):  # what speculative decoding and beam search do to a layer
        layer.crop(-5)
    _step(grow, plain, 2, 12)
    assert grow.keys.data_ptr() == moved
    for layer in (grow, plain):
        layer.batch_repeat_interleave(2)
    _step(grow, plain, 1, 13)
    for layer in (grow, plain):
        layer.batch_select_indices(torch.tensor([1]))
    _step(grow, plain, 4, 14)


@pytest.mark.parametrize("delivery", ["layerwise", "whole"])
def test_a_served_cache_continues_as_a_full_prefill_past_its_room(stories, delivery):
    """The cache a retrieve serves: the question and GROWTH + 40 greedy tokens after it (the room runs
    out and the tensors move once) give the tokens and logits of HF's DynamicCache over the same KV,
    and the question's logits match a full prefill's."""
    model, _ = stories
    ids = random_ids(model, 200, seed=3)
    cache = KDN(KDNConfig(chunk_size=64, delivery=delivery))
    cache.store(model, ids[:, :160], full_prefill(model, ids[:, :160])[1])
    served, hit = cache.retrieve(model, ids, limit=199)
    assert hit == 160
    reference = DynamicCache()
    for i, layer in enumerate(served.layers):
        reference.update(layer.keys.clone(), layer.values.clone(), i)
    with torch.no_grad():
        logits = model(ids[:, hit:], past_key_values=served).logits[0, -1]
        assert all(type(layer) is GrowingLayer for layer in served.layers)  # once its layers arrived
        assert torch.allclose(logits, full_prefill(model, ids)[0], atol=1e-4)
        assert torch.equal(model(ids[:, hit:], past_key_values=reference).logits[0, -1], logits)
        token = logits.argmax().view(1, 1)
        for _ in range(GROWTH + 40):
            a = model(token, past_key_values=served).logits[0, -1]
            b = model(token, past_key_values=reference).logits[0, -1]
            assert torch.equal(a, b)
            token = a.argmax().view(1, 1)
    assert served.get_seq_length() == reference.get_seq_length() == 200 + GROWTH + 40
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(served.layers, reference.layers))
