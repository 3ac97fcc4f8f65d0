"""KV editing at deposit (kdn.edits): kvzip pruning keeps positions, equals a full prefill at keep=1,
and an edited cache is its own fidelity class (never served to exact readers or other edits, in
memory, on disk and in Redis; nothing computed over it is stored)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kdn import KDN, InvalidInputError, KDNConfig
from kdn.edits import kvzip, parse
from kdn.layout import cache_to_kv_list

CHUNK = 128


@pytest.fixture(scope="module")
def case(stories):
    model, _ = stories
    g = torch.Generator().manual_seed(3)
    doc = torch.randint(10, 500, (400,), generator=g).tolist()  # 3 full chunks + a tail of 16
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
    assert hit == 3 * CHUNK and kdn.last_retrieve["edit"] == "kvzip:keep=1,sink=4"
    with torch.inference_mode():
        full = model(ids).logits[0, -1]
    assert torch.allclose(last_logits(model, ids, cache, hit), full, atol=1e-5)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(kdn.generate(model, ids, edits="kvzip:keep=1", max_new_tokens=8, do_sample=False), ref)


def test_a_pruned_cache_keeps_the_original_positions(case):
    """keep=0.5: the served cache holds half the rows, and the next token is computed at position
    ``hit`` (not at the row count): equal to a hand-built cache of the same rows with explicit
    positions, and different from the same rows read at the row count."""
    model, doc, ids = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    kdn.deposit(model, doc, edits=["kvzip:keep=0.5"])
    cache, hit = kdn.retrieve(model, ids[0], edits="kvzip:keep=0.5")
    rows = cache_to_kv_list(cache)
    assert rows[0].shape[2] == 3 * round(0.5 * CHUNK) and cache.get_seq_length() == hit == 3 * CHUNK
    # the reference: the same selection made by hand from a full prefill
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([doc]), use_cache=True).past_key_values)
    scores = kvzip.scores(model, kv, doc, [])
    parts = [kvzip.prune(kv, scores, i * CHUNK, (i + 1) * CHUNK, 0.5, 4) for i in range(3)]
    hand = [torch.cat([p[j] for p in parts], dim=2) for j in range(len(kv))]
    for got, want in zip(rows, hand):
        assert torch.equal(got, want)
    token = ids[:, hit:hit + 1]

    def at(position):
        ref = DynamicCache()
        for layer in range(len(hand) // 2):
            ref.update(hand[2 * layer], hand[2 * layer + 1], layer)
        with torch.inference_mode():
            return model(token, past_key_values=ref, position_ids=torch.tensor([[position]])).logits[0, -1]

    with torch.inference_mode():
        served = model(token, past_key_values=cache).logits[0, -1]
    assert torch.allclose(served, at(hit), atol=1e-5)
    assert not torch.allclose(served, at(rows[0].shape[2]), atol=1e-3)


def test_sinks_are_always_kept(case):
    model, doc, _ = case
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([doc]), use_cache=True).past_key_values)
    scores = [s.clone() for s in kvzip.scores(model, kv, doc, [])]
    scores[0][:, :4] = -1.0  # the lowest scores: kept anyway
    assert (kvzip.select(scores[0], 0, CHUNK, 0.1, 4)[:, :4] == torch.arange(4)).all()


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
    assert all(store.contains(edited.address(k)) for k in keys), "the edited chunks were not stored"
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
                                       ("kvzip:ratio=2", "unknown parameter"), ("", "an edit is")])
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
    assert reader.last_retrieve["edit"] == "kvzip:keep=0.5,sink=4" and hit == (hit // CHUNK) * CHUNK > 0


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
