"""Run an evaluation: tokenize samples, answer them with each method, score, time, and write reports."""

from __future__ import annotations

import json
import statistics
import time
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


def calibrate_kvtc(model, tokenizer, contexts: list[Sample], max_prompt_tokens: int, max_new_tokens: int,
                   progress: bool = True) -> dict:
    """Fit and load the model's ``kvtc`` calibration on ``contexts`` (samples the evaluation does not
    answer: a codec fit on the contexts it is then judged on would flatter it); what was used."""
    from kdn import kvtc

    if not contexts:
        raise ValueError("kvtc needs calibration contexts disjoint from the evaluated ones and the dataset has "
                         "no samples left beyond --limit: lower --limit")
    ids = [encode(tokenizer, c, max_prompt_tokens, max_new_tokens).ids[0, :-1].tolist() for c in contexts]
    t0 = time.perf_counter()
    kvtc.load(kvtc.calibrate(model, ids, progress=progress))
    return {"samples": [c.id for c in contexts], "tokens": sum(map(len, ids)), "seconds": time.perf_counter() - t0}


def run_eval(dataset: str, model, tokenizer, methods: list[str], limit: int | None = None,
             out_dir: str | Path | None = None, max_new_tokens: int = 32, chunk_size: int = 256,
             max_prompt_tokens: int | None = None, model_name: str = "model", progress: bool = True,
             data_dir: str | Path | None = None, calibration_samples: int = 2, resume: bool = False) -> dict:
    """Answer ``limit`` samples of ``dataset`` with every method; returns (and writes) the results.

    Returns ``{"summary": {method: {...}}, "samples": [per-sample records], ...}``. With ``out_dir``
    it writes ``samples.jsonl``, ``summary.json``, ``summary.csv``, ``summary.md`` and
    ``quality_vs_ttft.png`` there (see :mod:`kdn.eval.report`), and rewrites them as samples finish
    (at most once a minute), so a long run stopped early keeps what it answered. ``data_dir`` is
    where named datasets are looked for (default ``$KDN_DATA``, then ``$KDN_SHARED/data``). A
    ``reuse+kvtc`` method is calibrated first on the ``calibration_samples`` samples that follow
    the evaluated ones. With ``resume`` a run stopped early goes on: the samples ``out_dir`` already
    holds every method's answer for are kept as they are and not answered again (the run must name
    the same dataset, model and methods; anything else is a ``ValueError`` before any work).

    Example:
        >>> model, tok = kdn.models.load("stories260k")
        >>> result = run_eval("musique", model, tok, ["full", "reuse"], limit=2, max_new_tokens=8)
        >>> result["summary"]["reuse"]["identical_to_full"]
        1.0
    """
    everything = load_dataset(dataset, None, data_dir)
    samples = everything[:limit] if limit is not None else everything
    config = KDNConfig(chunk_size=chunk_size)
    resolved = [resolve_method(m, config) for m in methods]
    device = next(model.parameters()).device
    if max_prompt_tokens is None:
        max_prompt_tokens = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
    done = finished_records(out_dir, dataset, model_name, methods) if resume and out_dir is not None else {}
    calibration = None
    if any(m.startswith("reuse+kvtc") for m in methods) and len(done) < len(samples):
        extra = everything[len(samples): len(samples) + calibration_samples]
        calibration = calibrate_kvtc(model, tokenizer, extra, max_prompt_tokens, max_new_tokens, progress)
    records = []
    result = {"dataset": dataset, "model": model_name, "metric": samples[0].metric if samples else None,
              "methods": methods, "max_new_tokens": max_new_tokens, "chunk_size": chunk_size,
              "calibration": calibration}
    written = time.monotonic()
    steps = [(s, m) for s in samples for m in resolved]
    bar = tqdm(total=len(steps), desc=f"kdn eval {dataset}", unit="answer", disable=not progress)
    for sample in samples:
        if sample.id in done:
            records.extend(done[sample.id])
            bar.update(len(resolved))
            continue
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
        if out_dir is not None and time.monotonic() - written > 60:
            _write(result, records, methods, out_dir)
            written = time.monotonic()
    bar.close()
    if out_dir is not None:
        _write(result, records, methods, out_dir)
    return {**result, "summary": summarize(records, methods), "samples": records}


def finished_records(out_dir, dataset: str, model_name: str, methods: list[str]) -> dict[str, list[dict]]:
    """The records of an earlier run in ``out_dir``, by sample, for the samples it answered with every
    method; an earlier run of another dataset, model or method list is refused."""
    from kdn.eval.report import load_jsonl

    summary, answers = Path(out_dir) / "summary.json", Path(out_dir) / "samples.jsonl"
    if not answers.is_file():
        return {}
    before = json.loads(summary.read_text()) if summary.is_file() else {}
    mine = {"dataset": dataset, "model": model_name, "methods": methods}
    theirs = {k: before.get(k) for k in mine}
    if theirs != mine:
        raise ValueError(f"cannot resume {out_dir}: it holds a run of {theirs}, this run is {mine}; "
                         "choose another --out or the same dataset, model and methods")
    by_sample: dict[str, list[dict]] = {}
    for record in load_jsonl(answers):
        by_sample.setdefault(record["sample"], []).append(record)
    return {s: rows for s, rows in by_sample.items() if [r["method"] for r in rows] == methods}


def _write(result: dict, records: list[dict], methods: list[str], out_dir) -> None:
    from kdn.eval.report import write_reports

    write_reports({**result, "summary": summarize(records, methods), "samples": records}, Path(out_dir))


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
