"""Attention steering at deposit (kdn.edits.steer, PASTA): the steered attention equals masking
the non-emphasized tokens out as alpha -> 0 and a plain hit at alpha = 1; readers that do not
name the edit get the exact KV and the model's own attention (bit-identical); the sidecars and
the head profile live in the tiers (a new process on the same disk reads them); bad input is a
typed error that stores nothing."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kdn import KDN, InvalidInputError, KDNConfig
from kdn.data import velmora
from kdn.edits import steer
from kdn.layout import cache_to_kv_list, kv_list_to_cache

CHUNK = 32


@pytest.fixture(scope="module")
def case(stories):
    """stories260K, one probe: (model, tokenizer, context, emphasized span, prompt ids, context ids)."""
    model, tokenizer = stories
    context, span, question, _ = steer.probe(velmora(), random.Random(1), words=60)
    ctx_ids = tokenizer(context)["input_ids"]
    ids = torch.tensor([ctx_ids + tokenizer(question, add_special_tokens=False)["input_ids"]])
    return model, tokenizer, context, span, ids, ctx_ids


def exact_cache(model, ctx_ids, hit):
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([ctx_ids[:hit]]), use_cache=True).past_key_values)
    return kv


def test_steering_every_head_towards_zero_equals_masking_the_other_tokens_out(case):
    """The reference: HF's own padding mask over the cached context, zero on the non-emphasized
    tokens, for the question's queries; steering every head of every layer with alpha=1e-30."""
    model, tokenizer, context, span, ids, ctx_ids = case
    n = len(ctx_ids)
    offsets = tokenizer(context, return_offsets_mapping=True)["offset_mapping"]
    emphasized = steer.token_mask([span], n, offsets)
    assert 0 < emphasized.sum() < n
    kv = exact_cache(model, ctx_ids, n)
    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    everything = [(layer, head) for layer in range(layers) for head in range(heads)]
    tail = ids[:, n:]
    with torch.inference_mode():
        with steer.applied(model, steer.biases(everything, 1e-30, emphasized, heads, layers)):
            steered = model(tail, past_key_values=kv_list_to_cache(model, list(kv))).logits[0]
        mask = torch.ones(1, ids.shape[1], dtype=torch.long)
        mask[0, :n] = torch.from_numpy(emphasized).long()
        masked = model(tail, past_key_values=kv_list_to_cache(model, list(kv)), attention_mask=mask).logits[0]
        plain = model(tail, past_key_values=kv_list_to_cache(model, list(kv))).logits[0]
    assert torch.allclose(steered, masked, atol=1e-4)
    assert not torch.allclose(steered, plain, atol=1e-2)  # it did something


def test_alpha_one_is_a_plain_hit(case):
    model, _, _, span, ids, ctx_ids = case
    n = len(ctx_ids)
    kv = exact_cache(model, ctx_ids, n)
    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    everything = [(layer, head) for layer in range(layers) for head in range(heads)]
    emphasized = steer.token_mask([(0, 3)], n)
    with torch.inference_mode():
        with steer.applied(model, steer.biases(everything, 1.0, emphasized, heads, layers)):
            steered = model(ids[:, n:], past_key_values=kv_list_to_cache(model, list(kv))).logits[0]
        plain = model(ids[:, n:], past_key_values=kv_list_to_cache(model, list(kv))).logits[0]
    assert torch.allclose(steered, plain, atol=1e-4)


def test_a_steered_generate_and_an_exact_reader_of_the_same_deposit(case, tmp_path):
    """The deposit stores the exact KV, a sidecar per full chunk and the model's head profile; a
    reader naming the edit is served the exact KV with the steering (and nothing it computes is
    stored); a reader that does not name it is bit-identical to a plain hit; a new process on the
    same disk folder reads the sidecars and the profile (nothing is profiled again)."""
    model, tokenizer, context, span, ids, ctx_ids = case
    spec = "steer:alpha=0.01,heads=4"
    config = KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv"), write_policy="write-through")
    writer = KDN(config)
    report = writer.deposit(model, context, edits=[spec], tokenizer=tokenizer, emphasize=[span])
    full_chunks = len(ctx_ids) // CHUNK
    assert report["edits"]["steer:alpha=0.01,heads=4"]["chunks"] == full_chunks
    writer.flush()
    plain = KDN(KDNConfig(chunk_size=CHUNK))
    plain.deposit(model, ctx_ids)
    reference = plain.generate(model, ids, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        ref_logits = model(ids).logits[0, -1]

    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=config.disk_dir))
    calls = []
    original = steer.profile
    steer.profile = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        steered = reader.generate(model, ids, edits=spec, max_new_tokens=6, do_sample=False)
    finally:
        steer.profile = original
    assert not calls, "the head profile was recomputed instead of read from the disk tier"
    stats = reader.last_generate
    assert stats["edit"] == spec and stats["hit_tokens"] >= full_chunks * CHUNK
    assert reader.stats()["integrity"]["refused_stores"] == 1  # KV computed under steering is not stored
    cache, hit = reader.retrieve(model, ids[0], edits=spec)
    biases = reader.last_retrieve["bias"]
    # the exact KV of the context; the biases over its full chunks (the tail is the question's chunk)
    assert hit == stats["hit_tokens"] and biases and all(b.shape[1] == full_chunks * CHUNK for b in biases.values())
    assert torch.allclose(reader.retrieve(model, ids[0])[0].layers[0].keys, cache.layers[0].keys)
    with torch.inference_mode():
        with steer.applied(model, biases):
            by_hand = model(ids[:, hit:], past_key_values=cache).logits[0, -1]
    cache, _ = reader.retrieve(model, ids[0], edits=spec)
    with torch.inference_mode():
        unsteered = model(ids[:, hit:], past_key_values=cache).logits[0, -1]
    assert torch.allclose(unsteered, ref_logits, atol=1e-4) and not torch.allclose(by_hand, ref_logits, atol=1e-3)
    assert steered.shape == reference.shape

    exact = reader.generate(model, ids, max_new_tokens=6, do_sample=False)  # no edit named: a plain hit
    assert torch.equal(exact, reference) and reader.last_generate.get("edit") is None
    other = reader.generate(model, ids, edits="kvzip:keep=0.5", max_new_tokens=6, do_sample=False)
    assert torch.equal(other, reference) and reader.last_generate.get("edit") is None


@pytest.mark.parametrize("spans, why", [(None, "give the emphasized spans"), ([(5, 3)], "outside the prompt"),
                                        ([(0, 10**6)], "outside the prompt"), ([("a",)], "a span is")])
def test_bad_spans_are_typed_errors_and_store_nothing(case, spans, why):
    model, tokenizer, context, _, _, _ = case
    kdn = KDN(KDNConfig(chunk_size=CHUNK))
    with pytest.raises(InvalidInputError, match=why):
        kdn.deposit(model, context, edits=["steer"], tokenizer=tokenizer, emphasize=spans)
    assert kdn.memory.stats()["entries"] == 0


def test_a_model_whose_attention_cannot_take_a_bias_is_refused():
    fake = SimpleNamespace(config=SimpleNamespace())
    with pytest.raises(InvalidInputError, match="cannot take a steering bias"):
        steer.check_model(fake)


def test_sidecar_flags_round_trip():
    flags = torch.rand(77).numpy() > 0.5
    assert (steer.unpack_flags(steer.pack_flags(flags)) == flags).all()


def test_kdn_deposit_reads_emphasized_spans_from_jsonl(tmp_path, case, capsys):
    """`kdn deposit docs.jsonl STORE --edit steer`: the spans of each line are the emphasis (its
    sidecars are in the store); a line with none is refused by name, after the ones before it."""
    import json

    from kdn.cli import main

    model, tokenizer, context, span, ids, ctx_ids = case
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"id": "a", "text": context, "emphasize": [list(span)]}) + "\n")
    store = tmp_path / "store"
    args = ["deposit", str(source), str(store), "--model", "stories260k", "--edit", "steer:heads=4",
            "--chunk-size", str(CHUNK)]
    assert main(args) == 0
    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(store)))
    reader.retrieve(model, ids[0], edits="steer:heads=4")
    assert reader.last_retrieve["edit"] == "steer:alpha=0.01,heads=4" and reader.last_retrieve["bias"]
    source.write_text(source.read_text() + json.dumps({"id": "b", "text": "Another text. " * 20}) + "\n")
    capsys.readouterr()
    assert main(args) == 2
    assert "document b: steer: give the emphasized spans" in capsys.readouterr().err


AUTO_TEXT = ("Once upon a time, there was a little girl named Lily. She was very happy. One day, she went to the park "
             "and saw a big ball.")


def test_auto_spans_are_the_sentences_the_answer_copied():
    from kdn.edits import autospans

    text = "The sky was grey. Tom found a gold key under the old bridge! He went home.\nThe end"
    assert autospans.sentences(text) == [(0, 17), (18, 60), (61, 74), (75, 82)]
    assert autospans.match(text, "tom found the gold key under a bridge") == [(18, 60)]
    assert autospans.match(text, "He went home. The sky was grey.") == [(0, 17), (61, 74)]  # text order
    assert autospans.match(text, "Nothing here went as planned.") == []  # "went" alone is not a sentence


def test_auto_spans_continue_the_deposits_kv_as_a_full_prefill_would(stories):
    """The model's answer is generated on the deposit's own KV; a greedy decode that prefills the
    text, the instruction and the answer so far at every step gives the same answer."""
    from kdn.edits import autospans

    model, tokenizer = stories
    ids = tokenizer(AUTO_TEXT)["input_ids"]
    with torch.inference_mode():
        kv = cache_to_kv_list(model(torch.tensor([ids]), use_cache=True).past_key_values)
    before = [t.clone() for t in kv]
    spans, answer = autospans.find(model, tokenizer, AUTO_TEXT, kv)
    assert all(torch.equal(a, b) for a, b in zip(kv, before))  # the deposit's KV is left as it was
    prompt = ids + tokenizer(autospans.INSTRUCTION, add_special_tokens=False)["input_ids"]
    out = []
    with torch.inference_mode():
        for _ in range(48):
            token = int(model(torch.tensor([prompt + out])).logits[0, -1].argmax())
            if token == model.config.eos_token_id:
                break
            out.append(token)
            said = tokenizer.decode(out).lstrip()
            if said and "\n" in said:
                break
    assert answer == tokenizer.decode(out).strip()
    assert spans == autospans.match(AUTO_TEXT, answer) and spans  # stories260K copies a sentence of this text


def test_deposit_emphasize_auto_stores_the_named_sentences(stories):
    """emphasize="auto": the sentences the model names are the emphasis a steered reader gets; a
    text in which it names none is refused and stores nothing."""
    model, tokenizer = stories
    chunk = 16
    kdn = KDN(KDNConfig(chunk_size=chunk))
    report = kdn.deposit(model, AUTO_TEXT, edits=["steer:heads=4"], tokenizer=tokenizer, emphasize="auto")
    spans = report["auto_spans"]["spans"]
    assert spans and all(AUTO_TEXT[a:b].endswith((".", "!", "?")) for a, b in spans)
    enc = tokenizer(AUTO_TEXT, return_offsets_mapping=True)
    full = len(enc["input_ids"]) // chunk * chunk
    expected = steer.token_mask(spans, len(enc["input_ids"]), enc["offset_mapping"])[:full]
    _, hit = kdn.retrieve(model, torch.tensor(enc["input_ids"] + [5]), edits="steer:heads=4")
    steered = [row for bias in kdn.last_retrieve["bias"].values() for row in bias if row.any()]
    assert hit >= full and steered and all(((row == 0).numpy() == expected).all() for row in steered)

    refused = KDN(KDNConfig(chunk_size=chunk))
    with pytest.raises(InvalidInputError, match="found no sentence"):
        refused.deposit(model, "Lily was very happy. She went to the park and saw a big ball. Max ran to the tree.",
                        edits=["steer"], tokenizer=tokenizer, emphasize="auto")
    assert refused.memory.stats()["entries"] == 0
