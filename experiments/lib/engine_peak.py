"""Serving fixed-length random requests through an engine and counting the
most sequences it runs at once: the measurement the engine capacity
scripts (:mod:`experiments.memory.hybrid_capacity`,
:mod:`experiments.memory.mla_capacity`) share."""

from __future__ import annotations

import time

import numpy as np

from paged_jax.engine.core import Engine
from paged_jax.engine.requests import Request
from paged_jax.engine.sampling import SamplingParams


def serve_for_peak(engine: Engine, *, num_requests: int, prompt_len: int, new_tokens: int, vocab_size: int,
                   seed: int) -> tuple[int, float]:
    """Adds ``num_requests`` requests of ``prompt_len`` random tokens (drawn
    from ``seed``) that each generate exactly ``new_tokens`` (greedy,
    ``ignore_eos``), steps ``engine`` until all finish, and returns ``(most
    sequences running after a step, seconds)``."""
    rng = np.random.default_rng(seed)
    for i in range(num_requests):
        engine.add_request(Request(request_id=i, prompt_ids=rng.integers(0, vocab_size, prompt_len).tolist(),
                                   max_new_tokens=new_tokens, ignore_eos=True, sampling=SamplingParams()))
    peak, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.running))
    return peak, time.perf_counter() - t0
