"""Blending: RoPE re-rotation vs direct computation (CPU, CUDA twin), selective recompute vs full
prefill, recompute counts, segment order and repeats, refusals."""

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import full_prefill
from kdn import KDN, InvalidInputError, KDNConfig, _core
from kdn.blend import UnsupportedModelError
from kdn.models.tiny import tiny_model
from kdn.rope import inv_freq

ARCHS = ["llama", "mistral", "qwen2"]
# fp32: HF computes the reference angles in fp32 (at position ~1000 they are off by ~1e-4 rad)
DTYPES = [(torch.float32, 1e-4), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def roped(model, k, positions):
    cos, sin = model.model.rotary_emb(k, positions[None])
    return apply_rotary_pos_emb(k, k, cos, sin)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}],
                         ids=["default", "linear", "llama3", "yarn"])
def test_re_rotating_a_key_equals_computing_it_at_the_new_position(device, dtype, tol, head_dim, rope):
    model = tiny_model("llama", head_dim=head_dim, rope_parameters=rope)
    g = torch.Generator().manual_seed(head_dim)
    raw = torch.randn(1, 2, 24, head_dim, generator=g)
    start = torch.arange(5, 29)
    stored = roped(model, raw, start).to(device, dtype)
    for delta in (1, 37, 1000, -5):
        moved = stored.clone()
        _core.rope_shift([moved], inv_freq(model), delta)
        expected = roped(model, raw, start + delta).to(dtype)
        torch.testing.assert_close(moved.float().cpu(), expected.float(), rtol=tol, atol=tol)
    per_token = stored.clone()  # a different move per token
    deltas = torch.arange(24) * 3
    _core.rope_shift([per_token], inv_freq(model), deltas.tolist())
    torch.testing.assert_close(per_token.float().cpu(), roped(model, raw, start + deltas).to(dtype).float(),
                               rtol=tol, atol=tol)


def test_interleaved_convention_rotates_adjacent_pairs():
    k = torch.randn(1, 1, 3, 8)
    freq = torch.tensor([1.0, 0.5, 0.25, 0.125])
    moved = k.clone()
    _core.rope_shift([moved], freq, 2, "interleaved")
    angle = 2 * freq
    a, b = k[..., 0::2], k[..., 1::2]
    expected = torch.stack([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1).flatten(-2)
    torch.testing.assert_close(moved, expected)


def test_rope_shift_refuses_bad_input():
    with pytest.raises(InvalidInputError, match="inv_freq must be"):
        _core.rope_shift([torch.zeros(1, 2, 3, 8)], torch.zeros(3), 1)
    with pytest.raises(InvalidInputError, match="one delta per token"):
        _core.rope_shift([torch.zeros(1, 2, 3, 8)], torch.zeros(4), [1, 2])
    with pytest.raises(InvalidInputError, match="style"):
        _core.rope_shift([torch.zeros(1, 2, 3, 8)], torch.zeros(4), 1, "sideways")


def segments_and_query(model, lengths=(12, 9, 15), query=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    segs = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return segs, torch.randint(3, model.config.vocab_size, (query,), generator=g).tolist()


def prompt_ids(model, segs, query):
    return torch.tensor([[model.config.bos_token_id] + sum(segs, []) + query])


def first_logits(model, cache, stats, ids):
    with torch.inference_mode():
        if cache is None:
            return model(ids).logits[0, -1]
        return model(ids[:, stats["tokens"]:], past_key_values=cache).logits[0, -1]


@pytest.mark.parametrize("arch", ARCHS)
def test_blend_at_ratio_one_equals_full_prefill(arch):
    model = tiny_model(arch, layers=4)
    segs, query = segments_and_query(model)
    kdn = KDN(KDNConfig(chunk_size=8))
    kdn.store_segments(model, segs)
    ids = prompt_ids(model, segs, query)
    cache, stats = kdn.blend(model, segs, query, recompute_ratio=1.0)
    torch.testing.assert_close(first_logits(model, cache, stats, ids), full_prefill(model, ids)[0],
                               rtol=1e-4, atol=1e-4)
    out, _ = kdn.blend_generate(model, segs, query, recompute_ratio=1.0, max_new_tokens=8, do_sample=False)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(out[0], expected[0, ids.shape[1]:])


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3, 1.0])
def test_recomputed_tokens_per_layer_follow_the_ratio_and_the_query(ratio):
    model = tiny_model("llama", layers=5)
    segs, query = segments_and_query(model)
    kdn = KDN(KDNConfig(chunk_size=8))
    cache, stats = kdn.blend(model, segs, query, recompute_ratio=ratio)
    n_ctx, uncached = 1 + sum(map(len, segs)), len(query) - 1
    later = math.ceil(ratio * n_ctx) + uncached
    assert stats["recomputed_per_layer"] == [n_ctx + uncached] * 2 + [later] * 3
    assert stats["tokens"] == n_ctx + uncached and cache.get_seq_length() == stats["tokens"]


@pytest.mark.parametrize("selection", ["kv", "v", "gradual", "first-k"])
def test_every_selection_rule_equals_full_prefill_at_ratio_one_and_follows_its_schedule(selection):
    model = tiny_model("llama", layers=6)
    segs, query = segments_and_query(model)
    kdn = KDN(KDNConfig(chunk_size=8))
    ids = prompt_ids(model, segs, query)
    cache, stats = kdn.blend(model, segs, query, recompute_ratio=1.0, selection=selection)
    torch.testing.assert_close(first_logits(model, cache, stats, ids), full_prefill(model, ids)[0],
                               rtol=1e-4, atol=1e-4)
    cache, stats = kdn.blend(model, segs, query, recompute_ratio=0.2, selection=selection)
    n_ctx, uncached = 1 + sum(map(len, segs)), len(query) - 1
    per_layer = stats["recomputed_per_layer"]
    if selection == "first-k":  # the first ceil(0.2 * len) of each segment (BOS is exact), in every layer
        first = sum(math.ceil(0.2 * len(s)) for s in segs)
        assert per_layer == [first + uncached] * 6
        assert stats["selected"][:4] == [1, 2, 3, 13]  # segments start at 1 and 13
    elif selection == "gradual":  # 3x, 2x, 1.5x, 1x the ratio from layer 1 on
        counts = [math.ceil(min(1.0, m * 0.2) * n_ctx) + uncached for m in (3, 2, 1.5, 1, 1)]
        assert per_layer == [n_ctx + uncached] * 2 + counts[:4]
    else:
        assert per_layer == [n_ctx + uncached] * 2 + [math.ceil(0.2 * n_ctx) + uncached] * 4
    assert cache.get_seq_length() == n_ctx + uncached
    with pytest.raises(InvalidInputError, match="blend selection"):
        kdn.blend(model, segs, query, selection="best")


def test_blend_beats_naive_and_segments_work_in_any_order_and_repeated(stories):
    model, tokenizer = stories
    texts = ["Tom had a red ball. He liked to play with it in the park.",
             "Lily saw a big dog. The dog was friendly and wagged its tail.",
             "The sun was hot, so they sat under a tree and ate cake."]
    segs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    query = tokenizer(" Then Tom said", add_special_tokens=False)["input_ids"]
    kdn = KDN(KDNConfig(chunk_size=8))
    assert kdn.store_segments(model, segs) == {"already_stored": 0, "computed": 4}  # BOS prefix + 3
    for order in ([0, 1, 2], [2, 0, 1], [1, 1, 0]):  # reordered, and one segment twice
        chosen = [segs[i] for i in order]
        ids = prompt_ids(model, chosen, query)
        reference = torch.log_softmax(full_prefill(model, ids)[0], -1)
        kl = {}
        for mode, ratio in (("naive", 0.0), ("blend", 0.5), ("blend", 1.0)):
            cache, stats = kdn.blend(model, chosen, query, recompute_ratio=ratio, mode=mode)
            assert stats["segment_hits"] == 1 + len(chosen)  # all served from kdn
            logp = torch.log_softmax(first_logits(model, cache, stats, ids), -1)
            kl[(mode, ratio)] = torch.sum(reference.exp() * (reference - logp)).item()
        assert kl[("blend", 1.0)] < 1e-6
        assert kl[("blend", 0.5)] < kl[("naive", 0.0)], kl


def test_unsupported_models_and_bad_arguments_are_clear_errors(tiny_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64)).eval()
    kdn = KDN()
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel cannot be blended: architecture not in"):
        kdn.blend(gpt2, [[1, 2, 3]], [4, 5])
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'dynamic' is not supported"):
        kdn.blend(dynamic, [[5, 6, 7]], [8, 9])
    with pytest.raises(InvalidInputError, match="recompute_ratio"):
        kdn.blend(tiny_llama, [[5, 6, 7]], [8, 9], recompute_ratio=1.5)
    with pytest.raises(InvalidInputError, match="blend mode"):
        kdn.blend(tiny_llama, [[5, 6, 7]], [8, 9], mode="magic")
