"""Profiling the real engine's step for the simulated accelerator (Vidur's
profiling step, Agrawal et al., MLSys 2024): the engine runs as it serves
(the same model object, compiled programs, page state and scheduler) on
synthetic requests of random ids, and every call it reads is kept with the
seconds it added to the engine's clock
(:func:`paged_jax.simulator.step_time.call_seconds`).

Two kinds of runs (:func:`profile_runs`):

- the grid: ``D`` requests of ``C`` prompt tokens, all at once, for ``D`` in
  1, 2, 4, ... ``max_seqs`` and ``C`` in ``contexts`` where they fit the
  pool; each prefills in chunks, then decodes ``decode_steps`` tokens with
  ``D`` rows over ``C`` cached tokens;
- staggered: requests of random prompt (16 to 768 tokens) and output (8 to
  64) lengths added one every ``every`` engine steps, so prefill chunks
  share calls with decodes of every batch size on the way.

No clock drives the staggered runs (a request joins after a number of
steps, not seconds), so a profile's batches are the same on any machine;
only their times differ.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from paged_jax.checks import check_int
from paged_jax.engine.core import Engine
from paged_jax.engine.requests import Request
from paged_jax.simulator.step_time import StepWork, call_seconds


@dataclasses.dataclass(frozen=True)
class ProfileRun:
    """One run of the profile: its requests, and the engine steps between
    two of them joining (0: all at once)."""

    phase: str
    requests: list[Request]
    every: int = 0


def profile_runs(*, vocab_size: int, max_seqs: int, kv_tokens: int, contexts: Sequence[int] = (32, 256, 1024),
                 decode_steps: int = 12, staggered: Sequence[int] = (8, 2), staggered_requests: int = 32,
                 max_seq_len: int | None = None, seed: int = 0) -> list[ProfileRun]:
    """The grid and the staggered runs (module docstring).

    Args:
      vocab_size: prompt ids are drawn from ``[0, vocab_size)``.
      max_seqs, kv_tokens: the engine's limits: a grid point runs only if
        its requests fit the pool (``kv_tokens``) at once.
      contexts: the grid's prompt lengths, tokens.
      decode_steps: tokens each grid request decodes.
      staggered: one staggered run per value: a request joins every that
        many engine steps.
      staggered_requests: requests of each staggered run.
      max_seq_len: the engine's longest sequence, tokens (None: no bound):
        a staggered request's prompt and output lengths are drawn below it
        (the output at most a quarter of it).
      seed: of the prompt ids and the staggered lengths.

    Raises:
      ValueError: an argument not an int >= 1 (``staggered`` values too).
    """
    for name, value in (("vocab_size", vocab_size), ("max_seqs", max_seqs), ("kv_tokens", kv_tokens),
                        ("decode_steps", decode_steps), ("staggered_requests", staggered_requests)):
        check_int(name, value)
    longest = 768 + 64 if max_seq_len is None else check_int("max_seq_len", max_seq_len, 2)
    for c in contexts:
        check_int("contexts", c)
    for k in staggered:
        check_int("staggered", k)
    rng = np.random.default_rng(check_int("seed", seed, 0))

    def request(i, prompt, new):
        return Request(request_id=i, prompt_ids=rng.integers(0, vocab_size, prompt).tolist(), max_new_tokens=new,
                       ignore_eos=True)

    runs, d = [], 1
    while d <= max_seqs:
        for c in contexts:
            if d * (c + decode_steps) <= kv_tokens:
                runs.append(ProfileRun(f"grid {d}x{c}", [request(i, c, decode_steps) for i in range(d)]))
        d *= 2
    def staggered_request(i):
        new = min(int(rng.integers(8, 65)), max(1, longest // 4))
        top = min(768, longest - new)
        return request(i, int(rng.integers(min(16, top), top + 1)), new)

    for k in staggered:
        runs.append(ProfileRun(f"staggered every {k}", [staggered_request(i) for i in range(staggered_requests)], k))
    return runs


def profile_calls(make_engine: Callable[[], Engine], runs: Sequence[ProfileRun], *,
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """Serves each run on a fresh engine ``make_engine()`` (which must keep
    every call's record: ``EngineConfig(call_records=None)``).

    Returns:
      one dict per call read, calls that compiled left out:
      :class:`paged_jax.simulator.step_time.StepWork`'s fields, ``seconds``
      (what it added to the clock) and ``phase`` (its run's).

    Raises:
      ValueError: an engine that does not keep every call's record.
    """
    rows = []
    for i, run in enumerate(runs):
        engine = make_engine()
        if engine.stats.calls.maxlen is not None:
            raise ValueError("make_engine must build engines that keep every call record "
                             "(EngineConfig(call_records=None))")
        pending = list(run.requests)
        if not run.every:
            engine.run(pending)
        else:
            steps = 0
            while pending or engine.has_unfinished():
                if pending and steps % run.every == 0:
                    engine.add_request(pending.pop(0))
                engine.step()
                steps += 1
        records = list(engine.stats.calls)
        for rec, seconds in zip(records, call_seconds(records)):
            if rec.compile_s == 0 and seconds > 0:
                rows.append({**dataclasses.asdict(StepWork.from_record(rec)), "seconds": seconds, "phase": run.phase})
        if progress is not None:
            progress(f"run {i + 1}/{len(runs)} ({run.phase}, {len(run.requests)} requests): {len(records)} calls")
    return rows
