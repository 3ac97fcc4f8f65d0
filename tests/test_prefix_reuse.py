"""Prefix reuse end to end: retrieve + suffix prefill equals a full prefill (logits and greedy output)."""

import logging
import warnings

import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig, layout
from kdn.models.tiny import tiny_model

# (arch, layers, heads, kv_heads, head_dim): GQA ratios 1, 2 and 4; head dims 8 to 64
CONFIGS = [
    ("llama", 2, 4, 2, 16),
    ("llama", 3, 8, 2, 8),
    ("mistral", 2, 4, 1, 32),
    ("mistral", 2, 4, 4, 16),
    ("qwen2", 2, 6, 2, 64),
    ("qwen2", 2, 4, 2, 32),
]
# (prompt length, chunk size): shorter than a chunk, aligned, unaligned, hit ending mid-prompt
LENGTHS = [(5, 8), (32, 8), (37, 8), (50, 16)]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def check_reuse(model, ids, chunk, tol):
    """Store a full prefill, retrieve for the same prompt, prefill the suffix, compare the logits."""
    kdn = KDN(KDNConfig(chunk_size=chunk))
    ref_logits, ref_cache = full_prefill(model, ids)
    kdn.store(model, ids, ref_cache)
    n = ids.shape[1]
    tail = n % chunk  # a trailing partial chunk is stored when a probe can find it
    expected_hit = n if tail >= min(KDNConfig().probe_step, chunk) else n - tail
    assert kdn.lookup(model, ids, limit=n) == expected_hit  # stored (lookup serves n - 1 by default)
    cache, hit = kdn.retrieve(model, ids, limit=n - 1)
    assert hit == min(expected_hit, n - 1)
    if hit == 0:
        assert cache is None
        return kdn
    assert cache.get_seq_length() == hit
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):  # the KV itself is a plain copy
        assert torch.equal(layer.keys, ref_layer.keys[:, :, :hit])
        assert torch.equal(layer.values, ref_layer.values[:, :, :hit])
    with torch.inference_mode():
        logits = model(ids[:, hit:], past_key_values=cache).logits[0, -1]
    torch.testing.assert_close(logits.float(), ref_logits.float(), atol=tol, rtol=0)
    return kdn


@pytest.mark.parametrize("arch,layers,heads,kv_heads,head_dim", CONFIGS)
@pytest.mark.parametrize("n,chunk", LENGTHS)
def test_tiny_models_fp32(arch, layers, heads, kv_heads, head_dim, n, chunk):
    model = tiny_model(arch, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=n)
    check_reuse(model, random_ids(model, n, seed=n), chunk, TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_half_precision(dtype, arch):
    model = tiny_model(arch, head_dim=32, dtype=dtype)
    check_reuse(model, random_ids(model, 45), 16, TOLERANCE[dtype])


@pytest.mark.parametrize("n,chunk", LENGTHS + [(300, 64)])
def test_stories260k(stories, n, chunk):
    model, _ = stories
    check_reuse(model, random_ids(model, n, seed=n), chunk, TOLERANCE[torch.float32])


def test_full_hit_still_prefills_last_token(stories):
    model, tokenizer = stories
    ids = tokenizer("Once upon a time, there was a little girl named Lily. She", return_tensors="pt").input_ids
    ids = ids[:, :16]
    kdn = KDN(KDNConfig(chunk_size=8))
    _, ref_cache = full_prefill(model, ids)
    kdn.store(model, ids, ref_cache)
    assert kdn.lookup(model, ids) == 15 and kdn.lookup(model, ids, limit=16) == 16
    assert kdn.retrieve(model, ids)[1] == 15  # by default the last token is the model's
    cache, hit = kdn.retrieve(model, ids, limit=16)  # the whole prompt, asked for
    assert hit == 16 and cache.get_seq_length() == 16
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    got = kdn.generate(model, ids, max_new_tokens=12, do_sample=False)
    stats = kdn.last_generate
    assert (stats["hit_tokens"], stats["prompt_tokens"]) == (15, 16) and stats["ttft_seconds"] > 0
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_generate_greedy_identical_and_reuses_generated_text(arch):
    model = tiny_model(arch, layers=2, heads=4, kv_heads=2, head_dim=16, seed=3)
    kdn = KDN(KDNConfig(chunk_size=8))
    ids = random_ids(model, 29, seed=1)
    expected = model.generate(ids, max_new_tokens=20, do_sample=False)
    first = kdn.generate(model, ids, max_new_tokens=20, do_sample=False)
    assert kdn.last_generate["hit_tokens"] == 0
    again = kdn.generate(model, ids, max_new_tokens=20, do_sample=False)
    assert kdn.last_generate["hit_tokens"] == 24
    assert torch.equal(first, expected) and torch.equal(again, expected)
    # a follow-up turn that extends the generated text hits the stored conversation too
    follow = torch.cat([expected, random_ids(model, 5, seed=2)], dim=1)
    reply = kdn.generate(model, follow, max_new_tokens=10, do_sample=False)
    assert kdn.last_generate["hit_tokens"] == 48
    assert torch.equal(reply, model.generate(follow, max_new_tokens=10, do_sample=False))


def test_return_dict_in_generate_is_honoured(tiny_llama):
    kdn = KDN(KDNConfig(chunk_size=8))
    ids = random_ids(tiny_llama, 20)
    out = kdn.generate(tiny_llama, ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 24)
    assert isinstance(kdn.generate(tiny_llama, ids, max_new_tokens=4, do_sample=False), torch.Tensor)


@pytest.mark.parametrize("stored", ["whole", "part", "none"])
def test_the_documented_hf_patterns_equal_plain_generate(stories, stored):
    """``retrieve`` leaves the last prompt token to the model by default, so both documented patterns
    are right whether the prompt is stored whole, in part or not at all: a forward of the rest (never
    an empty input), and ``model.generate(ids, past_key_values=cache)`` (a cache holding the whole
    prompt would make generate drop the first new token)."""
    model, _ = stories
    ids = random_ids(model, 70, seed=5)
    kdn = KDN(KDNConfig(chunk_size=16, probe_step=4))  # tails of >= 4 tokens are stored: hits to the token
    if stored != "none":
        n = 70 if stored == "whole" else 40
        kdn.store(model, ids[:, :n], full_prefill(model, ids[:, :n])[1])
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    cache, hit = kdn.retrieve(model, ids)
    assert hit == {"whole": 69, "part": 40, "none": 0}[stored]
    with torch.inference_mode():
        logits = model(ids[:, hit:], past_key_values=cache).logits[0, -1]
    assert int(logits.argmax()) == int(expected[0, 70])
    cache, hit = kdn.retrieve(model, ids)
    assert torch.equal(model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False), expected)


@pytest.mark.skipif(layout.CACHE_ARG == "past_key_values",
                    reason="transformers < 5.24 knows only `past_key_values`: nothing is deprecated")
def test_kdn_passes_the_cache_by_the_installed_transformers_name(tiny_llama, monkeypatch):
    """transformers 5.24 renamed forward's and generate's ``past_key_values`` to ``cache`` (the old name
    warns until 5.40 removes it): kdn's own calls — a stored miss, a verified hit, a KVzip deposit,
    a blend — use the installed name, so a user never sees the warning from kdn."""
    said = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, msg, *a, **k: said.append(str(msg)))
    kdn = KDN(KDNConfig(chunk_size=8, verify_fraction=1.0))
    ids = random_ids(tiny_llama, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = kdn.generate(tiny_llama, ids, max_new_tokens=4, do_sample=False)
        again = kdn.generate(tiny_llama, ids, max_new_tokens=4, do_sample=False)
        kdn.deposit(tiny_llama, ids[0, :32], edits=["kvzip:keep=0.5"])
        kdn.blend_generate(tiny_llama, [ids[0, :16].tolist(), ids[0, 16:32].tolist()], ids[0, 32:].tolist(),
                           max_new_tokens=2, do_sample=False)
    assert kdn.last_generate is not None and torch.equal(first, again)
    said += [str(w.message) for w in caught]
    assert [m for m in said if "past_key_values" in m] == []
