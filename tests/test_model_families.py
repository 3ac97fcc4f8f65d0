"""The models people serve beyond plain full attention (issue 63), in the HF facade: sliding-window
models (Mistral-style, every layer windowed; Gemma 3's five sliding layers to one full) store and
hit prompts far longer than their window, and every hit is a full prefill's logits."""

import pytest
import torch
import transformers

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig
from kdn.layout import cache_to_kv_list, prefill_cache, windowed

CHUNK = 16
WINDOW = 24


def sliding(family: str):
    """A small random-weight model of ``family`` with a 24-token window."""
    torch.manual_seed(0)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, max_position_embeddings=1024)
    if family == "mistral":
        config = transformers.MistralConfig(num_hidden_layers=3, **shape)
    else:
        config = transformers.Gemma3TextConfig(num_hidden_layers=6, **shape)  # layers 0-4 sliding, 5 full
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_model_stores_and_hits_prompts_longer_than_its_window(family, tmp_path):
    """A 5-window prompt: the first generate stores it (every layer's KV at every position: a hit
    ending anywhere needs the window before it), the second is a hit with the model's own tokens,
    and a new process's exact read of it gives a full prefill's logits, at the end of the prompt and
    at a shorter prefix (a hit ending mid-document)."""
    model = sliding(family)
    assert windowed(model.config)
    ids = random_ids(model, 5 * WINDOW + 3, seed=1)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    cache = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")))
    for hit in (0, (ids.shape[1] - 1) // CHUNK * CHUNK):
        out = cache.generate(model, ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, expected) and cache.last_generate["hit_tokens"] == hit
    cache.flush()
    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv")))
    for prompt in (ids, ids[:, :3 * CHUNK + 5]):
        kv, hit = reader.retrieve(model, prompt)
        assert hit == (prompt.shape[1] - 1) // CHUNK * CHUNK
        with torch.inference_mode():
            logits = model(prompt[:, hit:], past_key_values=kv).logits[0, -1]
        torch.testing.assert_close(logits, full_prefill(model, prompt)[0], rtol=1e-4, atol=1e-4)


def test_the_stored_kv_of_a_sliding_layer_is_its_kv_at_every_position():
    """What kdn prefills for storing keeps every position of a sliding layer (HF's own cache keeps the
    window's last tokens only): row for row, the KV the model computes for each prefix."""
    model = sliding("gemma3")
    ids = random_ids(model, 4 * WINDOW, seed=2)
    kept = cache_to_kv_list(prefill_cache(model, ids))
    assert all(t.shape[2] == ids.shape[1] for t in kept)
    own = cache_to_kv_list(full_prefill(model, ids)[1])
    assert own[0].shape[2] < ids.shape[1]  # HF's sliding layer: the window only
    for a, b in zip(kept, cache_to_kv_list(prefill_cache(model, ids[:, :2 * WINDOW]))):
        torch.testing.assert_close(a[:, :, :2 * WINDOW], b, rtol=1e-5, atol=1e-5)


def mla():
    """A small random-weight DeepSeek-V2 (MLA: a 64-dim latent and a 16-dim RoPE key per token)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("delivery", ["layerwise", "whole"])
def test_an_mla_model_stores_its_latent_once_and_hits_with_a_full_prefills_logits(delivery, tmp_path):
    """HF's cache of DeepSeek-V2 holds the latent (64) and the RoPE key (16) per token and layer; kdn
    stores exactly that vector (80 values, not 4 heads x (48 + 32)), and a new process's hit, whole or
    layer-wise, gives a full prefill's logits at the prompt's end and mid-document."""
    model = mla()
    ids = random_ids(model, 5 * CHUNK + 3, seed=3)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    cache = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv"), delivery=delivery))
    for hit in (0, (ids.shape[1] - 1) // CHUNK * CHUNK):
        out = cache.generate(model, ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, expected) and cache.last_generate["hit_tokens"] == hit
    session = cache.session(model)
    assert session.layout.latent and session.layout.bytes_per_token() == 3 * (64 + 16) * 4
    cache.flush()
    reader = KDN(KDNConfig(chunk_size=CHUNK, disk_dir=str(tmp_path / "kv"), delivery=delivery))
    for prompt in (ids, ids[:, :3 * CHUNK + 5]):
        kv, hit = reader.retrieve(model, prompt)
        assert hit == (prompt.shape[1] - 1) // CHUNK * CHUNK
        own = full_prefill(model, prompt[:, :hit])[1]
        for mine, theirs in zip(kv.layers, own.layers):  # the stored vector is HF's latent and RoPE key, exactly
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        with torch.inference_mode():
            logits = model(prompt[:, hit:], past_key_values=kv).logits[0, -1]
        torch.testing.assert_close(logits, full_prefill(model, prompt)[0], rtol=1e-4, atol=1e-4)


def test_edits_on_an_mla_model_are_refused_by_name():
    from kdn import InvalidInputError

    model = mla()
    with pytest.raises(InvalidInputError, match="MLA"):
        KDN(KDNConfig(chunk_size=CHUNK)).deposit(model, random_ids(model, 40)[0].tolist(), edits=["kvzip"])


@pytest.mark.parametrize("codec", ["lossless", "int4", "cachegen", "kvtc"])
def test_every_codec_codes_an_mla_models_latent(codec):
    """The latent vector is two planes of one head to the codecs: each stores and serves the hit
    (lossless: a full prefill's logits; kvtc fit on the vector as stored, RoPE key included)."""
    model = mla()
    ids = random_ids(model, 5 * CHUNK + 3, seed=3)
    cache = KDN(KDNConfig(chunk_size=CHUNK, memory_codec=codec))
    if codec == "kvtc":
        cache.calibrate(model, [random_ids(model, 200, seed=9)[0].tolist()], progress=False)
    cache.generate(model, ids, max_new_tokens=1, do_sample=False)
    kv, hit = cache.retrieve(model, ids)
    assert hit == 5 * CHUNK
    with torch.inference_mode():
        logits = model(ids[:, hit:], past_key_values=kv).logits[0, -1]
    expected = full_prefill(model, ids)[0]
    if codec == "lossless":
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    else:
        assert 0 < (logits - expected).abs().max() < 1.0  # lossy, and close: the codec coded the vector


def test_a_hybrid_or_recurrent_model_is_refused_by_name_before_anything_runs():
    """Issue 63: kdn stores attention KV, not recurrent state: a Granite-4-H-like model (mamba layers
    beside attention) is an InvalidInputError naming its layers at generate and store, not an
    IndexError from inside HF's cache; Qwen3-Next's, Jamba's and Mamba's configs are named the same
    way, attention-only families (sliding windows included) are not."""
    from kdn import InvalidInputError
    from kdn.layout import recurrent_layers
    from model_families import granite_hybrid_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(granite_hybrid_config(), dtype=torch.float32).eval()
    ids = random_ids(model, 40)
    cache = KDN(KDNConfig(chunk_size=16))
    with pytest.raises(InvalidInputError, match="hybrid or recurrent model"):
        cache.generate(model, ids, max_new_tokens=2)
    with torch.no_grad():
        kv = model(ids, use_cache=True).past_key_values
    with pytest.raises(InvalidInputError, match="linear_attention|mamba"):
        cache.store(model, ids, kv)
    assert cache.stats()["memory"]["used_bytes"] == 0
    for config in (transformers.Qwen3NextConfig(), transformers.JambaConfig(), transformers.MambaConfig()):
        assert recurrent_layers(config.get_text_config()), type(config).__name__
    for config in (transformers.LlamaConfig(), transformers.Gemma3TextConfig(), transformers.MistralConfig(),
                   transformers.Qwen2Config()):
        assert recurrent_layers(config.get_text_config()) == [], type(config).__name__
