"""Online serving measured: requests arriving over time, in the spirit of
vLLM's ``vllm bench serve``, and the paper's serving comparison
(PagedAttention, Kwon et al., SOSP 2023, section 6.1-6.2).

The pieces, in the order a run uses them:

* :func:`experiments.lib.latency.arrival_times`: when each request arrives, a gamma process of a
  given rate (shape ``burstiness``; 1 is Poisson, as vLLM's), fixed by a
  seed, so every run and every policy sees the same trace. The gaps are
  ``scale * standard_gamma`` draws, so the traces of one seed at two rates
  are the same trace stretched: rates are compared on common random numbers.
* :func:`run_online`: drives an engine on its own clock, in process: add
  every request whose arrival time has passed, step if there is work, else
  sleep until the next arrival. A request that arrives during a step is
  added when the step returns (as a server's scheduler would only see it at
  its next iteration), but its latency counts from its arrival in the trace,
  as a client's would.
* :func:`experiments.lib.latency.compute_metrics`: vLLM's metrics (``vllm/benchmarks/serve.py``,
  ``calculate_metrics``): throughput in requests, output tokens and all
  tokens per second over the run; TTFT; TPOT = (end-to-end - TTFT) / (output
  tokens - 1) for outputs of 2 or more tokens; inter-token latency, every
  gap between consecutive tokens of every request, pooled; end-to-end
  latency; each as mean, p50, p90, p99 (``numpy.percentile``, linear); the
  paper's normalized latency (end-to-end latency / output tokens, averaged
  over requests, seconds per token; section 6.1); goodput (requests per
  second meeting every SLO given, vLLM's ``--goodput``, a request of one
  output token counting TPOT 0); and the time-weighted mean of running
  sequences (the paper's Figure 13 "batched requests").
* the policies (:mod:`experiments.lib.policies`, ``EngineConfig.reservation``): ``paged``
  (vLLM) against the paper's Orca baselines, which reserve KV for each
  request at admission: its maximum length (``max``, 2,048 tokens), its
  prompt plus its true output length rounded up to a power of two
  (``pow2``), or its prompt plus exactly its true output length
  (``oracle``); :func:`paged_jax.engine.config.reserved_tokens`. Only the
  reservation differs: same engine, model, batching and kernels. A name
  ending ``-nocache`` (``oracle-nocache``) serves without prefix caching.
* the workloads (:mod:`experiments.lib.workloads`): what the requests ask for.
* :func:`run_conversations`: multi-turn chat replayed turn by turn: first
  turns arrive as a Poisson process, each later turn a think time after the
  previous answer's last token, its prompt the previous prompt, the answer
  the engine *generated* (its ids, as a chat client sends back what it was
  shown) and the new user message, so the whole conversation so far is a
  prefix a cache can serve, if it kept it while the engine served the other
  conversations (:func:`experiments.lib.workloads.sharegpt_conversations`).
* :func:`warm_up`: compiles every program an engine of the same model
  object can run (each token bucket with decode tokens only, prefill chunks
  only, and both), so that compilation, which an engine's programs share
  across engines of one model object, stays out of the timed runs.
* :func:`sustained_rate` and the two figures' plots.

Everything runs on the engine's clock (:meth:`paged_jax.engine.core.Engine.clock`);
times are seconds unless a name says ``_ms``.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.lib import serving  # noqa: E402
from experiments.lib.cli import (  # noqa: E402
    add_flag,
    add_flags,
    check_flags,
    machine,
    require_positive,
    resolve_dtype,
    resolve_kv_dtype,
)
from experiments.lib.latency import (  # noqa: E402
    PERCENTILES,
    RequestRecord,
    ServingMetrics,
    arrival_times,
    check_rate,
    compute_metrics,
)
from experiments.lib.policies import ALL_POLICIES, POLICIES, POLICY_LABELS, engine_options, split_policy  # noqa: E402, F401
from experiments.lib.sharegpt import MAX_SEQ_LEN, PACKAGED_LIMIT  # noqa: E402
from experiments.lib.workloads import Conversation, Workload, describe, workload  # noqa: E402, F401  (re-exported: bench_serving)
from models.config import LlamaConfig  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.llm import as_paged_model  # noqa: E402
from models.presets import PRESETS  # noqa: E402
from paged_jax.checks import check_bool, check_choice, check_float  # noqa: E402
from paged_jax.engine.core import Engine  # noqa: E402
from paged_jax.engine.requests import Request, RequestOutput  # noqa: E402
from paged_jax.jit_stats import CompileCounts, CompileMonitor  # noqa: E402
from paged_jax.simulator.engine import SimulatedEngine, TimedEngine  # noqa: E402
from paged_jax.speculative.config import SpeculativeConfig, add_speculative_flags, speculative_from_args  # noqa: E402

TOY_CONFIG = LlamaConfig(vocab_size=49152, model_dim=64, mlp_dim=128, num_layers=2, num_q_heads=4,
                         num_kv_heads=2, head_dim=16)
"""``--model toy``: a two-layer decoder with random weights and SmolLM2's
vocabulary size (the packaged requests' chat-template ids fit), for smoke
runs of the whole benchmark in seconds."""


# ------------------------------------------------------------------ driver

@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineRun:
    """What :func:`run_online` saw.

    Attributes:
      outputs: the finished outputs, in the order of the requests.
      records: one per request, in the same order.
      start_s: the engine-clock time of the trace's zero.
      end_s: when the last request finished.
      running_times, running_counts: ``len(engine.running)`` after each
        step and each sleep, and when (the first sample, 0, at ``start_s``).
    """

    outputs: list[RequestOutput]
    records: list[RequestRecord]
    start_s: float
    end_s: float
    running_times: list[float]
    running_counts: list[int]

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def metrics(self, slos: Mapping[str, float] | None = None) -> ServingMetrics:
        return compute_metrics(self.records, duration_s=self.duration_s, slos=slos,
                               running=(self.running_times, self.running_counts,
                                        max(self.end_s, self.running_times[-1])))


def run_online(engine: Engine, requests: Sequence[Request], arrivals: Sequence[float], *, progress: bool = False,
               sleep: Callable[[float], None] | None = None) -> OnlineRun:
    """Serves ``requests[i]`` arriving ``arrivals[i]`` seconds after the
    start, on ``engine``'s clock, until all have finished.

    The loop: add every request whose arrival has passed; if the engine has
    work, step; else sleep until the next arrival.

    Args:
      engine: an engine with no unfinished requests.
      arrivals: non-decreasing seconds, one per request
        (:func:`arrival_times`).
      progress: a bar of finished requests (none when stderr is not a
        terminal).
      sleep: waits that many seconds of the engine's clock; default
        ``time.sleep``, or a virtual clock's own
        (:meth:`paged_jax.simulator.engine.TimedEngine.sleep`).

    Raises:
      ValueError: lengths differ, arrivals decrease or are negative, the
        engine is busy; from :meth:`Engine.add_request`, a request it refuses.
    """
    arrivals = np.asarray(arrivals, np.float64)
    if arrivals.shape != (len(requests),):
        raise ValueError(f"need one arrival per request, got {arrivals.shape} for {len(requests)} requests")
    if len(requests) and (arrivals[0] < 0 or (np.diff(arrivals) < 0).any()):
        raise ValueError("arrivals must be non-negative and non-decreasing")
    if engine.has_unfinished():
        raise ValueError("the engine already has unfinished requests")
    if sleep is None:
        sleep = engine.sleep if isinstance(engine, TimedEngine) else time.sleep
    taken: set = set()
    for r in requests:  # all or nothing: a bad request fails before the clock starts
        engine.check_request(r, taken)
        taken.add(r.request_id)
    bar = tqdm(total=len(requests), unit="req", leave=False, disable=None) if progress else None
    start = engine.clock()
    due = start + arrivals
    arrival_of = {r.request_id: float(t) for r, t in zip(requests, due)}
    outputs: dict = {}
    times, counts = [start], [0]
    added = 0
    while added < len(requests) or engine.has_unfinished():
        now = engine.clock()
        while added < len(requests) and due[added] <= now:
            engine.add_request(requests[added])
            added += 1
        if engine.has_unfinished():
            done = [o for o in engine.step() if o.finished]
            for o in done:
                outputs[o.request_id] = o
            if bar is not None and done:
                bar.update(len(done))
                bar.set_postfix(running=len(engine.running), waiting=len(engine.waiting))
        else:
            sleep(max(0.0, due[added] - engine.clock()))
        times.append(engine.clock())
        counts.append(len(engine.running))
    if bar is not None:
        bar.close()
    order = [r.request_id for r in requests]
    outs = [outputs[i] for i in order]
    records = [RequestRecord.from_output(o, arrival_s=arrival_of[o.request_id]) for o in outs]
    end = max((r.finish_s for r in records), default=start)
    return OnlineRun(outputs=outs, records=records, start_s=start, end_s=end, running_times=times,
                     running_counts=counts)


# ------------------------------------------------------------ multi-turn

@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversationRun:
    """What :func:`run_conversations` saw.

    Attributes:
      outputs: every turn's output, by ``(conv_id, turn)``.
      records: every turn's record, in the order the turns finished.
      turns: ``(conv_id, turn)`` of each record.
      start_s, end_s: the engine-clock times of the first arrival and the
        last finish.
    """

    outputs: dict
    records: list[RequestRecord]
    turns: list[tuple[int, int]]
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def run_conversations(engine: Engine, conversations: Sequence[Conversation], *, conversation_rate: float,
                      think_s: float, seed: int = 0) -> ConversationRun:
    """Replays ``conversations`` on ``engine`` (greedy, EOS ignored, each
    answer exactly its length): first turns arrive as a Poisson process of
    ``conversation_rate`` conversations a second (``inf``: all at once),
    each later turn a think time after the previous answer finished, drawn
    exponential with mean ``think_s`` seconds (0: at once) from ``seed``.

    Raises:
      ValueError: an argument out of range, or the engine busy.
    """
    think_s = check_float("think_s", think_s, 0.0)
    if engine.has_unfinished():
        raise ValueError("the engine already has unfinished requests")
    rng = np.random.default_rng(seed)
    start = engine.clock()
    firsts = arrival_times(len(conversations), conversation_rate, seed=seed) if conversations else []
    due: list[tuple[float, int, int, list[int]]] = [
        (start + float(t), c.conv_id, 0, list(c.turns[0][0])) for c, t in zip(conversations, firsts)]
    heapq.heapify(due)
    by_id = {c.conv_id: c for c in conversations}
    arrival: dict = {}
    outputs: dict = {}
    records, turns = [], []
    while due or engine.has_unfinished():
        now = engine.clock()
        while due and due[0][0] <= now:
            t, conv, turn, prompt = heapq.heappop(due)
            arrival[(conv, turn)] = t
            engine.add_request(Request(request_id=(conv, turn), prompt_ids=prompt,
                                       max_new_tokens=by_id[conv].turns[turn][1], ignore_eos=True))
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[0][0] - engine.clock()))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            key = out.request_id
            outputs[key] = out
            records.append(RequestRecord.from_output(out, arrival_s=arrival[key]))
            turns.append(key)
            conv, turn = key
            turns_left = by_id[conv].turns
            if turn + 1 < len(turns_left):
                prompt = list(out.prompt_ids) + list(out.outputs[0].output_ids) + list(turns_left[turn + 1][0])
                wait = float(rng.exponential(think_s)) if think_s else 0.0
                heapq.heappush(due, (engine.clock() + wait, conv, turn + 1, prompt))
    end = max((r.finish_s for r in records), default=start)
    return ConversationRun(outputs=outputs, records=records, turns=turns, start_s=start, end_s=end)


def check_outputs_equal(runs: Sequence[ConversationRun]) -> int:
    """Turns whose output ids are the same in every run (greedy replays of
    the same conversations)."""
    keys = set.intersection(*(set(r.outputs) for r in runs)) if runs else set()
    return sum(all(r.outputs[k].outputs[0].output_ids == runs[0].outputs[k].outputs[0].output_ids for r in runs)
               for k in keys)


def hit_tokens(outputs: Sequence[RequestOutput]) -> tuple[int, int, int]:
    """``(prompt tokens, cached tokens, of them from the host tier)`` over
    ``outputs``."""
    return (sum(len(o.prompt_ids) for o in outputs), sum(o.num_cached_tokens for o in outputs),
            sum(o.num_host_cached_tokens for o in outputs))


# ---------------------------------------------------------------- warm-up

def warmup_batches(*, max_batched_tokens: int, max_seqs: int, max_seq_len: int, vocab_size: int,
                   min_tokens: int = 16, max_prefill_chunks: int = 8, seed: int = 0) -> list[list[Request]]:
    """Batches of requests that, each served alone on a fresh-enough engine,
    make the engine run every static call shape it can: for each token
    bucket (powers of two from ``min_tokens``, :func:`paged_jax.attention.batch.batch_shape`)
    a call of prefill chunks only, one of one-token rows only (one-token
    prompts look like decodes) and one of both, each with as many tokens as
    the bucket holds (or the budget allows). Prompts are random ids, so no
    two share a cached page. Greedy, two output tokens each.
    """
    rng = np.random.default_rng(seed)
    longest = max_seq_len - 2  # room for two output tokens
    batches: list[list[Request]] = []

    def prompts(lengths):
        n = len(batches)
        return [Request(request_id=f"warmup-{n}-{i}", prompt_ids=rng.integers(0, vocab_size, k).tolist(),
                        max_new_tokens=2) for i, k in enumerate(lengths)]

    def chunks(total):  # prompts of >= 2 tokens summing to total, each short enough
        parts = -(-total // longest)
        return [total // parts + (i < total % parts) for i in range(parts)]

    bucket = min_tokens
    while bucket // 2 < max_batched_tokens:
        tokens = min(bucket, max_batched_tokens)
        if bucket == min_tokens or tokens > bucket // 2:
            prefill = chunks(tokens)
            if len(prefill) <= min(max_prefill_chunks, max_seqs) and min(prefill) >= 2:
                batches.append(prompts(prefill))
            mixed = chunks(tokens - 1)
            if len(mixed) + 1 <= max_seqs and len(mixed) <= max_prefill_chunks and min(mixed) >= 2:
                batches.append(prompts([1] + mixed))
            ones = min(tokens, max_seqs)
            if bucket == min_tokens or ones > bucket // 2:
                batches.append(prompts([1] * ones))
        bucket *= 2
    return batches


def warm_up(engine: Engine, *, seed: int = 0, workload: Workload | None = None) -> CompileCounts:
    """Serves :func:`warmup_batches` for ``engine``'s limits on it, so that
    engines of the same model object compile nothing more for greedy
    requests, or with ``workload`` for its requests (parallel samples and
    beams run programs of their own; those are warmed on the same batches,
    which may not reach every shape: the runs' ``compiled`` column tells).
    Returns what was compiled (or loaded from the persistent cache)."""
    c = engine.config
    batches = warmup_batches(max_batched_tokens=c.max_num_batched_tokens, max_seqs=c.max_seqs,
                             max_seq_len=c.max_seq_len, vocab_size=engine.vocab_size,
                             min_tokens=c.tiling.min_tokens, max_prefill_chunks=c.tiling.max_prefill_chunks,
                             seed=seed)
    with CompileMonitor() as monitor:
        for batch in batches:
            engine.run(batch if workload is None else workload.apply(batch))
    return monitor.counts


# --------------------------------------------------------------- policies

@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """How every engine of a comparison is built (only the policy varies):
    :func:`experiments.lib.serving.make_engine`'s arguments. Engines share
    ``paged_model``, hence compiled programs."""

    model: Llama
    paged_model: object
    kv_tokens: int
    page_size: int = 16
    max_seqs: int = 64
    max_batched_tokens: int = 256
    prefix_caching: bool = True
    kv_dtype: object = None
    speculative: SpeculativeConfig | None = None

    def build(self, policy: str, **config) -> Engine:
        """An engine of ``policy`` (:data:`experiments.lib.policies.ALL_POLICIES`:
        a reservation, its allocator, ``-nocache`` turning prefix caching
        off); ``config``: further ``EngineConfig`` fields
        (``call_records``).

        Raises:
          ValueError: an unknown policy.
        """
        return serving.make_engine(self.model, kv_tokens=self.kv_tokens, page_size=self.page_size,
                                   max_seqs=self.max_seqs, max_batched_tokens=self.max_batched_tokens,
                                   paged_model=self.paged_model, kv_dtype=self.kv_dtype,
                                   speculative=self.speculative, **self._options(policy), **config)

    def simulate(self, policy: str, step_time, **config) -> SimulatedEngine:
        """What :meth:`build` builds, simulated: the same configuration and
        pool size, its calls timed by ``step_time``
        (:mod:`paged_jax.simulator`)."""
        engine_config = serving.engine_config(max_seqs=self.max_seqs, max_batched_tokens=self.max_batched_tokens,
                                              **self._options(policy), **config)
        return SimulatedEngine(step_time, engine_config, num_pages=serving.pool_pages(self.kv_tokens, self.page_size),
                               page_size=self.page_size, vocab_size=self.model.config.vocab_size)

    def _options(self, policy: str) -> dict:
        options = engine_options(policy)
        options["enable_prefix_caching"] = self.prefix_caching and options["enable_prefix_caching"]
        return options


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineResult:
    """One (policy, rate) run: its metrics, what it saw, and what JAX
    compiled during it (nothing, after :func:`warm_up`); ``discarded``:
    programs an earlier attempt of the same run compiled, which
    :func:`serve_online` then repeated warm (0: none)."""

    policy: str
    request_rate: float
    burstiness: float
    metrics: ServingMetrics
    run: OnlineRun
    compiles: CompileCounts
    discarded: int = 0

    def row(self) -> dict:
        """The CSV row: :data:`METRIC_COLUMNS` -> value (None: empty)."""
        m = self.metrics
        row = {"policy": self.policy, "request_rate": self.request_rate, "burstiness": self.burstiness,
               "requests": m.completed, "duration_s": round(m.duration_s, 3),
               "request_throughput": round(m.request_throughput, 4),
               "output_throughput": round(m.output_throughput, 2),
               "total_token_throughput": round(m.total_token_throughput, 2),
               "goodput": None if m.goodput is None else round(m.goodput, 4)}
        for name in ("ttft", "tpot", "itl", "e2el"):
            s = getattr(m, name)
            for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
                row[f"{stat}_{name}_ms"] = None if s is None else round(getattr(s, stat) * 1000, 2)
        row.update(normalized_latency_s=round(m.normalized_latency, 4), mean_running=round(m.mean_running, 2),
                   peak_running=m.peak_running, preemptions=m.preemptions,
                   mean_cached_tokens=round(self.mean_cached_tokens, 1), compiled=self.compiles.requests,
                   repeated_after_compiling=self.discarded,
                   spec_acceptance_rate=None if self.acceptance_rate is None else round(self.acceptance_rate, 4))
        return row

    @property
    def acceptance_rate(self) -> float | None:
        """Speculative decoding: accepted / proposed tokens over the run's
        requests (``CompletionOutput.num_accepted_tokens``); None when
        nothing was proposed."""
        done = [c for o in self.run.outputs for c in o.outputs]
        proposed = sum(c.num_proposed_tokens for c in done)
        return sum(c.num_accepted_tokens for c in done) / proposed if proposed else None

    @property
    def mean_cached_tokens(self) -> float:
        """Prompt tokens per request served from the prefix cache, on average
        (``RequestOutput.num_cached_tokens``)."""
        return float(np.mean([o.num_cached_tokens for o in self.run.outputs])) if self.run.outputs else 0.0

    def request_rows(self) -> list[dict]:
        """One row per request (:data:`REQUEST_COLUMNS`), times from the run's start."""
        t0 = self.run.start_s
        return [{"policy": self.policy, "request_rate": self.request_rate, "request_id": r.request_id,
                 "prompt_len": r.prompt_len, "output_len": r.output_len, "arrival_s": round(r.arrival_s - t0, 4),
                 "added_s": round(r.added_s - t0, 4), "first_token_s": round(r.first_token_s - t0, 4),
                 "finish_s": round(r.finish_s - t0, 4), "ttft_ms": round(r.ttft * 1e3, 2),
                 "tpot_ms": None if r.tpot is None else round(r.tpot * 1e3, 2), "e2el_ms": round(r.e2el * 1e3, 2),
                 "normalized_latency_s": round(r.normalized_latency, 4), "num_preemptions": r.num_preemptions}
                for r in self.run.records]


METRIC_COLUMNS = (
    "policy", "request_rate", "burstiness", "requests", "duration_s", "request_throughput", "output_throughput",
    "total_token_throughput", "goodput",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", *(f"p{p}" for p in PERCENTILES))),
    "normalized_latency_s", "mean_running", "peak_running", "preemptions", "mean_cached_tokens", "compiled",
    "repeated_after_compiling", "spec_acceptance_rate",
)
"""The columns of :meth:`OnlineResult.row`, in order; ``mean_cached_tokens``:
prompt tokens per request served from the prefix cache; ``compiled``: XLA
programs requested during the run (compiled or loaded from the cache);
``repeated_after_compiling``: programs a first attempt of the run compiled
(it was discarded and the run repeated warm, :func:`serve_online`);
``spec_acceptance_rate``: speculative decoding's accepted / proposed
tokens (empty without speculation)."""
REQUEST_COLUMNS = ("policy", "request_rate", "request_id", "prompt_len", "output_len", "arrival_s", "added_s",
                   "first_token_s", "finish_s", "ttft_ms", "tpot_ms", "e2el_ms", "normalized_latency_s",
                   "num_preemptions")
"""The columns of :meth:`OnlineResult.request_rows`."""
SUMMARY_COLUMNS = ("policy", "request_rate", "request_throughput", "output_throughput", "goodput", "mean_ttft_ms",
                   "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                   "p99_e2el_ms", "normalized_latency_s", "mean_running", "preemptions")
"""The columns a Markdown summary shows (the CSV has all of :data:`METRIC_COLUMNS`)."""


def cell(column: str, value) -> str:
    """A Markdown cell: ``-`` for None, policies by their paper names."""
    if value is None:
        return "-"
    if column == "policy":
        return POLICY_LABELS.get(value, value)
    return str(value)


def serve_online(make_engine: Callable[[str], Engine], requests: Sequence[Request], *, policy: str,
                 request_rate: float, burstiness: float = 1.0, seed: int = 0,
                 slos: Mapping[str, float] | None = None, progress: bool = False,
                 repeat_if_compiled: bool = True) -> OnlineResult:
    """Serves ``requests`` arriving at ``request_rate`` (:func:`arrival_times`
    with ``seed``) on a fresh engine ``make_engine(policy)``.

    A run during which JAX compiled a program (a batch shape the warm-up
    did not reach: parallel samples and beams run shapes of their own) has
    its latencies inflated by the compilation; with ``repeat_if_compiled``
    it is discarded and run once more on a fresh engine (warm, unless it
    reaches yet another new shape: its ``compiled`` then says so), and the
    result says how many programs the discarded attempt compiled
    (:attr:`OnlineResult.discarded`).

    Raises:
      ValueError: from :func:`arrival_times` or :func:`run_online`.
    """
    check_choice("policy", policy, ALL_POLICIES)
    check_bool("repeat_if_compiled", repeat_if_compiled)
    arrivals = arrival_times(len(requests), request_rate, burstiness=burstiness, seed=seed)
    discarded = 0
    while True:
        engine = make_engine(policy)
        with CompileMonitor() as monitor:
            run = run_online(engine, requests, arrivals, progress=progress)
        if isinstance(engine, TimedEngine):  # a virtual clock: compiling took none of its time
            break
        if not (repeat_if_compiled and monitor.counts.requests and not discarded):
            break
        discarded = monitor.counts.requests
    return OnlineResult(policy=policy, request_rate=float(request_rate), burstiness=float(burstiness),
                        metrics=run.metrics(slos), run=run, compiles=monitor.counts, discarded=discarded)


def report(result: OnlineResult) -> str:
    """vLLM's printed summary of one run, as text."""
    m = result.metrics
    lines = [f"{'=' * 14} {POLICY_LABELS[result.policy]} at {result.request_rate:g} req/s {'=' * 14}",
             f"requests: {m.completed}   duration: {m.duration_s:.2f} s   preemptions: {m.preemptions}"
             + ("" if result.acceptance_rate is None else
                f"   speculative acceptance: {result.acceptance_rate:.3f}"),
             f"throughput: {m.request_throughput:.3f} req/s, {m.output_throughput:.1f} output tok/s, "
             f"{m.total_token_throughput:.1f} total tok/s" + (
                 "" if m.goodput is None else f"; goodput {m.goodput:.3f} req/s")]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        s = getattr(m, name)
        lines.append(f"{label:>5} ms: " + ("-" if s is None else
                                          f"mean {s.mean * 1e3:.1f}  p50 {s.p50 * 1e3:.1f}  "
                                          f"p90 {s.p90 * 1e3:.1f}  p99 {s.p99 * 1e3:.1f}"))
    lines.append(f"normalized latency {m.normalized_latency:.4f} s/token; mean running {m.mean_running:.2f} "
                 f"(peak {m.peak_running}); {result.compiles.requests} programs compiled during the run" + (
                     f" (a first attempt compiled {result.discarded}: discarded and run again)"
                     if result.discarded else ""))
    return "\n".join(lines)


# ---------------------------------------------------------- command line
# The flags the online scripts share (bench_serving, serving_figures).

def add_serving_flags(p: argparse.ArgumentParser, *, num_requests: int, max_output_len: int,
                      speculative: bool = False) -> None:
    """The flags of the model, the requests, the engine and the arrivals;
    with ``speculative``, speculative decoding's too
    (:func:`paged_jax.speculative.config.add_speculative_flags`)."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the GGUF, default), a Hugging Face checkpoint folder, a random-weight preset "
                        f"({', '.join(sorted(PRESETS))}; packaged ShareGPT lengths) or 'toy' (a two-layer random "
                        "decoder with the packaged lengths, for smoke runs)")
    add_flag(p, "dtype")
    add_flag(p, "kv_dtype")
    add_flag(p, "num_requests", default=num_requests, help=f"ShareGPT requests (default {num_requests})")
    add_flag(p, "max_output_len", default=max_output_len,
             help=f"cap on each request's true output length, tokens (default {max_output_len})")
    add_flag(p, "seed", help="ShareGPT shuffle seed (with a preset or toy, of the random prompt ids) and arrival "
                             "seed (default 0)")
    add_flags(p, "page_size", "max_seqs")
    p.add_argument("--kv-budget-tokens", type=int, default=8192,
                   help="KV pool size in tokens (default 8192, the demo's: 4 reservations of 2048)")
    p.add_argument("--max-batched-tokens", type=int, default=256,
                   help="tokens per model call (default 256; raised to --max-seqs)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma inter-arrival times: 1 is Poisson (default), < 1 burstier, > 1 more "
                        "regular, inf evenly spaced")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    if speculative:
        add_speculative_flags(p)


def check_serving_flags(p: argparse.ArgumentParser, args) -> None:
    """Exits with an argparse error naming the flag for a bad value of a
    flag :func:`add_serving_flags` added."""
    check_flags(p, args)
    require_positive(p, args, "max_batched_tokens")
    args.speculative_config = speculative_from_args(p, args) if "speculative" in vars(args) else None
    try:
        check_rate("--burstiness", args.burstiness)
    except ValueError as e:
        p.error(str(e))
    if args.kv_budget_tokens // args.page_size * args.page_size < MAX_SEQ_LEN:
        p.error(f"--kv-budget-tokens rounded down to whole pages of --page-size {args.page_size} must hold one "
                f"maximum-length request ({MAX_SEQ_LEN} tokens), got {args.kv_budget_tokens}")
    if (args.model in PRESETS or args.model == "toy") and args.num_requests > PACKAGED_LIMIT:
        p.error(f"--num-requests {args.num_requests}: --model {args.model} serves the {PACKAGED_LIMIT} packaged "
                "requests at most")


def check_rates(p: argparse.ArgumentParser, flag: str, rates: Sequence[float]) -> list[float]:
    """``rates`` sorted, or an argparse error naming ``flag`` for a rate not
    > 0 (inf allowed) or given twice."""
    for rate in rates:
        try:
            check_rate(flag, rate)
        except ValueError as e:
            p.error(str(e))
    if len(set(rates)) != len(rates):
        p.error(f"{flag} lists a rate twice: {list(rates)}")
    return sorted(rates)


def load_setup(args) -> tuple[str, list[Request], EngineSpec, str]:
    """``(model name, requests, engine spec, a line describing them)`` for
    :func:`add_serving_flags`' flags."""
    dtype = resolve_dtype(args.dtype)
    kv_dtype = resolve_kv_dtype(args.kv_dtype)
    t0 = time.perf_counter()
    model, tokenizer, model_name = load_model(args.model, dtype)
    requests, source = args.workload_.requests(tokenizer, vocab_size=model.config.vocab_size,
                                               num_requests=args.num_requests, max_output_len=args.max_output_len,
                                               seed=args.seed)
    spec = EngineSpec(model=model, paged_model=as_paged_model(model), kv_tokens=args.kv_budget_tokens,
                      page_size=args.page_size, max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens,
                      prefix_caching=not args.no_prefix_caching, kv_dtype=kv_dtype,
                      speculative=args.speculative_config)
    setup = (f"{model_name}, weights {dtype.name}, K/V {kv_dtype.name}, loaded in {time.perf_counter() - t0:.1f} s; "
             f"{len(requests)} requests ({source}; {describe(requests)}): "
             f"{sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
             f"{sum(r.max_new_tokens for r in requests)} output tokens (true lengths capped at "
             f"{args.max_output_len}, EOS ignored); KV budget {args.kv_budget_tokens} tokens, page size "
             f"{args.page_size}, max {args.max_seqs} running, {max(args.max_batched_tokens, args.max_seqs)} tokens "
             f"per model call, prefix caching {'off' if args.no_prefix_caching else 'on'}; {machine()}")
    return model_name, requests, spec, setup


def warm_up_line(spec: EngineSpec, workload: Workload | None = None) -> str:
    """Runs :func:`warm_up` on a paged engine of ``spec``; says what it did."""
    t0 = time.perf_counter()
    counts = warm_up(spec.build("paged"), workload=workload)
    return (f"warm-up: {counts.requests} programs compiled or loaded from the cache ({counts.compiled} compiled) "
            f"in {time.perf_counter() - t0:.1f} s")


# ------------------------------------------------------------ model, data

def load_model(spec: str, dtype=jnp.float32):
    """``(model, tokenizer, name)``: ``"toy"`` (:data:`TOY_CONFIG`, random
    weights, no tokenizer), else :func:`experiments.lib.serving.load_model`."""
    if spec == "toy":
        return Llama(TOY_CONFIG, rngs=nnx.Rngs(0), param_dtype=dtype), None, "toy decoder (random weights)"
    return serving.load_model(spec, dtype)


def sharegpt_engine(args, seeds: Sequence[int], **config):
    """A script's engine and its requests, from its flags: ``--model``,
    ``--dtype``, ``--kv-dtype``, ``--kv-budget-tokens``, ``--page-size``,
    ``--max-seqs``, ``--max-seq-len``, ``--max-batched-tokens``, and the
    basic workload's ``--num-requests`` capped at ``--max-output-len``, one
    draw per seed of ``seeds``; ``config``: further ``EngineConfig`` fields.

    Returns:
      ``(engine, [requests of each seed], model name, the requests' source)``.
    """
    model, tokenizer, model_name = load_model(args.model, resolve_dtype(args.dtype))
    draws = [workload("basic").requests(tokenizer, vocab_size=model.config.vocab_size, num_requests=args.num_requests,
                                        max_output_len=args.max_output_len, seed=seed) for seed in seeds]
    engine = serving.make_engine(model, kv_tokens=args.kv_budget_tokens, page_size=args.page_size,
                                 max_seqs=args.max_seqs, max_seq_len=args.max_seq_len,
                                 max_batched_tokens=args.max_batched_tokens, paged_model=as_paged_model(model),
                                 kv_dtype=resolve_kv_dtype(args.kv_dtype), **config)
    return engine, [requests for requests, _ in draws], model_name, draws[0][1]


# ------------------------------------------------------------- the figures

@dataclasses.dataclass(frozen=True)
class Sustained:
    """The highest rate a policy sustains with normalized latency at or
    below a threshold. ``bound``: None (crossed between two swept rates,
    ``rate`` interpolated), ``"at least"`` (never crossed: ``rate`` is the
    highest swept) or ``"below"`` (over the threshold already at the
    lowest rate, ``rate`` that rate)."""

    rate: float
    bound: str | None = None

    def __str__(self) -> str:
        if self.bound == "at least":
            return f">= {self.rate:.3g}"
        if self.bound == "below":
            return f"< {self.rate:.3g}"
        return f"{self.rate:.3g}"


def sustained_rate(rates: Sequence[float], latencies: Sequence[float | None], threshold: float) -> Sustained:
    """Where normalized latency first rises above ``threshold`` (s/token),
    interpolated linearly between the last rate at or below it and the first
    above; a latency None (a rate not run, beyond the policy's capacity)
    counts as above.

    Raises:
      ValueError: no rates, rates not increasing, lengths differ.
    """
    rates = [float(r) for r in rates]
    if not rates or len(rates) != len(latencies) or any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"need increasing rates and one latency each, got {rates} and {list(latencies)}")
    for i, (r, lat) in enumerate(zip(rates, latencies)):
        if lat is None or lat > threshold:
            if i == 0:
                return Sustained(r, "below")
            r0, l0 = rates[i - 1], latencies[i - 1]
            if lat is None:
                return Sustained(r0)
            return Sustained(r0 + (r - r0) * (threshold - l0) / (lat - l0))
    return Sustained(rates[-1], "at least")


def ratio(a: Sustained, b: Sustained) -> str:
    """``a / b`` as text, with its direction when either is a bound."""
    lo = a.bound == "below" or b.bound == "at least"
    hi = a.bound == "at least" or b.bound == "below"
    if lo and hi:
        return "-"
    value = f"{a.rate / b.rate:.2f}x"
    return f"<= {value}" if lo else f">= {value}" if hi else value


def plot_latency_vs_rate(path: pathlib.Path, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
                         threshold: float | None, title: str) -> None:
    """Normalized latency (s/token) against request rate, one line per
    policy (``series[policy] = (rates, latencies)``), the threshold dashed."""
    plot_latency_panels(path, {"": (series, threshold)}, title=title)


Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]
"""A plot's lines: ``series[policy] = (rates, normalized latencies)``."""


def plot_latency_panels(path: pathlib.Path, panels: Mapping[str, tuple[Series, float | None]], *, title: str) -> None:
    """:func:`plot_latency_vs_rate` for several workloads side by side:
    ``panels[workload] = (series, threshold)``, one panel each (titled with
    the workload where there are several), up to three a row."""
    n = len(panels)
    cols = min(n, 3)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 if n == 1 else 4.3 * cols, 4.2 if n == 1 else 3.6 * nrows),
                             squeeze=False)
    for ax, (name, (series, threshold)) in zip(axes.flat, panels.items()):
        for i, (policy, (rates, lats)) in enumerate(series.items()):
            ax.plot(rates, lats, "os^v"[i % 4] + "-", label=POLICY_LABELS.get(policy, policy))
        if threshold is not None:
            ax.axhline(threshold, color="gray", linestyle="--", linewidth=1, label=f"threshold {threshold:g} s/token")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if n > 1 else 8)
        if n > 1:
            ax.set_title(name, fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    (fig.suptitle if n > 1 else axes[0, 0].set_title)(title, fontsize=9 if n == 1 else 10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_batched_requests(path: pathlib.Path, ours: Mapping[str, float], paper: Mapping[str, float] | None, *,
                          title: str) -> None:
    """Bars of mean running requests per policy; the paper's beside them."""
    policies = list(ours)
    x = np.arange(len(policies))
    width = 0.38 if paper else 0.6
    fig, ax = plt.subplots(figsize=(6.5, 4))
    bars = ax.bar(x - (width / 2 if paper else 0), [ours[p] for p in policies], width, label="measured")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    if paper:
        bars = ax.bar(x + width / 2, [paper.get(p, 0) for p in policies], width, label="paper (OPT-13B, ShareGPT)",
                      color="#BBBBBB")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(x, [POLICY_LABELS[p] for p in policies])
    ax.set_ylabel("mean batched (running) requests")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
