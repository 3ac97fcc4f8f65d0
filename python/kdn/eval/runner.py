"""Run an evaluation: tokenize samples, answer them with each method, score, time, and write reports."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kdn.config import KDNConfig
from kdn.eval.datasets import QA_INSTRUCTION, Sample, load_dataset
from kdn.eval.methods import Encoded, resolve_method
from kdn.eval.metrics import METRICS, exact_match
from kdn.eval.stats import bootstrap_ci, paired_difference
from kdn.info import provenance

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


def _digest(text: str) -> str:
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()  # whitespace-normalized


_TOPIC = "USER: I would like to discuss the topic of"  # where each LongChat conversation starts
CALIBRATION_FALLBACK = ("musique", "longchat-topics-15", "longchat-topics-5")  # when a dataset's own text runs out


def units(segment: str) -> list[str]:
    """The pieces of text a segment is made of, whose reuse elsewhere counts as shared content: each
    LongChat conversation of a record (a record strings several together), else the segment (a
    MuSiQue passage)."""
    parts = segment.split(_TOPIC)
    return [segment] if len(parts) == 1 else [p for p in parts[:1] if p.strip()] + [_TOPIC + p for p in parts[1:]]


def _held(samples: list[Sample]) -> set[str]:
    return {_digest(u) for s in samples for seg in s.segments for u in units(seg)}


RUN_WORDS = 8  # a run of this many words shared with the evaluated text makes a unit not disjoint
TEMPLATE = (QA_INSTRUCTION, _TOPIC, "Title:")  # the loaders' fixed wording: shared by every sample, not content
_LINES_PREAMBLE = re.compile(r"^Below is a record of lines.*?Now the record start:", re.DOTALL)  # LongChat lines'


def runs(text: str) -> set[str]:
    """The runs of :data:`RUN_WORDS` words of ``text``'s content (the template's wording taken out)."""
    text = _LINES_PREAMBLE.sub(" ", text)
    for fixed in TEMPLATE:
        text = text.replace(fixed, " ")
    words = text.split()
    return {" ".join(words[i:i + RUN_WORDS]) for i in range(len(words) - RUN_WORDS + 1)}


def _runs_of(samples: list[Sample], common: frozenset = frozenset()) -> set[str]:
    return {r for s in samples for seg in s.segments for r in runs(seg)} - common


FORMULA_UNITS = 2  # a run of words this many distinct conversations hold is stock wording ("Sure, I'd be happy to")


def formulas(samples: list[Sample]) -> frozenset:
    """The runs of words at least :data:`FORMULA_UNITS` distinct LongChat conversations hold: each
    conversation is on a topic of its own and is reused whole (which its hash catches), so what two of
    them share is the assistant's and user's stock wording ("That's really interesting. Can you give
    some specific examples"), not content. Passages have no formulas: MuSiQue's are overlapping
    windows of the same articles, so a run two of them hold is shared content."""
    talks = {u for s in samples for seg in s.segments for u in units(seg) if u.startswith(_TOPIC)}
    held = collections.Counter(r for u in talks for r in runs(u))
    return frozenset(r for r, n in held.items() if n >= FORMULA_UNITS)


def calibration_contexts(everything: list[Sample], evaluated: list[Sample], wanted: int,
                         fallback=None) -> list[Sample]:
    """Up to ``wanted`` calibration contexts sharing no text with any evaluated sample: from the samples
    after the evaluated ones, each keeping only the units (:func:`units`) that share no run of
    :data:`RUN_WORDS` words of content (:func:`runs`; the dataset's :func:`formulas` aside) with an
    evaluated sample or an earlier context, without its question; then, if those run out, from
    ``fallback()`` (samples of other datasets, :data:`CALIBRATION_FALLBACK`). A codec fit on text it is
    then judged on would flatter it: LongChat's records share their conversations (its 50 records are
    built from 30), MuSiQue's questions their passages, and its passages are overlapping windows of the
    same articles (the passages a hash rule chose for 30 evaluated questions held 17% of their 8-word runs,
    one 80%: ``benchmarks/record_facts.py calibration-overlap``), so neither disjoint sample ids nor
    distinct passage hashes are disjoint text."""
    common = formulas(everything)
    seen, seen_runs, out = _held(evaluated), _runs_of(evaluated, common), []
    sources = [everything[len(evaluated):]]
    for source in (*sources, None):
        if source is None:
            if fallback is None or len(out) >= wanted:
                break
            source = fallback()
            common |= formulas(source)  # another dataset's stock replies
            seen_runs -= common
        for sample in source:
            if len(out) >= wanted:
                break
            candidates = ((u, runs(u) - common) for seg in sample.segments for u in units(seg))
            kept = [(u, r) for u, r in candidates if _digest(u) not in seen and not r & seen_runs]
            if kept:
                seen |= {_digest(u) for u, _ in kept}
                seen_runs |= {x for _, r in kept for x in r}
                out.append(Sample(sample.id, tuple(u for u, _ in kept), "", (), sample.metric))
    return out


def fallback_samples(dataset: str, data_dir=None) -> list[Sample]:
    """Samples of the other datasets calibration may draw on (those found here)."""
    from kdn.eval.datasets import DatasetNotFoundError

    out = []
    for name in CALIBRATION_FALLBACK:
        if name != dataset:
            try:
                out += load_dataset(name, None, data_dir)
            except DatasetNotFoundError:
                continue
    return out


def calibration_identity(contexts: list[Sample]) -> dict:
    """What names a calibration's text: the samples it came from and a hash of its segments."""
    return {"samples": [c.id for c in contexts],
            "content": _digest("\0".join(_digest(seg) for c in contexts for seg in c.segments))}


def kvtc_ratios(methods: list[str]) -> tuple[int, ...]:
    """The ratios a calibration must offer: kvtc's own and every one a ``reuse+kvtc`` method names."""
    from kdn import codecs, kvtc

    named = {dict(codecs.parse(m.split("+", 1)[1]).options)["ratio"] for m in methods if m.startswith("reuse+kvtc")}
    return tuple(sorted(set(kvtc.RATIOS) | named))


def calibrate_kvtc(model, tokenizer, contexts: list[Sample], evaluated: list[Sample], max_prompt_tokens: int,
                   max_new_tokens: int, progress: bool = True, ratios: tuple[int, ...] | None = None) -> dict:
    """Fit and load the model's ``kvtc`` calibration on ``contexts`` (offering ``ratios``, default
    kvtc's), refused (ValueError) unless they share no segment and no run of :data:`RUN_WORDS`
    words of content with the ``evaluated`` samples; what was used."""
    from kdn import kvtc

    if not contexts:
        raise ValueError("kvtc needs calibration text sharing no conversation or passage with the evaluated samples, "
                         "and neither the samples beyond --limit nor the other datasets hold any: lower --limit")
    common = formulas(evaluated + contexts)
    shared, overlap = _held(evaluated) & _held(contexts), _runs_of(evaluated, common) & _runs_of(contexts, common)
    if shared or overlap:
        raise ValueError(f"the kvtc calibration shares {len(shared)} conversation(s) or passage(s) and "
                         f"{len(overlap)} runs of {RUN_WORDS} words with the evaluated samples")
    ids = [encode(tokenizer, c, max_prompt_tokens, max_new_tokens).ids[0, :-1].tolist() for c in contexts]
    t0 = time.perf_counter()
    kvtc.load(kvtc.calibrate(model, ids, progress=progress, ratios=ratios or kvtc.RATIOS))
    return {**calibration_identity(contexts), "tokens": sum(map(len, ids)), "disjoint_in_content": True,
            "seconds": time.perf_counter() - t0}


def run_eval(dataset: str, model, tokenizer, methods: list[str], limit: int | None = None,
             out_dir: str | Path | None = None, max_new_tokens: int = 32, chunk_size: int = 256,
             max_prompt_tokens: int | None = None, model_name: str = "model", progress: bool = True,
             data_dir: str | Path | None = None, calibration_samples: int = 2, resume: bool = False,
             command: str | None = None) -> dict:
    """Answer ``limit`` samples of ``dataset`` with every method; returns (and writes) the results.

    Returns ``{"summary": {method: {...}}, "samples": [per-sample records], ...}``. With ``out_dir``
    it writes ``samples.jsonl``, ``summary.json``, ``summary.csv``, ``summary.md`` and
    ``quality_vs_ttft.png`` there (see :mod:`kdn.eval.report`), and rewrites them as samples finish
    (at most once a minute), so a long run stopped early keeps what it answered. ``data_dir`` is
    where named datasets are looked for (default ``$KDN_DATA``, then ``$KDN_SHARED/data``). A
    ``reuse+kvtc`` method is calibrated first on ``calibration_samples`` contexts sharing no
    conversation or passage with the evaluated samples (:func:`calibration_contexts`). With
    ``resume`` a run stopped early goes on: the samples ``out_dir`` already holds every method's
    answer for are kept as they are and not answered again (the run must name the same dataset,
    model, methods and calibration, which a kvtc run's ``limit`` decides; anything else is a
    ``ValueError`` before any work). The reports' ``run`` entry names what made them (``command``,
    else this process's; the commit, versions, CPU, and the load average at the start and last write); a
    resumed run's keeps those of the runs it resumed under ``earlier_runs``, oldest first.

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
    run, contexts = planned_run(dataset, model_name, methods, everything, samples, calibration_samples, data_dir)
    done = finished_records(out_dir, run) if resume and out_dir is not None else {}
    made_by = {**provenance(command=command), "resumed": len(done)}  # before the calibration's minutes
    if done:  # the samples kept were answered by earlier runs, maybe at another commit or on another host
        made_by["earlier_runs"] = earlier_runs(out_dir)
    kvtc_used = run["calibration"] is not None
    calibration = None
    if kvtc_used and len(done) < len(samples):
        calibration = calibrate_kvtc(model, tokenizer, contexts, samples, max_prompt_tokens, max_new_tokens, progress,
                                     kvtc_ratios(methods))
    records = []
    result = {"run": made_by,
              "dataset": dataset, "model": model_name, "metric": samples[0].metric if samples else None,
              "methods": methods, "limit": limit, "max_new_tokens": max_new_tokens, "chunk_size": chunk_size,
              "calibration": calibration or run["calibration"]}  # what was fitted, or the identity resumed
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


def planned_run(dataset: str, model_name: str, methods: list[str], everything: list[Sample], samples: list[Sample],
                calibration_samples: int = 2, data_dir=None) -> tuple[dict, list[Sample]]:
    """``(run, contexts)``: what names a run for resuming it (dataset, model, methods, and the
    calibration's identity when a ``reuse+kvtc`` method needs one; a longer ``limit`` without kvtc
    keeps the answers given) and the calibration contexts."""
    kvtc_used = any(m.startswith("reuse+kvtc") for m in methods)
    contexts = calibration_contexts(everything, samples, calibration_samples,
                                    lambda: fallback_samples(dataset, data_dir)) if kvtc_used else []
    return {"dataset": dataset, "model": model_name, "methods": methods,
            "calibration": calibration_identity(contexts) if kvtc_used else None}, contexts


def finished_records(out_dir, run: dict) -> dict[str, list[dict]]:
    """The records of an earlier run in ``out_dir``, by sample, for the samples it answered with every
    method; an earlier run of another dataset, model, method list or calibration (``run``, from
    :func:`planned_run`) is refused."""
    from kdn.eval.report import load_jsonl

    summary, answers = Path(out_dir) / "summary.json", Path(out_dir) / "samples.jsonl"
    if not answers.is_file():
        return {}
    before = json.loads(summary.read_text()) if summary.is_file() else {}
    calibration = before.get("calibration")
    theirs = {**{k: before.get(k) for k in run},
              "calibration": {k: calibration.get(k) for k in ("samples", "content")} if calibration else None}
    if theirs != run:
        differ = sorted(k for k in run if theirs[k] != run[k])
        raise ValueError(f"cannot resume {out_dir}: its run differs in {', '.join(differ)} ({theirs}, this run "
                         f"is {run}); choose another --out or the same dataset, model, methods and calibration (a "
                         "kvtc run's calibration follows --limit)")
    methods = run["methods"]
    by_sample: dict[str, list[dict]] = {}
    for record in load_jsonl(answers):
        by_sample.setdefault(record["sample"], []).append(record)
    return {s: rows for s, rows in by_sample.items() if [r["method"] for r in rows] == methods}


def earlier_runs(out_dir) -> list[dict]:
    """The ``run`` entries (oldest first) of the records in ``out_dir``'s ``summary.json``: the run that
    wrote it last and those it had resumed."""
    summary = Path(out_dir) / "summary.json"
    if not summary.is_file():
        return []
    last = dict(json.loads(summary.read_text()).get("run") or {})
    older = last.pop("earlier_runs", [])
    return [*older, last] if last else older


def _write(result: dict, records: list[dict], methods: list[str], out_dir) -> None:
    from kdn.eval.report import write_reports

    result["run"].update(written=time.strftime("%Y-%m-%dT%H:%M:%S%z"), load_average_written=os.getloadavg())
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
