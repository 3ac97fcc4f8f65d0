"""Model loaders: stories260K weights and tokenizer against llama2.c references; SmolLM2 reuse."""

from pathlib import Path

import pytest
import torch

import kdn
from conftest import full_prefill
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.models.stories260k import model_dir, read_tokenizer_pieces

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park. One day, she saw a big, red ball!",
    "Tom said: \"Hello?\"  Two  spaces, tabs\tand ünïcödé — 123.",
    "a",
]


def llama2c_encode(pieces, text: str) -> list[int]:
    """Reference: llama2.c encode() (dummy-prefix space, per-char lookup, byte fallback, score merges)."""
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    ids = [vocab[b" "]] if text else []
    for ch in text:
        raw = ch.encode("utf-8")
        ids += [vocab[raw]] if raw in vocab else [b + 3 for b in raw]
    while True:
        best, best_score, best_id = -1, -1e10, -1
        for i in range(len(ids) - 1):
            merged = pieces[ids[i]][0] + pieces[ids[i + 1]][0]
            if merged in vocab and pieces[vocab[merged]][1] > best_score:
                best, best_score, best_id = i, pieces[vocab[merged]][1], vocab[merged]
        if best < 0:
            return [1] + ids
        ids[best : best + 2] = [best_id]


@pytest.mark.parametrize("text", TEXTS)
def test_stories_tokenizer_matches_llama2c(stories, text):
    _, tokenizer = stories
    pieces = read_tokenizer_pieces(model_dir() / "tok512.bin")
    ids = tokenizer(text).input_ids
    assert ids == llama2c_encode(pieces, text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_stories_greedy_sample_matches_llama2c_doc(stories):
    model, tokenizer = stories
    out = model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside")


def test_stories_nll_is_low_on_its_own_sample(stories):
    model, tokenizer = stories
    ids = tokenizer("Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
                    return_tensors="pt").input_ids
    with torch.inference_mode():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 1.0  # README: 0.32 nats/token on the first sentences; random weights give ~6


def test_stories260k_ships_in_the_package_and_loads_from_any_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KDN_SHARED", str(tmp_path / "nothing-here"))
    monkeypatch.chdir(tmp_path)
    model, _ = kdn.models.load("stories260k")
    assert model.config.num_hidden_layers == 5
    assert (model_dir() / "LICENSE").read_text().startswith("MIT License")
    assert Path(kdn.__file__).parent in model_dir().parents


def test_an_unknown_model_lists_the_names_and_accepts_a_checkpoint_folder(tmp_path, stories):
    with pytest.raises(InvalidInputError, match="stories260k, smollm2-135m.*HF checkpoint"):
        kdn.models.load("gpt-9")
    model, tokenizer = stories
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, tok = kdn.models.load(str(tmp_path))
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert tok(["Once upon a time"]).input_ids[0] == ids[0].tolist()


@pytest.mark.slow
def test_checkpoint_dir_converts_once_the_folder_load_reads(smollm2, tmp_path, monkeypatch):
    """An engine's checkpoint folder (vLLM's) on a machine that never loaded the model: converted on
    the call, and it holds the very weights ``load`` gives."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no converted folder here yet
    folder = kdn.models.checkpoint_dir("smollm2-135m")
    assert tmp_path in folder.parents and (folder / "config.json").is_file()
    model, tokenizer = smollm2
    loaded, _ = kdn.models.load(str(folder))
    ids = tokenizer("The door code of room 7 is", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(InvalidInputError, match="no checkpoint folder"):
        kdn.models.checkpoint_dir("stories260k")


@pytest.mark.slow
def test_smollm2_prefix_reuse_matches_full_prefill(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    text = " ".join(f"Fact {i}: the door code of room {i} is {i * 37 % 1000}." for i in range(60))
    ids = tokenizer(text + " Question: what is the door code of room 7?", return_tensors="pt").input_ids
    cache_kdn = KDN(KDNConfig(chunk_size=128))
    ref_logits, ref_cache = full_prefill(model, ids)
    cache_kdn.store(model, ids, ref_cache)
    cache, hit = cache_kdn.retrieve(model, ids, limit=ids.shape[1] - 1)
    assert ids.shape[1] % 128 >= 16 and hit == ids.shape[1] - 1  # whole chunks and the stored tail
    with torch.inference_mode():
        logits = model(ids[:, hit:], past_key_values=cache).logits[0, -1]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(cache_kdn.generate(model, ids, max_new_tokens=16, do_sample=False), expected)
    assert cache_kdn.last_generate["hit_tokens"] == hit
