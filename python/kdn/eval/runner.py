"""Run an evaluation: tokenize samples, answer them with each method, score, time, and write reports."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kdn.config import KDNConfig
from kdn.eval.datasets import Sample, load_dataset
from kdn.eval.methods import Encoded, resolve_method
from kdn.eval.metrics import METRICS, exact_match
from kdn.eval.stats import bootstrap_ci, paired_difference

_SENTINEL = "\x00KDN-CONTENT\x00"


def template_parts(tokenizer) -> tuple[str, str]:
    """(text before, text after) the user message in the tokenizer's chat template; ("", "") without one."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=True)
    head, _, tail = rendered.partition(_SENTINEL)
    return head, tail


def encode(tokenizer, sample: Sample, max_prompt_tokens: int, max_new_tokens: int) -> Encoded:
    """Token ids of chat-template head + segments (the cached context) + question + template tail.

    Segments are tokenized one by one (their spans are kept for blending). If the prompt would not
    fit ``max_prompt_tokens - max_new_tokens``, the context is cut from its end and ``truncated`` set.
    """
    head, tail = template_parts(tokenizer)
    head_ids = tokenizer(head)["input_ids"]  # with the tokenizer's special tokens (BOS)
    query_ids = tokenizer(sample.query + tail, add_special_tokens=False)["input_ids"]
    budget = max_prompt_tokens - max_new_tokens - len(query_ids) - len(head_ids)
    if budget <= 0:
        raise ValueError(f"sample {sample.id}: the question alone does not fit {max_prompt_tokens} tokens")
    context, spans, truncated = list(head_ids), [], False
    for segment in sample.segments:
        seg = tokenizer(segment, add_special_tokens=False)["input_ids"]
        room = budget - (len(context) - len(head_ids))
        if len(seg) > room:
            seg, truncated = seg[:max(room, 0)], True
        spans.append((len(context), len(context) + len(seg)))
        context += seg
    ids = torch.tensor([context + query_ids])
    return Encoded(ids, len(context), spans, truncated)


def run_eval(dataset: str, model, tokenizer, methods: list[str], limit: int | None = None,
             out_dir: str | Path | None = None, max_new_tokens: int = 32, chunk_size: int = 256,
             max_prompt_tokens: int | None = None, model_name: str = "model", progress: bool = True,
             data_dir: str | Path | None = None) -> dict:
    """Answer ``limit`` samples of ``dataset`` with every method; returns (and writes) the results.

    Returns ``{"summary": {method: {...}}, "samples": [per-sample records], ...}``. With ``out_dir``
    it writes ``samples.jsonl``, ``summary.json``, ``summary.csv``, ``summary.md`` and
    ``quality_vs_ttft.png`` there (see :mod:`kdn.eval.report`). ``data_dir`` is where named datasets
    are looked for (default ``$KDN_DATA``, then ``$KDN_SHARED/data``).

    Example:
        >>> model, tok = kdn.models.load("stories260k")
        >>> result = run_eval("musique", model, tok, ["full", "reuse"], limit=2, max_new_tokens=8)
        >>> result["summary"]["reuse"]["identical_to_full"]
        1.0
    """
    samples = load_dataset(dataset, limit, data_dir)
    config = KDNConfig(chunk_size=chunk_size)
    resolved = [resolve_method(m, config) for m in methods]
    device = next(model.parameters()).device
    if max_prompt_tokens is None:
        max_prompt_tokens = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
    records = []
    steps = [(s, m) for s in samples for m in resolved]
    bar = tqdm(total=len(steps), desc=f"kdn eval {dataset}", unit="answer", disable=not progress)
    for sample in samples:
        enc = encode(tokenizer, sample, max_prompt_tokens, max_new_tokens)
        enc.ids = enc.ids.to(device)
        full_tokens = None
        for method in resolved:
            record = {"sample": sample.id, "method": method.name, "available": method.available,
                      "context_tokens": enc.context_tokens, "prompt_tokens": enc.ids.shape[1],
                      "truncated": enc.truncated, "gold": list(sample.answers)}
            if method.available:
                answer = method.answer(model, enc, max_new_tokens)
                text = tokenizer.decode(answer.tokens, skip_special_tokens=True)
                gold = sample.answers if sample.metric == "qa_f1" else sample.answers[0]
                if sample.metric == "qa_f1":
                    record["exact_match"] = exact_match(text, sample.answers)
                record.update(answer=text, score=METRICS[sample.metric](text, gold), ttft_s=answer.ttft_s,
                              prefill_tokens=answer.prefill_tokens, hit_tokens=answer.hit_tokens,
                              inject_s=answer.inject_s, stored_bytes=answer.stored_bytes, tokens=answer.tokens)
                if answer.miss_overhead is not None:
                    record["miss_overhead"] = answer.miss_overhead
                if method.name == "full":
                    full_tokens = answer.tokens
                if full_tokens is not None:
                    record["identical_to_full"] = answer.tokens == full_tokens
            else:
                record["reason"] = method.reason
            records.append(record)
            bar.update()
    bar.close()
    result = {"dataset": dataset, "model": model_name, "metric": samples[0].metric if samples else None,
              "methods": methods, "max_new_tokens": max_new_tokens, "chunk_size": chunk_size,
              "summary": summarize(records, methods), "samples": records}
    if out_dir is not None:
        from kdn.eval.report import write_reports

        write_reports(result, Path(out_dir))
    return result


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per method: quality (mean score, its 95% bootstrap interval, exact match for QA, and the paired
    difference to ``full`` on the same samples), response delay (TTFT), compute per request,
    injection, bytes."""
    full = {r["sample"]: r["score"] for r in records if r["method"] == "full" and r["available"]}
    summary = {}
    for name in methods:
        rows = [r for r in records if r["method"] == name]
        ran = [r for r in rows if r["available"]]
        if not ran:
            summary[name] = {"available": False, "reason": rows[0].get("reason", "") if rows else "", "n": 0}
            continue
        same = [r["identical_to_full"] for r in ran if "identical_to_full" in r]
        summary[name] = {
            "available": True, "n": len(ran),
            "quality": statistics.fmean(r["score"] for r in ran),
            "quality_ci95": bootstrap_ci(r["score"] for r in ran),
            "exact_match": statistics.fmean(r["exact_match"] for r in ran) if "exact_match" in ran[0] else None,
            "vs_full": paired_difference({r["sample"]: r["score"] for r in ran}, full) if name != "full" else None,
            "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in ran),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in ran),
            "prefill_tokens_mean": statistics.fmean(r["prefill_tokens"] for r in ran),
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ran),
            "inject_s_mean": statistics.fmean(r["inject_s"] for r in ran),
            "stored_bytes_mean": statistics.fmean(r["stored_bytes"] for r in ran),
            "identical_to_full": statistics.fmean(same) if same else None,
            "miss_overhead_mean": (statistics.fmean(r["miss_overhead"] for r in ran)
                                   if "miss_overhead" in ran[0] else None),
        }
    return summary
