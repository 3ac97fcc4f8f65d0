"""KV editing at deposit (kdn.edits): kvzip pruning keeps positions, equals a full prefill at keep=1,
and an edited cache is its own fidelity class (never served to exact readers or other edits, in
memory, on disk and in Redis; nothing computed over it is stored)."""

from __future__ import annotations

import pytest
import torch

import forge
from kdn import KDN, InvalidInputError, KDNConfig, _core
from kdn.edits import kvzip, parse, steer, stored
from kdn.layout import cache_to_kv_list, kv_list_to_cache
from kdn.rope import inv_freq

CHUNK = 128


@pytest.fixture(scope="module")
def case(stories):
    model, _ = stories
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(10, 500, (400,), generator=g).tolist()  # 3 full chunks + a tail of 16 (served exact)
    question = torch.randint(10, 500, (20,), generator=g).tolist()
    return model, doc, torch.tensor([doc + question])


def last_logits(model, ids, cache, hit):
    with torch.inference_mode():
        return model(ids[:, hit:], past_key_values=cache).logits[0, -1]


def test_keep_one_is_a_full_prefill(case):
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    report = kdn.deposit(model, doc, edits=["kvzip:keep=1"])
    assert report["edits"]["kvzip:keep=1,sink=4"]["chunks"] == 3
    cache, hit = kdn.retrieve(model, ids[0], edits="kvzip:keep=1")
    assert hit == len(doc) and kdn.last_retrieve["edit"] == "kvzip:keep=1,sink=4"
    with torch.inference_mode():
        full = model(ids).logits[0, -1]
    assert torch.allclose(last_logits(model, ids, cache, hit), full, atol=1e-5)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(kdn.generate(model, ids, edits="kvzip:keep=1", max_new_tokens=8, do_sample=False), ref)


def masked_reference(model, kv, mask, token, position):
    """The next token's logits over the exact ``kv`` with the triples ``mask`` drops hidden by a
    -inf bias (each head sees only its kept tokens), the token at ``position``: what a pruned cache
    must compute, made without pooling, storing or padding."""
    layers, heads, n = mask.shape
    groups = model.config.num_attention_heads // heads
    bias = {layer: torch.where(mask[layer], 0.0, float("-inf")).repeat_interleave(groups, dim=0)
            for layer in range(layers)}
    with torch.inference_mode(), steer.applied(model, bias):
        return model(token, past_key_values=kv_list_to_cache(model, [t[:, :, :n].clone() for t in kv]),
                     position_ids=torch.tensor([[position]])).logits[0, -1]


def kept_whole_after(mask, tokens):
    """``mask`` ``[layers, heads, n]`` extended to ``tokens`` with every later triple kept: an edited
    hit serves the stored KV past its edited chunks exactly (the deposit's partial last chunk)."""
    layers, heads, n = mask.shape
    return torch.cat([mask, torch.ones(layers, heads, tokens - n, dtype=torch.bool)], dim=2)


def assert_served_as_masked_exact(model, kdn, doc, ids, cache, hit, mask):
    """The next token over the served ``cache`` (under the retrieve's bias) equals the exact cache
    of ``doc`` with the triples ``mask`` drops hidden (the tokens past the mask kept)."""
    mask = kept_whole_after(mask, hit)
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([doc]), use_cache=True).past_key_values)
    token = ids[:, hit:hit + 1]
    with torch.inference_mode(), steer.applied(model, kdn.last_retrieve["bias"] or {}):
        served = model(token, past_key_values=cache).logits[0, -1]
    assert torch.allclose(served, masked_reference(model, kv, mask, token, hit), atol=1e-5)


def test_a_pruned_cache_is_the_exact_cache_with_the_dropped_triples_masked(case):
    """keep=0.5: the served cache holds fewer rows (heads keep different counts: the budget is
    ranked across layers and heads), the next token is computed at position ``hit`` (not at the
    row count), and its logits equal the exact cache's with every dropped (layer, head, token)
    masked out; the deposit's partial last chunk (16 tokens, no edit covers it) is served too,
    exact, so the reader computes only its question."""
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
    cache, hit = kdn.retrieve(model, ids[0], edits="kvzip:keep=0.5")
    rows = cache_to_kv_list(cache)
    bias = kdn.last_retrieve["bias"]
    assert hit == len(doc) and cache.get_seq_length() == hit and rows[0].shape[2] < hit
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([doc]), use_cache=True).past_key_values)
    mask = kvzip.chosen(kvzip.scores(model, kv, doc, []), 3 * CHUNK, 0.5, 4)
    held = mask.sum(-1)
    assert abs(int(mask.sum()) - 0.5 * mask.numel()) <= 1 and held.min() < held.max()  # non-uniform
    token = ids[:, hit:hit + 1]
    with torch.inference_mode(), steer.applied(model, bias):
        served = model(token, past_key_values=cache).logits[0, -1]
    whole = kept_whole_after(mask, hit)
    assert torch.allclose(served, masked_reference(model, kv, whole, token, hit), atol=1e-5)
    assert not torch.allclose(served, masked_reference(model, kv, whole, token, rows[0].shape[2]), atol=1e-3)
    with torch.inference_mode():  # the padding rows matter: without their bias the answer differs
        unmasked = model(token, past_key_values=kdn.retrieve(model, ids[0], edits="kvzip:keep=0.5")[0]).logits[0, -1]
    assert not torch.allclose(unmasked, served, atol=1e-3)


def test_pooled_rows_come_back_in_place():
    """pool -> unpool over random masks (empty heads, full heads, skewed layers): each head gets
    exactly its kept rows, in position order, then zero padding (keys moved to their slot rows and
    back by RoPE: equal to float rounding)."""
    g = torch.Generator().manual_seed(0)
    layers, heads, chunk, dim = 3, 2, 16, 4
    kv = [torch.randn(1, heads, 2 * chunk, dim, generator=g) for _ in range(2 * layers)]
    for trial in range(20):
        density = torch.rand(layers, heads, 1, generator=g) ** 2
        mask = torch.rand(layers, heads, 2 * chunk, generator=g) < density
        mask[0, 0] = trial % 2 == 0  # one head keeps all or nothing
        if trial == 3:
            mask[:, :, chunk:] = False  # a chunk that kept nothing: one empty row
        chunks = [mask[:, :, c * chunk:(c + 1) * chunk] for c in range(2)]
        for m in chunks:  # each lane holds its own triples first, in token order; spills stay together
            src, rows = kvzip.slots(m).view(layers * heads, -1), kvzip.pooled_rows(m)
            for lane, own in enumerate(m.reshape(layers * heads, chunk)):
                mine = own.nonzero().flatten() + lane * chunk
                assert torch.equal(src[lane, : min(len(mine), rows)], mine[:rows])
            spilled = src[src // chunk != torch.arange(layers * heads)[:, None]]
            spilled = spilled[spilled >= 0]
            assert torch.equal(spilled, spilled.sort().values)
        freq = None if trial % 4 < 2 else 1.0 / 1000 ** (torch.arange(0, dim, 2) / dim)  # keys moved to rows and back
        parts = [(m, kvzip.pool(kv, m, c * chunk, freq)) for c, m in enumerate(chunks)]
        assert all(p[0].shape[2] == kvzip.pooled_rows(m) == max(1, -(-int(m.sum()) // (layers * heads)))
                   for m, p in parts)
        out, held = kvzip.unpool(parts, freq)
        assert torch.equal(held, mask.sum(-1))
        for layer in range(layers):
            for part in (0, 1):
                for head in range(heads):
                    want = kv[2 * layer + part][0, head][mask[layer, head]]
                    got = out[2 * layer + part][0, head]
                    same = torch.equal if freq is None else (lambda a, b: torch.allclose(a, b, atol=1e-5))
                    assert same(got[: len(want)], want) and not got[len(want):].any()


def test_sinks_are_always_kept(case):
    model, doc, _ = case
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([doc]), use_cache=True).past_key_values)
    scores = [s.clone() for s in kvzip.scores(model, kv, doc, [])]
    for s in scores:
        s[:, :4] = -1.0  # the lowest scores: kept anyway
    assert kvzip.chosen(scores, CHUNK, 0.1, 4)[:, :, :4].all()


def test_rows_are_only_read_with_their_own_mask(case):
    """A second deposit sharing the first chunks chooses other rows for them: its rows are filed
    under its own mask's address, so a reader of the first document gets consistent chunks (equal
    to the exact cache with the masks it read applied), never one deposit's rows under the other's
    mask."""
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    other = doc[: 2 * CHUNK] + [(t * 7) % 490 + 10 for t in doc[2 * CHUNK:]]
    kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
    edit = parse("kvzip:keep=0.5")
    session = kdn.session(model)
    keys = kdn.chunk_keys(model, doc)
    before = kdn.engine.sidecars.read(session, edit.address(keys[0]))
    kdn.deposit(model, other, edits=["kvzip:keep=0.5"])
    assert kdn.engine.sidecars.read(session, edit.address(keys[0])) != before  # other rows chosen
    layers, heads = session.layout.layers, session.layout.kv_heads
    mask = torch.cat([kvzip.unpack_mask(kdn.engine.sidecars.read(session, edit.address(k)), layers, heads, CHUNK)
                      for k in keys], dim=2)
    cache, hit = kdn.retrieve(model, ids[0], edits="kvzip:keep=0.5")
    assert_served_as_masked_exact(model, kdn, doc, ids, cache, hit, mask)


@pytest.mark.parametrize("tier", ["memory", "disk", "redis"])
def test_exact_readers_and_other_edits_are_never_served_an_edited_cache(case, tier, tmp_path, request):
    model, doc, ids = case
    if tier == "memory":
        config = KDNConfig(chunk_size=CHUNK)
    elif tier == "disk":
        config = KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv"), write_policy="write-through")
    else:
        config = KDNConfig(chunk_size=CHUNK, remote_url=request.getfixturevalue("redis_server").url)
    writer = KDN(config)
    writer.deposit(model, doc, edits=["kvzip:keep=0.3"])
    writer.flush()
    edited = parse("kvzip:keep=0.3")
    keys = writer.chunk_keys(model, doc)
    store = {"memory": writer.memory, "disk": writer.disk, "redis": writer.remote}[tier]
    assert all(store.contains(edited.address(k)) for k in keys), "the edited chunks' masks were not stored"
    assert writer.deposit(model, doc, edits=["kvzip:keep=0.3"])["edits"][edited.spec]["bytes"] > 0
    reader = writer if tier == "memory" else KDN(KDNConfig(chunk_size=CHUNK, **(
        {"disk_dir": config.disk_dir} if tier == "disk" else {"remote_url": config.remote_url})))
    with torch.inference_mode():
        full = model(ids).logits[0, -1]
    for edits in (None, "kvzip:keep=0.5"):  # an exact reader; a reader of another edit
        cache, hit = reader.retrieve(model, ids[0], edits=edits)
        assert hit == len(doc) and reader.last_retrieve.get("edit") is None
        assert cache_to_kv_list(cache)[0].shape[2] == hit
        assert torch.allclose(last_logits(model, ids, cache, hit), full, atol=1e-4)


def test_nothing_computed_over_an_edited_cache_is_stored(case):
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.deposit(model, doc, edits=["kvzip:keep=0.3"])
    kdn.generate(model, ids, edits="kvzip:keep=0.3", max_new_tokens=4, do_sample=False)
    assert kdn.last_generate["edit"] == "kvzip:keep=0.3,sink=4"
    assert kdn.stats()["integrity"]["refused_stores"] == 1
    assert kdn.lookup(model, ids[0], limit=ids.shape[1]) == len(doc)  # only the deposit's exact KV


@pytest.mark.parametrize("spec, why", [("pasta:alpha=0.01", "unknown edit"), ("steer:alpha=0", "alpha must be"),
                                       ("steer:heads=2.5", "heads must be"), ("kvzip:keep=0", "keep must be"),
                                       ("kvzip:keep=1.5", "keep must be"), ("kvzip:keep=abc", "must be a number"),
                                       ("kvzip:ratio=2", "unknown parameter"), ("", "an edit is"),
                                       ("kvzip:keep=0.3,keep=0.9", "keep is given twice")])
def test_bad_edits_are_typed_errors_and_store_nothing(case, spec, why):
    model, doc, _ = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    with pytest.raises(InvalidInputError, match=why):
        kdn.deposit(model, doc, edits=[spec])
    assert kdn.memory.stats()["entries"] == 0


def test_an_edit_that_fails_mid_deposit_stores_nothing(case, monkeypatch):
    model, doc, _ = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory while scoring")

    monkeypatch.setattr(kvzip, "scores", broken)
    with pytest.raises(RuntimeError, match="scoring"):
        kdn.deposit(model, doc, edits=["kvzip:keep=0.3"])
    assert kdn.memory.stats()["entries"] == 0 and kdn.lookup(model, doc, limit=len(doc)) == 0


def test_kdn_deposit_fills_a_store_resumably(tmp_path, stories, capsys):
    """`kdn deposit FOLDER STORE --edit ...`: every document's exact KV and edit stored; a second run
    skips them; a reader of the folder is served the edit only when it names it."""
    from kdn.cli import main

    model, tokenizer = stories
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = ["Once upon a time there was a little dog named Sam who liked to run in the park. " * 12,
             "Lily had a red ball. She played with her friend Tom every day in the garden. " * 12]
    for i, text in enumerate(texts):
        (docs / f"{i}.txt").write_text(text)
    store = tmp_path / "store"
    args = [str(docs), str(store), "--model", "stories260k", "--edit", "kvzip:keep=0.5", "--chunk-size", "128"]
    assert main(["deposit", *args]) == 0
    assert "2 documents deposited (0 already stored)" in capsys.readouterr().out
    assert main(["deposit", *args]) == 0
    assert "0 documents deposited (2 already stored)" in capsys.readouterr().out
    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(store)))
    ids = torch.tensor([tokenizer(texts[0])["input_ids"] + [5, 6, 7]])
    _, hit = reader.retrieve(model, ids[0])
    assert hit == ids.shape[1] - 3 and reader.last_retrieve.get("edit") is None
    _, hit = reader.retrieve(model, ids[0], edits="kvzip:keep=0.5")
    assert reader.last_retrieve["edit"] == "kvzip:keep=0.5,sink=4" and hit == ids.shape[1] - 3  # the tail exact


@pytest.mark.parametrize("extra, why", [(["--edit", "kvzip:keep=2"], "keep must be"),
                                        (["--edit", "prune"], "unknown edit"),
                                        (["--model", "no-such-model"], "unknown model")])
def test_kdn_deposit_refuses_bad_arguments_before_loading_a_model(tmp_path, capsys, extra, why):
    from kdn.cli import main

    (tmp_path / "a.txt").write_text("hello")
    args = ["deposit", str(tmp_path), str(tmp_path / "store"), "--model", "stories260k", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1


def test_pooled_keys_sit_at_their_slot_rows(case):
    """kvzip.turn moves keys as the model's RoPE does (blending's tested shift_keys): a pooled key is
    the key its token would have at the slot's row, which a codec undoing RoPE by row expects."""
    from kdn.rope import inv_freq, shift_keys

    model, doc, _ = case
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([doc[:64]]), use_cache=True).past_key_values)
    moved = [t.clone() for t in kv]
    shift_keys(model, moved, -37)
    keys = kv[0][0].reshape(-1, kv[0].shape[-1])
    turned = kvzip.turn(keys, torch.full((keys.shape[0],), -37), inv_freq(model))
    assert torch.allclose(turned, moved[0][0].reshape(-1, kv[0].shape[-1]), atol=1e-5)


def test_kvzip_into_a_kvtc_tier_without_per_head_bases_is_refused_before_anything_is_stored(case):
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK, memory_codec="kvtc"))
    _core.kvtc_unload_all()  # calibrations are per process: another test's may be loaded
    try:
        with pytest.raises(InvalidInputError, match="none is loaded"):
            kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
        kdn.calibrate(model, [doc[:300]], progress=False)  # joint bases: pooled or not, kvtc mixes heads
        with pytest.raises(InvalidInputError, match="joint bases"):
            kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
        assert kdn.lookup(model, ids[0], limit=ids.shape[1]) == 0
    finally:
        _core.kvtc_unload_all()


def test_a_kvtc_tier_files_masked_chunks_read_back_exact_where_stored_raw(case, tmp_path):
    """With a per-head kvtc calibration, a kvzip deposit into a kvtc disk tier files every chunk in
    the masked layout (its own rows, dropped ones zeroed, at the chunk's own position) in every
    tier: from the raw memory tier the hit is the exact cache with the dropped triples masked, then
    the partial last chunk exact; from the kvtc disk tier alone the same rows come back within
    kvtc's error (keys 0.17 where a chunk was coded as if at position 0, its keys unrotated by the
    wrong angles), every dropped triple stays out, and the partial last chunk, held there only
    coded, is not served after the edited chunks."""
    model, doc, ids = case
    g = torch.Generator().manual_seed(9)
    contexts = [torch.randint(10, 500, (300,), generator=g).tolist() for _ in range(2)]
    spec = "kvzip:keep=0.5"
    config = dict(chunk_size=CHUNK, disk_dir=str(tmp_path), disk_codec="kvtc:ratio=4")
    kdn = KDN(KDNConfig(**config, write_policy="write-through"))
    try:
        kdn.calibrate(model, contexts, per_head=True, progress=False)
        kdn.deposit(model, doc, edits=[spec])
        kdn.flush()
        session, edit = kdn.session(model), parse(spec)
        layers, heads = session.layout.layers, session.layout.kv_heads
        payloads = [kdn.engine.sidecars.read(session, edit.address(k))
                    for k in session.prefix_keys(session.tokens(doc))]
        masks = [kvzip.unpack_mask(p, layers, heads, CHUNK) for p in payloads]
        assert all(kvzip.is_masked(p, m) for p, m in zip(payloads, masks))
        mask = torch.cat(masks, -1)
        cache, hit = kdn.retrieve(model, ids[0], edits=spec)  # the memory tier: raw
        assert hit == len(doc)
        exact_rows = [t.clone() for t in cache_to_kv_list(cache)]  # before a forward extends the cache
        assert_served_as_masked_exact(model, kdn, doc, ids, cache, hit, mask)
        reader = KDN(KDNConfig(**config))  # the disk tier alone: kvtc
        coded, coded_hit = reader.retrieve(model, ids[0], edits=spec)
        # the partial last chunk is stored only coded there: not served after the edited chunks
        assert coded_hit == 3 * CHUNK
        rows = cache_to_kv_list(coded)[0].shape[2]
        assert torch.equal(reader.last_retrieve["bias"][0], kdn.last_retrieve["bias"][0][:, :rows])
        for got, want in zip(cache_to_kv_list(coded), exact_rows):  # keys too: coded at their own positions
            want = want[:, :, :rows]
            assert float((got - want).norm() / want.norm()) < 0.06
    finally:
        _core.kvtc_unload_all()


def test_a_missing_rows_blob_ends_the_edited_hit_there(case):
    """The second chunk's rows evicted (its mask still stored): the edited run is the first chunk
    only, then the exact KV stored past it (the rest of the document), equal to the exact cache with
    that chunk's dropped triples masked; the bytes counted stop there too."""
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
    edit, session = parse("kvzip:keep=0.5"), kdn.session(model)
    keys = kdn.chunk_keys(model, doc)
    whole = stored.stored_bytes(kdn.engine, model, doc, edit.spec)
    payload = kdn.engine.sidecars.read(session, edit.address(keys[1]))
    assert kdn.memory.remove(kvzip.rows_address(edit.address(keys[1]), payload))
    assert 0 < stored.stored_bytes(kdn.engine, model, doc, edit.spec) < whole / 2
    coded = KDN(KDNConfig(chunk_size=CHUNK, memory_codec="int4"))  # counted as stored: coded
    coded.deposit(model, doc, edits=["kvzip:keep=0.5"])
    assert 0 < stored.stored_bytes(coded.engine, model, doc, edit.spec) < whole / 4
    cache, hit = kdn.retrieve(model, ids[0], edits="kvzip:keep=0.5")
    assert hit == len(doc) and kdn.last_retrieve["edit"] == edit.spec
    assert cache_to_kv_list(cache)[0].shape[2] < CHUNK + (len(doc) - CHUNK) * 0.99  # the first chunk pruned
    layers, heads = session.layout.layers, session.layout.kv_heads
    mask = kvzip.unpack_mask(kdn.engine.sidecars.read(session, edit.address(keys[0])), layers, heads, CHUNK)
    assert_served_as_masked_exact(model, kdn, doc, ids, cache, hit, mask)


def test_an_edited_hit_reads_its_masks_then_its_rows_in_one_round_trip_each(case, monkeypatch):
    """Every chunk's mask in one fetch, then every chunk's rows in one: two round trips to a
    remote tier for the edited chunks, not two per chunk, then the exact rest (the deposit's record of
    its partial last chunk, that chunk by its key); the cache equals the chunks read one by one."""
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
    session, edit = kdn.session(model), parse("kvzip:keep=0.5")
    layers, heads = session.layout.layers, session.layout.kv_heads
    parts = []
    for key in kdn.chunk_keys(model, doc):
        payload = kdn.engine.sidecars.read(session, edit.address(key))
        mask = kvzip.unpack_mask(payload, layers, heads, CHUNK)
        rows = kdn.engine.segments.read(session, kvzip.rows_address(edit.address(key), payload), 0,
                                       kvzip.pooled_rows(mask))
        parts.append((mask, rows))
    one_by_one, _ = kvzip.unpool(parts, inv_freq(model))
    fetched = []
    tiers = forge.tiers(kdn.engine)
    fetch = tiers.fetch
    monkeypatch.setattr(tiers, "fetch", lambda keys, **kw: fetched.append(len(keys)) or fetch(keys, **kw))
    cache, hit, spec, _ = stored.read(kdn.engine, model, session.tokens(ids[0]), ids.shape[1], edit)
    assert hit == len(doc) and spec == edit.spec and fetched == [3, 3, 1, 1]
    for a, b in zip(cache_to_kv_list(cache), one_by_one):
        assert torch.equal(a[:, :, :b.shape[2]], b)


def test_a_deposit_without_the_exact_kv_serves_the_same_edited_cache_in_less_space(case, tmp_path):
    """keep_exact=False stores the edited chunks and the partial last chunk alone: an edited reader
    is served exactly what a full deposit serves it (rows, bias, hit), an exact reader misses the
    document, and the store holds fewer bytes."""
    model, doc, ids = case
    spec = "kvzip:keep=0.3"
    full = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "full"), write_policy="write-through"))
    edited = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "edited"), write_policy="write-through"))
    assert full.deposit(model, doc, edits=[spec])["exact_tokens"] == len(doc)
    assert edited.deposit(model, doc, edits=[spec], keep_exact=False)["exact_tokens"] == len(doc)  # via the edit
    full.flush()
    edited.flush()
    readers = [KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / name))) for name in ("full", "edited")]
    served = [reader.retrieve(model, ids[0], edits=spec) for reader in readers]
    assert served[0][1] == served[1][1] == len(doc)
    for a, b in zip(cache_to_kv_list(served[0][0]), cache_to_kv_list(served[1][0])):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(readers[0].last_retrieve["bias"].values(),
                                                  readers[1].last_retrieve["bias"].values()))
    assert readers[1].lookup(model, ids[0]) == 0 and readers[0].lookup(model, ids[0]) == len(doc)
    on_disk = [sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())
               for name in ("full", "edited")]
    assert on_disk[1] < 0.5 * on_disk[0], on_disk
    with pytest.raises(InvalidInputError, match="keep_exact"):
        edited.deposit(model, doc, edits=["steer:alpha=0.01"], keep_exact=False)


def test_an_edited_reader_is_served_exact_kv_only_up_to_the_end_of_the_deposit(case):
    """An exact reader stores the document and its question after the deposit: the KV of the
    question (computed over the whole document) is never served after the edited chunks; the
    edited hit ends where the deposit did."""
    model, doc, ids = case
    spec = "kvzip:keep=0.5"
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.deposit(model, doc, edits=[spec])
    kdn.generate(model, ids, max_new_tokens=2, do_sample=False)  # an exact reader: doc + question stored
    assert kdn.lookup(model, ids[0]) == ids.shape[1] - 1
    cache, hit = kdn.retrieve(model, ids[0], edits=spec)
    assert hit == len(doc) and kdn.last_retrieve["edit"] == parse(spec).spec
    other = torch.tensor([doc[:-1] + [doc[-1] + 1] + ids[0, len(doc):].tolist()])  # the deposit's tail differs
    assert kdn.retrieve(model, other[0], edits=spec)[1] == 3 * CHUNK  # its tail is not the deposit's
