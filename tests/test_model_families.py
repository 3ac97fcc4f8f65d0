"""The models people serve beyond plain full attention (issue 63), in the HF facade: sliding-window
models (Mistral-style, every layer windowed; Gemma 3's five sliding layers to one full) store and
hit prompts far longer than their window, and every hit is a full prefill's logits."""

import pytest
import torch
import transformers

from conftest import full_prefill, random_ids
from kdn import KDN, KDNConfig
from kdn.layout import cache_arg, cache_to_kv_list, full_kv, prefill_cache, windowed

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


def _hybrids():
    from model_families import granite_hybrid_config, qwen3_next_config

    return {"granite-4-h": granite_hybrid_config, "qwen3-next": qwen3_next_config}


def _greedy(generate, ids):
    out = generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), out.scores[0][0], out


@pytest.mark.parametrize("family", ["granite-4-h", "qwen3-next"])
def test_a_hybrid_model_resumes_from_its_stored_state_with_a_full_prefills_answers(family, tmp_path):
    """Issue 63: Granite-4-H's layout (mamba2 beside attention) and Qwen3-Next's (gated delta-net beside
    attention), random weights. A prompt's attention KV is stored in chunks and its recurrent state at
    its last chunk boundary (256 of 312 tokens); another question over the same document resumes
    there, and a new KDN over the same disk too, each answering a full prefill's greedy tokens with
    its first logits within 1e-4. What is stored reads back as a full prefill of those 256 tokens
    computes it: every attention row and the state's bytes."""
    from kdn.integrations.hf.hybrid import load, pack_state, state_address
    from model_families import random_model

    model = random_model(_hybrids()[family]())
    doc = random_ids(model, 300, seed=1)[0].tolist()
    prompts = [torch.tensor([doc + random_ids(model, n, seed=s)[0].tolist()]) for n, s in ((12, 2), (9, 3))]
    config = KDNConfig(chunk_size=64, disk_dir=str(tmp_path / "kv"))
    writer, hits = KDN(config), []
    for ids in prompts + [prompts[1]]:
        want, first, _ = _greedy(model.generate, ids)
        got, served, out = _greedy(lambda i, **kw: writer.generate(model, i, **kw), ids)
        assert got == want and (served - first).abs().max() < 1e-4
        hits.append(out["kdn_stats"]["hit_tokens"])
    assert hits == [0, 256, 256]
    reader = KDN(config)  # a new engine: the disk tier alone holds the prefix
    assert reader.lookup(model, prompts[1][0]) == 256
    want, first, _ = _greedy(model.generate, prompts[1])
    got, served, out = _greedy(lambda i, **kw: reader.generate(model, i, **kw), prompts[1])
    assert got == want and (served - first).abs().max() < 1e-4 and out["kdn_stats"]["hit_tokens"] == 256

    session = reader.session(model)
    cache, served_load = load(reader.engine, session, model, session.tokens(prompts[0][0]), 256)
    reference = prefill_cache(model, prompts[0][:, :256], **cache_arg(transformers.DynamicCache(config=model.config)))
    assert served_load.hit == 256 and len(session.layout.recurrent) == 2
    for i, (a, b) in enumerate(zip(cache.layers, reference.layers)):
        if i not in session.layout.recurrent:
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    key = session.prefix_keys(session.tokens(prompts[0][0, :256]))[-1]
    assert reader.engine.sidecars.read(session, state_address(key)) == pack_state(reference, session.layout)
    report = reader.engine.audit(session, lambda ids: full_kv(model, ids), list(reader.disk.keys()))  # `kdn verify`
    assert report.checked >= 1 and report.compared >= 4 and not report.mismatches


def test_a_hybrid_hit_without_a_usable_state_is_recomputed_and_tenants_share_nothing(tmp_path):
    """Issue 63: a hybrid prefix whose state is gone, fails its checksum or is no state of this model
    (a planted one, sealed right: garbage, or the right number of tensors of the wrong shapes) is a
    miss (the chunks alone are never served: the recurrent layers would start from nothing)
    with a full prefill's answer, then stored again; a namespace sees none of another's prefixes."""
    from kdn.integrations.hf.hybrid import state_address
    from model_families import random_model

    model = random_model(_hybrids()["granite-4-h"]())
    ids = random_ids(model, 150, seed=4)
    want, first, _ = _greedy(model.generate, ids)
    cache = KDN(KDNConfig(chunk_size=64))
    cache.generate(model, ids, max_new_tokens=2, namespace="a")
    session = cache.session(model, "a")
    address = state_address(session.prefix_keys(session.tokens(ids[0]))[-1])
    assert cache.lookup(model, ids[0], namespace="a") == 128 and cache.lookup(model, ids[0], namespace="b") == 0
    wrong = (b"\x00\x03" + b"\x01\x00\x00\x00" * 3 + b"\x00" * 4) * 4  # four tensors, as many as its, each [1, 1, 1]
    for harm in ("drop", "flipped byte", "not a state", "wrong shapes"):
        if harm == "drop":
            cache.engine.sidecars.drop(address)
        elif harm == "flipped byte":  # caught by the sidecar's checksum
            blob = bytearray(cache.memory.get(address))
            blob[-5] ^= 0x40
            cache.memory.put(address, bytes(blob))
        else:  # sealed as a sidecar of this model and address (a planted one), but no state of this model
            cache.engine.sidecars.write(session, address, wrong if harm == "wrong shapes"
                                        else b"\x00\x01\x04\x00\x00\x00" + b"\x00" * 16)
        assert cache.lookup(model, ids[0], namespace="a") == 0
        got, served, out = _greedy(lambda i, **kw: cache.generate(model, i, namespace="a", **kw), ids)
        assert got == want and (served - first).abs().max() < 1e-4 and out["kdn_stats"]["hit_tokens"] == 0
        assert cache.lookup(model, ids[0], namespace="a") == 128  # stored again


def test_calls_a_hybrid_model_is_not_served_by_and_unresumable_hybrids_are_refused_by_name():
    """Issue 63: a hybrid model is served by generate alone; store, retrieve, deposit, blend,
    calibration and beams are InvalidInputErrors naming it, before anything is stored. Hybrids whose
    HF forward does not resume a prefill exactly (Jamba: measured in the test below) or that mix
    mamba and attention in one layer (Falcon-H1), and state-space models without attention (Mamba),
    are refused by name; attention-only families have no recurrent layers."""
    from kdn import InvalidInputError
    from kdn.layout import layout_from_config, recurrent_layers
    from model_families import random_model

    model = random_model(_hybrids()["granite-4-h"]())
    ids = random_ids(model, 40)
    cache = KDN(KDNConfig(chunk_size=16))
    with torch.no_grad():
        kv = model(ids, use_cache=True).past_key_values
    for call in (lambda: cache.store(model, ids, kv), lambda: cache.retrieve(model, ids),
                 lambda: cache.deposit(model, ids[0].tolist()), lambda: cache.store_segments(model, [[5, 6, 7]]),
                 lambda: cache.calibrate(model, [ids[0].tolist()]),
                 lambda: cache.generate(model, ids, max_new_tokens=2, num_beams=2)):
        with pytest.raises(InvalidInputError, match="hybrid model"):
            call()
    assert cache.stats()["memory"]["used_bytes"] == 0
    for config in (transformers.JambaConfig(), transformers.MambaConfig(), transformers.FalconH1Config()):
        with pytest.raises(InvalidInputError, match="hybrid or recurrent model"):
            layout_from_config(config, torch.float32)
    for config in (transformers.LlamaConfig(), transformers.Gemma3TextConfig(), transformers.MistralConfig(),
                   transformers.Qwen2Config()):
        assert recurrent_layers(config.get_text_config()) == [], type(config).__name__


@pytest.mark.parametrize("family,resumes", [("granite-4-h", True), ("qwen3-next", True), ("jamba", False)])
def test_which_hybrids_hf_resumes_exactly_from_a_cached_state(family, resumes):
    """What kdn's list of served hybrids (``kdn.layout.RESUMING_HYBRIDS``) rests on: a prefill in two
    pieces through HF's cache gives one pass's last logits for Granite-4-H and Qwen3-Next, not for
    Jamba (transformers 5.24: its mamba layers restart a multi-token prefill from an empty state).
    When a transformers release changes that, this test says so."""
    from transformers import DynamicCache

    from kdn.layout import RESUMING_HYBRIDS
    from model_families import random_model

    configs = {**_hybrids(), "jamba": lambda: transformers.JambaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16)}
    model = random_model(configs[family]())
    ids = random_ids(model, 100, seed=5)
    with torch.no_grad():
        whole = model(ids, **cache_arg(DynamicCache(config=model.config))).logits[0, -1]
        pieces = DynamicCache(config=model.config)
        model(ids[:, :64], **cache_arg(pieces))
        resumed = model(ids[:, 64:], **cache_arg(pieces)).logits[0, -1]
    assert bool((whole - resumed).abs().max() < 1e-4) == resumes
    assert (model.config.model_type in RESUMING_HYBRIDS) == resumes


@pytest.mark.parametrize("family", ["granite-4-h", "qwen3-next"])
def test_a_hybrid_answers_the_models_own_tokens_at_every_prompt_length_miss_hit_and_new_process(family, tmp_path):
    """Issue 80's canary: prompts of 40 (under a chunk), 64 and 65 (at a boundary and past it), 128
    and 200 tokens over one document, each asked as a miss, then as a hit, then by a new KDN over the
    same disk: every answer the model's own greedy tokens with its first logits within 1e-4."""
    from model_families import random_model

    model = random_model(_hybrids()[family]())
    config = KDNConfig(chunk_size=64, disk_dir=str(tmp_path / "kv"))
    doc = random_ids(model, 200, seed=11)[0].tolist()
    writer = KDN(config)
    prompts = [torch.tensor([doc[:n]]) for n in (40, 64, 65, 128, 200)]
    for ids in prompts:
        want, first, _ = _greedy(model.generate, ids)
        for _ in ("a miss (or a shorter stored prefix)", "a hit"):
            got, served, _ = _greedy(lambda i, **kw: writer.generate(model, i, **kw), ids)
            assert got == want and (served - first).abs().max() < 1e-4, (ids.shape[1], writer.last_generate)
    reader = KDN(config)  # a new process: the disk alone
    for ids in prompts:
        want, first, _ = _greedy(model.generate, ids)
        got, served, out = _greedy(lambda i, **kw: reader.generate(model, i, **kw), ids)
        assert got == want and (served - first).abs().max() < 1e-4, (ids.shape[1], out["kdn_stats"])
    assert reader.lookup(model, prompts[-1][0]) == 192
