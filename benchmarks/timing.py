"""Timing helper shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time


def timed(fn, repeats: int, setup=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (``setup()``, untimed, before each)."""
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
