"""A token-addressed prompt served by blending (kdn.engine.passages, what the vLLM connector runs),
on the CPU through an HF model's layers: pieces keyed as the HF face keys segments, the blended
span stopping at the first missing piece, ratio 1.0 equal to a full prefill, ratio 0 equal to the
HF face's naive blend, missing pieces computed and stored; bad spans refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import full_prefill, random_ids
from kdn import KDN, InvalidInputError, KDNConfig
from kdn.blend.recompute import HFStack
from kdn.engine import passages
from kdn.layout import cache_to_kv_list


@pytest.fixture
def rag(stories):
    """(KDN, model, session, prompt tokens, passage spans, the passages' tokens, the question's)."""
    model = stories[0]
    cache = KDN(KDNConfig(chunk_size=16))
    bos = model.config.bos_token_id
    texts = [random_ids(model, n, seed=20 + i)[0].tolist() for i, n in enumerate((11, 17, 9))]
    question = random_ids(model, 6, seed=30)[0].tolist()
    ids, spans = [bos], []
    for text in texts:
        spans.append((len(ids), len(ids) + len(text)))
        ids += text
    return cache, model, cache.session(model), np.asarray(ids + question, np.uint32), spans, texts, question


def test_pieces_are_keyed_as_the_hf_face_stores_segments(rag):
    cache, model, session, tokens, spans, texts, _ = rag
    pieces = passages.cut(session, tokens, spans, [model.config.bos_token_id])
    assert [(p.start, p.end) for p in pieces] == [(0, 1)] + spans
    cache.store_segments(model, texts)  # BOS behind nothing, each text behind BOS
    assert all(cache.engine.holds(p.key) for p in pieces)
    gap = passages.cut(session, tokens, [spans[0], spans[2]], [1])  # the text between two passages is a piece
    assert [(p.start, p.end) for p in gap] == [(0, 1), spans[0], spans[1], spans[2]]


def test_the_blended_span_ends_before_the_first_missing_piece_and_before_the_last_token(rag):
    cache, model, session, tokens, spans, texts, _ = rag
    bos = [model.config.bos_token_id]
    assert passages.plan(cache.engine, session, tokens, spans, bos).end == 0
    cache.store_segments(model, [texts[0], texts[2]])
    assert passages.plan(cache.engine, session, tokens, spans, bos).end == spans[0][1]
    cache.store_segments(model, texts)
    assert passages.plan(cache.engine, session, tokens, spans, bos).end == spans[2][1]
    whole = passages.plan(cache.engine, session, tokens[:spans[2][1]], spans, bos)  # the last piece ends the prompt
    assert whole.end == spans[1][1]


@pytest.mark.parametrize("ratio", [1.0, 0.0])
def test_a_blend_at_one_is_a_full_prefill_and_at_zero_the_hf_faces_naive_blend(rag, ratio):
    cache, model, session, tokens, spans, texts, question = rag
    bos = [model.config.bos_token_id]
    stack = HFStack(model)
    plan = passages.plan(cache.engine, session, tokens, spans, bos, ratio)
    assert plan.end == 0
    assert passages.store_missing(cache.engine, session, stack, plan, tokens, "cpu") == 4  # BOS and three
    plan = passages.plan(cache.engine, session, tokens, spans, bos, ratio)
    end, kv, recomputed = passages.blended(cache.engine, session, stack, plan, tokens, "cpu")
    assert end == spans[-1][1] and recomputed == (end * len(model.model.layers) if ratio else 0)
    if ratio == 1.0:
        want = cache_to_kv_list(full_prefill(model, torch.tensor([tokens[:end].tolist()]))[1])
    else:
        naive, _ = cache.blend(model, texts, question, mode="naive")
        want = cache_to_kv_list(naive)
    assert max((a - b).abs().max().item() for a, b in zip(kv, want)) < 1e-4


def test_bad_spans_and_ratios_are_refused_by_name():
    for bad, why in [([], "non-empty list"), ([[3, 2]], "non-empty, in order"), ([[0, 4], [3, 6]], "overlapping"),
                     ([[0, 99]], "within the prompt's 10"), ([[0, True]], "pair of token positions"),
                     ([(1, 2, 3)], "pair")]:
        with pytest.raises(InvalidInputError, match=why):
            passages.check_passages(bad, 10)
    for ratio in (-0.1, 1.5, "0.2", True, float("nan")):
        with pytest.raises(InvalidInputError, match="recompute_ratio"):
            passages.check_ratio(ratio)
    with pytest.raises(InvalidInputError, match="selection 'best'"):
        passages.check_ratio(0.2, "best")


@pytest.mark.parametrize("rope, refused", [(None, False), ({"rope_type": "linear", "factor": 2.0}, False),
                                           ({"rope_type": "llama3", "factor": 8.0}, False),
                                           ({"rope_type": "yarn", "factor": 4.0}, True),
                                           ({"type": "dynamic", "factor": 2.0}, True)])
def test_a_vllm_engine_whose_rope_cannot_be_re_rotated_by_its_rotary_embedding_is_not_blended(rope, refused):
    """vLLM folds YaRN's magnitude scale into its rotation and dynamic NTK's frequencies change with
    the length: either engine is refused by name before its modules are read; the others go on to
    the module check (which a bare model object fails, by name)."""
    from types import SimpleNamespace

    from kdn.integrations.vllm.layers import unblendable

    model = type("LlamaForCausalLM", (), {})()
    hf = SimpleNamespace(sliding_window=None, rope_parameters=rope)
    config = SimpleNamespace(lora_config=None, parallel_config=None, model_config=SimpleNamespace(hf_text_config=hf))
    why = unblendable(model, config)
    assert ("RoPE scaling" in why) is refused and (("modules lack" in why) is not refused), why
