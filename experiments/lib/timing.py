"""Timing a jitted call for the benchmarks: best of several loops, robust to
other load on a shared machine."""

from __future__ import annotations

import math
import time

import jax


def time_call(fn, *args, min_seconds: float = 0.2, repeats: int = 5) -> float:
    """Seconds per call: best over ``repeats`` of a loop lasting about
    ``min_seconds`` (after one warm-up call that compiles)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-6)
    n = max(1, int(min_seconds / once))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / n)
    return best
