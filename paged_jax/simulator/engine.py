"""A simulated accelerator that is the engine: :class:`SimulatedEngine`.

Serving simulators (Vidur, Agrawal et al., MLSys 2024; Revati; BLIS) each
re-implement a scheduler, which then drifts from the engine it models. Here
the simulated engine *is* :class:`paged_jax.engine.core.Engine`: the same
scheduler, KV manager, page state (the host's twin), prefix cache,
preemption, swap accounting, reservation policies and contiguous
allocators, and the same flat batch built for each call. Two things are
replaced:

- the model call: no program runs; each sampling row gets a token that is
  never a stop token (requests run to ``max_new_tokens``, as the paper's
  runs with the dataset's output lengths and EOS ignored), a pseudo-random
  function of the request and position (so outputs never share pages by
  accident), and the device's page-state checks are answered by the host's
  plan;
- the clock: virtual. Reading a call's results advances it by the
  step-time model's seconds for that call
  (:mod:`paged_jax.simulator.step_time`), from the later of the previous
  read and the start of the call's own iteration; nothing else takes time,
  so an iteration ends when it reads, and a busy real engine's clock, cut
  as :func:`paged_jax.simulator.step_time.call_seconds` cuts it, is
  replayed exactly;
  :meth:`SimulatedEngine.sleep` advances it while idle, so
  ``experiments.lib.online.run_online(engine, ..., sleep=engine.sleep)``
  drives it as it drives a real one.

Not simulated: the device's own page state (the host's twin is the
truth; ``check_page_state`` has nothing to compare), the K/V values, swap
copies' time (pages move in a placeholder pool of one element per slot).
The pool is therefore free: a simulated pool of any size costs its page
state only.
"""

from __future__ import annotations

import zlib
from typing import Iterable

import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_float, check_int
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.core import Engine
from paged_jax.engine.stats import CallRecord
from paged_jax.paging.kv_cache import KVPool
from paged_jax.simulator.step_time import StepTimeModel, StepWork


class _NoModel:
    """Stands where the engine's model would: it has a vocabulary and is
    never called."""

    params: dict = {}
    kv_window = None
    kv_groups = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def apply(self, params, batch, kv):
        raise RuntimeError("a simulated engine's model is never called")


class TimedEngine(Engine):
    """The real engine (the model runs, tokens are real) on a virtual clock
    that a step-time model advances, as :class:`SimulatedEngine`'s: for
    latencies that do not depend on the machine's noise, and to check that
    the simulated engine decides what the real one decides under the same
    times. Arguments as :class:`paged_jax.engine.core.Engine`'s, plus
    ``step_time``.

    Raises:
      ValueError: what the engine refuses, or a ``step_time`` without
        ``seconds(work)``.
    """

    def __init__(self, *args, step_time: StepTimeModel, **kwargs):
        if not callable(getattr(step_time, "seconds", None)):
            raise ValueError(f"step_time must have seconds(work) (a paged_jax.simulator.step_time model), got "
                             f"{type(step_time).__name__}")
        self.step_time = step_time
        self._now_s = 0.0
        self._due: dict[int, float] = {}  # id(call record) -> its seconds, until read
        super().__init__(*args, **kwargs)

    def clock(self) -> float:
        """Seconds on the virtual clock (0 at construction)."""
        return self._now_s

    def sleep(self, seconds: float) -> None:
        """Idles for ``seconds`` of virtual time (negative: none).

        Raises:
          ValueError: ``seconds`` not a finite number.
        """
        self._now_s += max(check_float("seconds", seconds), 0.0)

    def _compile_clock(self) -> float:
        return 0.0

    def _launch(self, call, prev, record: CallRecord) -> tuple:
        self._due[id(record)] = check_float("step_time.seconds(work)",
                                            self.step_time.seconds(StepWork.from_record(record)), 0)
        return self._outputs(call, prev, record)

    def _read(self, call) -> tuple:
        # The call's seconds, from the later of the previous read (no time passes after it in an iteration
        # here) and its iteration's start: paged_jax.simulator.step_time.call_seconds.
        self._now_s = max(self._now_s, call.record.start_s) + self._due.pop(id(call.record))
        return self._results(call)

    _outputs = Engine._launch  # the device's work and results: the real ones
    _results = Engine._read


class SimulatedEngine(TimedEngine):
    """The engine on a virtual clock, its model calls timed by ``step_time``
    (module docstring). Its API is :class:`paged_jax.engine.core.Engine`'s,
    plus :meth:`sleep`.

    Args:
      step_time: seconds each call adds
        (:mod:`paged_jax.simulator.step_time`).
      config: the engine's configuration, as for a real one.
      num_pages: pages of the simulated pool, the null page included.
      page_size: tokens per page.
      vocab_size: prompt ids are checked against it.
      stop_ids: token ids that would end a request (never produced).
      tokenizer: outputs then carry text (of the simulated tokens).

    Raises:
      ValueError: what :class:`paged_jax.engine.core.Engine` refuses (a pool
        too small for one sequence of ``config.max_seq_len``), or a bad
        ``num_pages``, ``page_size``, ``vocab_size`` or ``step_time``.
    """

    def __init__(self, step_time: StepTimeModel, config: EngineConfig, *, num_pages: int, page_size: int,
                 vocab_size: int, stop_ids: Iterable[int] = (), tokenizer=None):
        check_int("num_pages", num_pages, 2)
        check_int("page_size", page_size)
        if getattr(config, "speculative", None) is not None:
            raise ValueError(f"config.speculative={config.speculative!r:.80}: the simulated accelerator does not "
                             "speculate (its tokens are not a model's to propose); use EngineConfig(speculative=None)")
        if getattr(config, "kv_transfer", None) is not None:
            raise ValueError(f"config.kv_transfer={config.kv_transfer!r}: the simulated accelerator has no K/V to "
                             "hand to another engine; use EngineConfig(kv_transfer=None)")
        if getattr(config, "host_cache_bytes", 0) or getattr(config, "disk_cache_dir", None) is not None:
            raise ValueError(f"config.host_cache_bytes={config.host_cache_bytes}, disk_cache_dir="
                             f"{config.disk_cache_dir!r}: the simulated accelerator has no K/V to keep in tiers and "
                             "times no copies; use EngineConfig(host_cache_bytes=0, disk_cache_dir=None)")
        vocab_size = check_int("vocab_size", vocab_size, 2)
        # One element per slot; K and V two buffers (a swap's copy donates each: one buffer twice is refused).
        k, v = (jnp.zeros((1, 1, num_pages, page_size, 1), jnp.float32) for _ in range(2))
        super().__init__(_NoModel(vocab_size), KVPool(k=k, v=v), config, stop_ids=stop_ids,
                         vocab_size=vocab_size, tokenizer=tokenizer, step_time=step_time)
        self._rows = config.max_seqs * self.kv_manager.groups.num_groups
        self._allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(self.stop_ids, np.int64, len(self.stop_ids)))
        if not len(self._allowed):
            raise ValueError("stop_ids cover the whole vocabulary: a simulated request could never run")

    # -------------------------------------------------------------- calls

    def _token(self, seq, position: int) -> int:
        """The token ``seq`` samples at ``position``: a hash of its request,
        sample index and position, never a stop token."""
        key = f"{seq.request.request_id!r}/{seq.index}/{position}".encode()
        return int(self._allowed[zlib.crc32(key) % len(self._allowed)])

    def _outputs(self, call, prev, record: CallRecord) -> tuple:
        S, k = self._rows, call.options.top_k
        sampled = np.zeros(S, np.int32)
        top_ids, top_lps = np.zeros((S, k), np.int32), np.zeros((S, k), np.float32)
        for seq in call.samplers:
            tok = self._token(seq, len(seq.tokens) + seq.pending)
            sampled[seq.slot] = tok
            if k:  # candidates: this token, then the next allowed ones, each half as likely
                at = int(np.searchsorted(self._allowed, tok))
                top_ids[seq.slot] = self._allowed[(at + np.arange(k)) % len(self._allowed)]
                top_lps[seq.slot] = -np.log(2.0) * (np.arange(k) + 1)
        P, kp = call.shape.num_prompt_logits, call.options.prompt_top_k
        prompt = None if not P else (np.zeros(P, np.float32), np.zeros((P, kp), np.int32),
                                     np.zeros((P, kp), np.float32))
        return (sampled, (top_ids, top_lps), np.zeros(S, np.float32), prompt, None, np.bool_(True),
                np.int32(self.kv_manager.pool.num_free), np.ones(self.config.max_seqs, bool))

    def _results(self, call) -> tuple:
        return (call.sampled, call.top, call.sampled_lp, call.prompt, call.verify, call.ok, call.num_free,
                call.kv_ok)
