"""Delivery: blob format 2 (a layer group verifies alone), layer-wise loading equal to a full
prefill from every tier, adaptive levels and the text fallback, and nothing lost when the link
dies or a range is corrupt, against a real Redis behind a shaped link (netns + veth + tc)."""

import logging

import pytest
import torch
from kdn._core import BlobError, InvalidInputError

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig, _core, codecs
from kdn.delivery import Estimates, layer_groups
from kdn.engine import plan
from kdn.engine.stream import Deliverer
from kdn.models.tiny import tiny_model
from shaped_link import ShapedRedis, require_link

CHUNK = 32
LEVELS = ("cachegen:level=3", "cachegen:level=1", "int2")


@pytest.fixture(scope="module")
def model4():
    """A 4-layer random Llama with enough KV per token for a slow link to take a while."""
    return tiny_model("llama", layers=4, heads=4, kv_heads=4, head_dim=32)


@pytest.fixture
def link(tmp_path):
    require_link()
    shaped = ShapedRedis(tmp_path / "redis", gbps=10.0)
    yield shaped
    shaped.stop()


def store_remote(model, ids, url, **config):
    """Store ``ids``'s KV in the remote store behind ``url`` (and wait until it is sent)."""
    writer = KDN(KDNConfig(chunk_size=CHUNK, remote_url=url, **config))
    writer.remote.clear()
    writer.store(model, ids, full_prefill(model, ids)[1])
    writer.flush()
    return writer


def greedy(model, ids, n=6):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


# -- blob format 2 -------------------------------------------------------------------------------
def a_blob(codec="raw", layers=3, tokens=8):
    g = torch.Generator().manual_seed(layers)
    kv = [torch.randn(1, 2, tokens, 16, generator=g) for _ in range(2 * layers)]
    return codecs.encode(_core.pack_chunk(kv, 0, tokens, b"F" * 16, b"K" * 16), codec)


@pytest.mark.parametrize("codec", ["raw", "lossless", "cachegen:level=2"])
def test_a_layer_group_verifies_alone_and_a_damaged_plane_is_caught(codec):
    blob = bytes(a_blob(codec))
    info = _core.blob_sections(blob[: 80 + 8 * 3])
    sections = info["sections"]
    assert info["version"] == 2 and len(sections) == 1 + 2 * 3 and info["total_bytes"] == len(blob)
    assert sections[0][0] == 0 and sections[-1][1] == info["trailer"][0]  # every byte, once
    assert all(a[1] == b[0] for a, b in zip(sections, sections[1:]))
    partial = bytearray(len(blob))  # only the header, layer 1's planes and the trailer arrived
    first, end = sections[3][0], sections[4][1]
    for begin, stop in ((0, sections[0][1]), (first, end), tuple(info["trailer"])):
        partial[begin:stop] = blob[begin:stop]
    _core.blob_verify_sections(partial, 3, 4)
    with pytest.raises(BlobError, match="section 1"):
        _core.blob_verify_sections(partial, 1, 2)  # layer 0 never arrived
    partial[first + 1] ^= 0x10
    with pytest.raises(BlobError, match="section 3"):
        _core.blob_verify_sections(partial, 3, 4)
    damaged = bytearray(blob)
    damaged[end - 1] ^= 1
    with pytest.raises(BlobError, match="checksum"):
        _core.blob_parse(damaged)


def as_version_1(blob) -> bytes:
    """The same chunk as a format-1 writer sealed it: no section sums, one XXH64 of everything."""
    h = _core.blob_parse(blob)
    old = bytearray(bytes(blob)[: 80 + h["payload_bytes"]] + bytes(8))
    old[4:6] = (1).to_bytes(2, "little")
    _core.blob_reseal(old)
    return bytes(old)


def test_format_1_blobs_are_still_read(tiny_llama):
    ids = random_ids(tiny_llama, 50, seed=3)
    reference, cache = full_prefill(tiny_llama, ids)
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.store(tiny_llama, ids, cache)
    key = kdn.chunk_keys(tiny_llama, ids)[0]
    old = as_version_1(kdn.memory.get(key))
    assert _core.blob_parse(old)["version"] == 1
    kdn.memory.remove(key)
    kdn.memory.put(key, old)
    got, hit = kdn.retrieve(tiny_llama, ids, limit=49)
    assert hit == 49
    with torch.inference_mode():
        logits = tiny_llama(ids[:, hit:], past_key_values=got).logits[0, -1]
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


# -- layer-wise loading ----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["memory", "disk", "remote"])
def test_layerwise_serves_the_same_logits_as_whole(model4, tmp_path, request, where):
    ids = random_ids(model4, 150, seed=1)
    reference, cache = full_prefill(model4, ids)
    tiers = {"memory": {}, "disk": {"disk_dir": str(tmp_path / "kdn")}}
    if where == "remote":
        tiers["remote"] = {"remote_url": request.getfixturevalue("redis_server").url}
        store_remote(model4, ids, tiers["remote"]["remote_url"])
    else:
        writer = KDN(KDNConfig(chunk_size=CHUNK, **tiers[where]))
        writer.store(model4, ids, cache)
        writer.flush()  # its disk writes have landed before the readers open the folder
    logits = {}
    for delivery in ("whole", "layerwise"):
        reader = KDN(KDNConfig(chunk_size=CHUNK, delivery=delivery, layer_group=1, **tiers[where]))
        if where == "memory":
            reader.store(model4, ids, cache)
        got, hit = reader.retrieve(model4, ids, limit=149)
        assert hit == 149
        with torch.inference_mode():
            logits[delivery] = model4(ids[:, hit:], past_key_values=got).logits[0, -1]
        stream = reader.last_retrieve["stream"]
        assert (stream is not None) == (delivery == "layerwise")
        if stream is not None:
            stream.wait_all()
    torch.testing.assert_close(logits["layerwise"], reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits["layerwise"], logits["whole"])
    stats = stream.stats
    assert stats["groups_delivered"] == 4 and stats["hit_tokens"] == 149
    if where == "remote":  # streamed in ranges, then kept whole in memory for the next request
        assert stats["streamed_chunks"] == 5 and stats["bytes"] > 0 and stats["levels"] == ["raw"] * 4
        assert reader.stats()["memory"]["entries"] >= 5 and reader.stats()["remote"]["hits"] >= 5
    else:
        assert stats["local_chunks"] == 5 and stats["bytes"] == 0


def test_each_layer_waits_for_its_own_group(model4):
    """The model's layer i reads the cache only after group i is delivered, never later groups."""
    ids = random_ids(model4, 100, seed=2)
    kdn = KDN(KDNConfig(chunk_size=CHUNK, layer_group=1))
    kdn.store(model4, ids, full_prefill(model4, ids)[1])
    order = []
    original = Deliverer.open

    def open_and_watch(self, *args, **kwargs):
        stream, hit = original(self, *args, **kwargs)
        wait = stream.wait

        def watched(layer):
            wait(layer)
            order.append((layer, stream.stats["groups_delivered"]))

        stream.wait = watched
        return stream, hit

    Deliverer.open = open_and_watch
    try:
        out = kdn.generate(model4, ids, max_new_tokens=1, do_sample=False)
    finally:
        Deliverer.open = original
    assert torch.equal(out, greedy(model4, ids, 1))
    assert [layer for layer, _ in order][:4] == [0, 1, 2, 3]
    assert all(delivered > layer for layer, delivered in order)


# -- plans ----------------------------------------------------------------------------------------------
def test_layer_groups_cover_every_layer():
    assert layer_groups(30, 3) == [(i, i + 3) for i in range(0, 30, 3)]
    assert layer_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_plans_follow_the_measured_link():
    sizes = [[[100, 100], [30, 30], [10, 10]] for _ in range(4)]  # 4 chunks, 3 levels, 2 groups
    req = plan.Request(sizes, [32] * 4, 0, 129, deadline=1.0)
    est = Estimates()
    assert plan.chunks_to_stream(req, est, b"m", 2)[0] == 4  # nothing measured: stream everything
    est.observe_prefill(b"m", 100, 1.0)  # 10 ms per token: a full prefill takes 1.29 s
    est.observe_transfer(800, 1.0)  # 800 B/s: the smallest level of 4 chunks (80 B) in 0.1 s
    assert plan.chunks_to_stream(req, est, b"m", 2) == (4, "meets the deadline")
    assert plan.level_for_group(sizes, 0, 2, 0.9, est.bandwidth) == 1  # 240 B in 0.3 s; 800 B would take 1 s
    assert plan.level_for_group(sizes, 1, 2, 0.9, est.bandwidth) == 0  # one group left: 400 B in 0.5 s
    assert plan.level_for_group(sizes, 0, 2, None, est.bandwidth) == 0  # no deadline: exact
    slow = Estimates()
    slow.observe_prefill(b"m", 100, 1.0)
    slow.observe_transfer(40, 1.0)  # 40 B/s: even the smallest level takes 2 s
    k, why = plan.chunks_to_stream(req, slow, b"m", 2)
    assert k < 4 and "recomputed" in why or "out of reach" in why
    assert plan.streamed_ttft(k * 20 / 40, 0.01 * (129 - 32 * k), 2) <= plan.streamed_ttft(2.0, 0.01, 2)
    missing = [[[100, 100], None, [10, 10]]]
    assert plan.level_of_chunk(missing[0], 1) == 2 and plan.level_of_chunk([[1], None, None], 2) == 0


@pytest.mark.parametrize("bad, match", [({"ttft_deadline": 0}, "positive"), ({"ttft_deadline": -1.0}, "positive"),
                                        ({"delivery_levels": ("cachegen:level=9",)}, "level"),
                                        ({"delivery_levels": "int3"}, "int3"),
                                        ({"delivery_levels": ("raw",)}, "exact"),
                                        ({"delivery": "streamed"}, "layerwise"), ({"layer_group": 0}, "positive")])
def test_bad_delivery_settings_are_refused_at_configuration(bad, match):
    with pytest.raises(InvalidInputError, match=match):
        KDNConfig(**bad)


# -- adaptive streaming over a shaped link --------------------------------------------------------------
def test_a_slow_link_gets_smaller_levels_and_lossy_kv_is_never_stored_as_exact(model4, link):
    ids = random_ids(model4, 200, seed=4)
    reference, _ = full_prefill(model4, ids)
    store_remote(model4, ids, link.url, delivery_levels=LEVELS)
    link.set_rate(0.02)  # 2.5 MB/s: the exact KV (800 KB) would take 0.3 s
    reader = KDN(KDNConfig(chunk_size=CHUNK, remote_url=link.url, layer_group=1, delivery_levels=LEVELS,
                           ttft_deadline=0.15))
    reader.engine.estimates.observe_prefill(reader.session(model4).fingerprint, 200, 2.0)  # "prefill is slow"
    reader.engine.estimates.observe_transfer(2_500_000, 1.0)
    out = reader.generate(model4, ids, max_new_tokens=1, do_sample=False)
    stats = reader.last_generate["delivery"]
    assert stats["streamed_chunks"] == 6 and stats["lossy"]
    assert set(stats["levels"]) - {"raw"}, stats["levels"]  # some groups came at a lossy level
    assert stats["bytes"] < 0.6 * 6 * 4 * 2 * 4 * 32 * 4 * 32  # less than the exact KV of the hit
    assert out.shape[1] == ids.shape[1] + 1
    for key in reader.chunk_keys(model4, ids):  # nothing was stored under an exact key
        assert not reader.memory.contains(key)
    link.set_rate(10.0)  # a fast link: the exact KV, and the logits of a full prefill
    fast = KDN(KDNConfig(chunk_size=CHUNK, remote_url=link.url, layer_group=1, delivery_levels=LEVELS,
                         ttft_deadline=5.0))
    fast.engine.estimates.observe_transfer(100_000_000, 0.1)
    got, hit = fast.retrieve(model4, ids, limit=199)
    with torch.inference_mode():
        logits = model4(ids[:, hit:], past_key_values=got).logits[0, -1]
    assert fast.last_retrieve["stream"].stats["levels"] == ["raw"] * 4
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_a_link_too_slow_for_any_level_is_recomputed_instead(model4, link):
    ids = random_ids(model4, 200, seed=5)
    store_remote(model4, ids, link.url, delivery_levels=LEVELS)
    reader = KDN(KDNConfig(chunk_size=CHUNK, remote_url=link.url, delivery_levels=LEVELS, ttft_deadline=0.05))
    reader.engine.estimates.observe_prefill(reader.session(model4).fingerprint, 200, 0.02)  # prefill: 20 ms
    reader.engine.estimates.observe_transfer(10_000, 1.0)  # 10 KB/s
    out = reader.generate(model4, ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, greedy(model4, ids, 3))
    assert reader.last_generate["hit_tokens"] == 0 and reader.stats()["delivery"]["recomputed_chunks"] == 6


def test_a_link_that_dies_mid_stream_costs_a_recompute_not_the_answer(model4, link, caplog):
    ids = random_ids(model4, 300, seed=6)
    store_remote(model4, ids, link.url)
    link.set_rate(0.05)
    reader = KDN(KDNConfig(chunk_size=CHUNK, remote_url=link.url, layer_group=1, remote_timeout=0.5))
    original = Deliverer._fetch_group
    calls = []

    def fetch_then_cut(self, *args):
        moved = original(self, *args)
        calls.append(moved)
        if len(calls) == 1:
            link.cut()  # after the first layer group: every later packet is lost
        return moved

    Deliverer._fetch_group = fetch_then_cut
    try:
        with caplog.at_level(logging.WARNING, logger="kdn"):
            out = reader.generate(model4, ids, max_new_tokens=4, do_sample=False)
    finally:
        Deliverer._fetch_group = original
        link.restore()
    assert torch.equal(out, greedy(model4, ids, 4))
    assert len(calls) == 1 and reader.last_generate["hit_tokens"] == 0
    assert caplog.text.count("delivering the stored KV failed") == 1
    assert reader.stats()["delivery"]["failures"] == 1


def test_a_corrupt_range_is_never_served(model4, redis_server, caplog):
    ids = random_ids(model4, 100, seed=7)
    writer = store_remote(model4, ids, redis_server.url)
    key = writer.chunk_keys(model4, ids)[1]
    name = writer.remote.redis_key(key)
    value = bytearray(writer.remote.transport.get([name])[0])
    value[80 + 5000] ^= 0x40  # a byte of layer 0's keys, its section sum unchanged
    writer.remote.transport.put([(name, bytes(value))], None)
    reader = KDN(KDNConfig(chunk_size=CHUNK, remote_url=redis_server.url))
    with caplog.at_level(logging.WARNING, logger="kdn"):
        out = reader.generate(model4, ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, greedy(model4, ids, 3))
    assert "checksum" in caplog.text and reader.last_generate["hit_tokens"] == 0
    reader.flush()  # the damaged value was dropped, and the recomputed prompt stored again
    assert _core.blob_parse(writer.remote.transport.get([name])[0])["key"] == key
