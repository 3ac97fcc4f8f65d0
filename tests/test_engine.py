"""The one engine every face holds (kdn.engine.Engine): load whole or layer by layer gives a full
prefill's KV, and save applies the fidelity rule for every face alike."""

import numpy as np
import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig
from kdn.engine import Engine, HFLayers, HFTarget
from kdn.engine.served import Served
from kdn.layout import cache_to_kv_list, layout_of


@pytest.mark.parametrize("delivery", ["layerwise", "whole"])
def test_a_load_whole_or_layer_by_layer_is_a_full_prefills_kv(stories, delivery):
    model, _ = stories
    ids = random_ids(model, 300)
    engine = Engine(KDNConfig(chunk_size=64, delivery=delivery), layout_of=layout_of)
    session = engine.session(model)
    tokens = session.tokens(ids)
    _, cache = full_prefill(model, ids)
    truth = cache_to_kv_list(cache)
    assert engine.save(session, tokens, [t.detach() for t in truth]) == 300
    load = engine.load(session, tokens, 299, HFTarget("cpu"), lambda n: HFLayers(session, n))
    assert load.hit == 299 and not load.lossy
    if delivery == "layerwise":
        assert load.stream is not None and load.result is None
        load.stream.wait_all()
        kv = load.stream.take_kv()
    else:
        assert load.stream is None
        kv = load.result
    assert all(torch.equal(a, b[:, :, :299]) for a, b in zip(kv, truth))
    assert engine.lookup(session, tokens, 299) == 299


def test_blobs_copied_into_another_engine_load_as_a_full_prefills_kv_there(stories):
    model, _ = stories
    ids = random_ids(model, 256, seed=2)
    src = Engine(KDNConfig(chunk_size=64), layout_of=layout_of)
    dst = Engine(KDNConfig(chunk_size=64, memory_codec="lossless"), layout_of=layout_of)
    session, there = src.session(model), dst.session(model)
    tokens = session.tokens(ids)
    truth = [t.detach() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    assert src.save(session, tokens, truth) == 256
    keys = session.prefix_keys(tokens)
    assert src.copy_to(dst, keys + [b"\x00" * 16]) == len(keys)  # a key src does not hold is not copied
    load = dst.load(there, there.tokens(ids), 256, HFTarget("cpu"))
    assert load.hit == 256 and all(torch.equal(a, b) for a, b in zip(load.result, truth))


def test_save_refuses_kv_computed_over_what_the_rule_forbids_for_every_face(stories):
    model, _ = stories
    ids = random_ids(model, 200, seed=1)
    engine = Engine(KDNConfig(chunk_size=64), layout_of=layout_of)
    session = engine.session(model)
    tokens = session.tokens(ids)
    kv = [t.detach() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    for served in (Served(tokens=64, lossy=True), Served(tokens=64, failed=True), Served(tokens=64, suspect=True)):
        assert engine.save(session, tokens, kv, served) == 0
    assert engine.lookup(session, tokens, 199) == 0 and engine.stats()["integrity"]["refused_stores"] == 3
    assert engine.load(session, tokens, 199, HFTarget("cpu")).hit == 0
    assert engine.save(session, tokens, kv, Served(tokens=64)) == 192  # exact: 3 chunks (an 8-token tail is not)


def test_a_prompt_is_hashed_once_per_session_and_its_keys_are_the_chained_keys(stories, monkeypatch):
    """Lookups asked again each step, the load and the save of one request hash its tokens once; the
    keys are kdn.keys.prefix_keys' for every length and with or without the partial chunk."""
    from kdn.engine import session as session_module
    from kdn.keys import prefix_keys

    model, _ = stories
    engine = Engine(KDNConfig(chunk_size=64), layout_of=layout_of)
    session = engine.session(model)
    for n in (0, 1, 63, 64, 65, 200, 256):
        tokens = session.tokens(random_ids(model, n, seed=n)) if n else session.tokens([])
        for partial in (False, True):
            expected = prefix_keys(session.fingerprint, tokens, 64, partial)
            assert session.prefix_keys(tokens, partial) == expected, (n, partial)
    calls = []
    real = session_module.prefix_keys
    monkeypatch.setattr(session_module, "prefix_keys", lambda *a: calls.append(a) or real(*a))
    ids = random_ids(model, 300, seed=7)
    tokens = session.tokens(ids)
    kv = [t.detach() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    for _ in range(3):
        engine.lookup(session, tokens, 299)
    engine.save(session, tokens, kv)
    assert engine.load(session, tokens, 299, HFTarget("cpu")).hit == 299
    assert len(calls) == 1
    other = tokens.copy()
    other[-1] = (int(other[-1]) + 1) % model.config.vocab_size  # one token apart: its own last key
    hashed = session.recent.hashed
    assert session.prefix_keys(other, True)[-1] != session.prefix_keys(tokens, True)[-1]
    assert session.recent.hashed - hashed == 1  # only the chunk that differs (keys are chained)
    for n in (64, 100, 299, 400):  # a prefix (a load), an extension (prompt + generated): the chained keys
        grown = np.concatenate([tokens, tokens])[:n]
        assert session.prefix_keys(grown, True) == prefix_keys(session.fingerprint, grown, 64, True), n


def test_a_generate_hashes_each_chunk_of_its_request_once(tiny_llama):
    """One request through the real HF ``generate``: its lookup hashes the prompt, its save (the
    prompt and what was generated) hashes only the chunks past the prompt's full ones; a repeat
    hashes nothing."""
    kdn = KDN(KDNConfig(chunk_size=8))
    session = kdn.session(tiny_llama)
    ids = random_ids(tiny_llama, 45, seed=3)
    before = session.recent.hashed
    kdn.generate(tiny_llama, ids, max_new_tokens=12, do_sample=False)
    stored = 45 + 12 - 1  # the last generated token's KV is not computed
    assert session.recent.hashed - before == -(-stored // 8) + 1  # 7 chunks, the prompt's partial one twice
    assert kdn.lookup(tiny_llama, ids) == 40  # whole chunks of 8 (probes every 8 tokens: none inside one)
    before = session.recent.hashed
    kdn.generate(tiny_llama, ids, max_new_tokens=12, do_sample=False)
    assert kdn.last_generate["hit_tokens"] == 40 and session.recent.hashed == before


def test_a_paged_load_reads_only_the_chunks_its_layers_take_kv_from(stories):
    """A load into an engine's blocks that holds the prompt's first tokens itself (vLLM's prefix cache)
    or keeps only a window (sliding layers) fetches the stored chunks from the first one any layer
    takes on, and lays byte for byte what a load reading every chunk lays: whole, and layer by layer
    (vLLM's in-step load)."""
    import forge
    from kdn.engine.targets import NULL_BLOCK, PagedBlocks
    from test_paged import describe_layout, engine_layers

    model, _ = stories
    ids = random_ids(model, 300, seed=3)
    engine = Engine(KDNConfig(chunk_size=64), layout_of=layout_of)
    session = engine.session(model)
    tokens = session.tokens(ids)
    truth = [t.detach() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    assert engine.save(session, tokens, truth) == 300
    layers, heads, dim, block = 5, 4, 8, 16
    table = list(range(1, 20))  # 19 blocks of 16 hold 300 positions; block 0 is the null block
    tiers, fetched = forge.tiers(engine), []
    fetch = tiers.fetch

    def counted(keys, **kw):  # chunks fetched (a lookup's pointer read is a fetch too, exact=True)
        if not kw.get("exact"):
            fetched.append(len(keys))
        return fetch(keys, **kw)

    tiers.fetch = counted
    streamed: list = []  # each layer-wise load's stream stats

    def load(tables: list, start: int, groups, read_all: bool = False, layerwise: bool = False) -> tuple:
        paged = engine_layers("vec", layers, 24, heads, block, dim, torch.float32)
        blocks = PagedBlocks(paged, describe_layout("vec", paged[0]), tables, start, groups)
        if read_all:
            blocks.unread_chunks = lambda chunk: 0
        fetched.clear()
        done = engine.load(session, tokens, 299, blocks, (lambda n: blocks) if layerwise else None)
        if done.stream is not None:  # a layer-wise stream (vLLM's in-step load): every layer group laid
            done.stream.wait_all()
            streamed.append(done.stream.stats)
        return done.hit, sum(fetched), paged

    window = [NULL_BLOCK] * 12 + table[12:]  # a sliding layer keeping positions 192.. only
    for tables, start, groups, reads in ((table, 130, None, 3),  # the engine holds 130: chunks 2, 3, 4
                                         ([table, window], 0, (0, 1, 1, 0, 1), 5),  # full layers: every chunk
                                         ([window], 0, (0,) * layers, 2)):  # every layer windowed: 3 and 4
        everything, n_all, reference = load(tables, start, groups, read_all=True)
        assert everything == 299 and n_all == 5 and any(t.abs().sum() > 0 for t in reference)
        for layerwise in (False, True):
            hit, n, paged = load(tables, start, groups, layerwise=layerwise)
            assert hit == 299 and n == reads, layerwise
            assert not layerwise or streamed[-1]["skipped_chunks"] == 5 - reads  # it streamed
            assert all(torch.equal(a, b) for a, b in zip(paged, reference)), layerwise
    # the first chunk read is not what its key names (chunk 1's bytes): dropped, nothing laid, a miss
    # for the caller to recompute; the chunks before it were never read
    keys = session.prefix_keys(tokens)
    assert forge.plant(engine, keys[2], tiers.fetch([keys[1]])[0][0])
    assert load(table, 130, None)[:2] == (0, 3) and not forge.held(engine, keys[2])
    assert forge.plant(engine, keys[2], tiers.fetch([keys[1]])[0][0])
    hit, _, _ = load(table, 130, None, layerwise=True)  # the stream finds it, then a whole read of what is left
    assert hit <= 130 and not forge.held(engine, keys[2])  # nothing past what the engine holds: recomputed


def test_a_mixed_windowed_hit_reads_from_disk_what_it_lays_and_lays_a_full_prefills_kv(stories, tmp_path):
    """Gemma 3's shape: full-attention layers beside sliding ones. A hit from the disk tier into the
    engine's blocks reads of each chunk before the window the full layers' planes alone (each range
    verified by its section sums), so it reads the bytes it lays (not every layer's), and every layer
    holds a full prefill's KV at each position it keeps. A section that is not read may be damaged
    without effect; a damaged one that is read is a miss, never laid. A blob read in part is never
    kept by a tier."""
    import glob

    from kdn import _core
    from kdn.engine.targets import NULL_BLOCK, PagedBlocks
    from test_paged import describe_layout, engine_layers

    model, _ = stories
    ids = random_ids(model, 300, seed=5)
    truth = [t.detach() for t in cache_to_kv_list(full_prefill(model, ids)[1])]
    writer = Engine(KDNConfig(chunk_size=64, disk_dir=str(tmp_path)), layout_of=layout_of)
    session = writer.session(model)
    tokens = session.tokens(ids)
    assert writer.save(session, tokens, truth) == 300
    writer.flush()
    reader = Engine(KDNConfig(chunk_size=64, disk_dir=str(tmp_path), memory_bytes=1), layout_of=layout_of)
    there = reader.session(model)
    layers, heads, dim, block = 5, 4, 8, 16
    table = list(range(1, 20))
    window = [NULL_BLOCK] * 12 + table[12:]  # the sliding layers keep positions 192.. only
    groups = (0, 1, 1, 0, 1)  # layers 0 and 3 full attention

    def load(whole: bool = False):
        paged = engine_layers("vec", layers, 24, heads, block, dim, torch.float32)
        blocks = PagedBlocks(paged, describe_layout("vec", paged[0]), [table, window], 0, groups)
        if whole:
            blocks.chunk_layers = lambda start, end: None  # as before: every layer of every chunk read
        before = reader.stats()["disk"]["read_bytes"]
        hit = reader.load(there, tokens, 299, blocks).hit
        return hit, reader.stats()["disk"]["read_bytes"] - before, paged, blocks

    hit, read, paged, blocks = load()
    assert hit == 299
    for layer in range(layers):  # every position a layer keeps: the full prefill's K and V
        first = 0 if groups[layer] == 0 else 192
        ids_kept = np.asarray((table if groups[layer] == 0 else window)[first // block:], dtype=np.int64)
        out = torch.empty(1, 2, len(ids_kept) * block, heads, dim)
        _core.gather_paged(paged[layer:layer + 1], ids_kept, out, layout=blocks.layout.as_dict())
        for side in (0, 1):
            want = truth[2 * layer + side][0, :, first:299].transpose(0, 1)
            assert torch.equal(out[0, side, :299 - first], want), (layer, side)
    laid = blocks.layer_tokens(299) * 2 * heads * dim * 4  # bytes of K and V laid, summed over layers
    whole_hit, whole_read, whole_paged, _ = load(whole=True)
    assert whole_hit == 299 and all(torch.equal(a, b) for a, b in zip(paged, whole_paged))
    assert read <= 1.2 * laid and whole_read >= 1.5 * read, (read, laid, whole_read)  # before 192: 2 layers, not 5
    # a partial blob is its reader's alone: no tier keeps it
    blob = reader.tier("disk").get_many([session.prefix_keys(tokens)[0]], [[(1, 2)]])[0]
    assert blob.partial and not reader.tier("memory").put(session.prefix_keys(tokens)[0], blob)
    # damage chunk 0: a byte of layer 1 (sliding: never read before the window), then of layer 0 (read)
    path = glob.glob(str(tmp_path / "**" / f"{session.prefix_keys(tokens)[0].hex()}*.kdnb"), recursive=True)[0]
    with open(path, "rb") as f:
        sections = _core.blob_sections(f.read(4096))["sections"]
    for plane, hits in ((2, 299), (0, 0)):
        with open(path, "r+b") as f:
            f.seek(sections[1 + plane][0] + 5)
            byte = f.read(1)
            f.seek(sections[1 + plane][0] + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert load()[0] == hits, plane
    assert not glob.glob(path)  # the damaged file read in part is dropped, as a whole read drops it
