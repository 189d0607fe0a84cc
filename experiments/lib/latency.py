"""Latency metrics of online serving, and the arrival traces that drive
it: what :mod:`experiments.lib.online` measures, as plain functions of per-request
records (vLLM's ``vllm/benchmarks/serve.py`` definitions; the paper's
normalized latency, PagedAttention, Kwon et al., SOSP 2023, section 6.1).

Times are seconds on the engine's clock unless a name says ``_ms``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from paged_jax.checks import check_float, check_int
from paged_jax.engine.requests import RequestOutput

SLO_KEYS = ("ttft", "tpot", "e2el")
"""Metrics an SLO may bound (vLLM's ``--goodput`` keys), in milliseconds."""
PERCENTILES = (50, 90, 99)


# --------------------------------------------------------------- arrivals

MAX_TRACE_S = 86_400.0
"""Longest arrival trace :func:`arrival_times` gives, seconds (a day): a
benchmark that waits longer is a typo, not an experiment."""


def arrival_times(num_requests: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """When each request arrives, seconds after the first: f64[num_requests],
    non-decreasing, the first 0.

    The gaps are gamma distributed with shape ``burstiness`` and mean ``1 /
    request_rate`` (vLLM's ``get_request``): ``burstiness = 1`` is a Poisson
    process, below 1 burstier, above 1 more regular, ``inf`` evenly spaced.
    ``request_rate = inf`` sends everything at once. Unlike vLLM, the trace
    is not rescaled to end at ``num_requests / request_rate``: it is a true
    gamma process, whose mean rate is ``request_rate`` in expectation.

    Raises:
      ValueError: ``num_requests`` below 1, ``request_rate`` not > 0 (inf
        allowed), ``burstiness`` not > 0 (inf allowed), ``seed`` below 0,
        or a trace that would not end within :data:`MAX_TRACE_S` (a rate
        or burstiness so small that the gaps overflow or take years).
    """
    check_int("num_requests", num_requests)
    check_rate("request_rate", request_rate)
    check_rate("burstiness", burstiness)
    check_int("seed", seed, 0)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests - 1, 1.0 / request_rate)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), num_requests - 1)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    if not (np.isfinite(times).all() and times[-1] <= MAX_TRACE_S):
        raise ValueError(f"request_rate={request_rate!r} with burstiness={burstiness!r} gives arrivals that do not end "
                         f"within {MAX_TRACE_S:.0f} s (last arrival {times[-1]!r} s): raise them")
    return times


def check_rate(name: str, value) -> float:
    """``value`` as a float if it is a number > 0 or ``inf``.

    Raises:
      ValueError: otherwise, naming ``name`` (``"request_rate must be > 0
        or inf, got request_rate=-1.0"``).
    """
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    try:
        return check_float(name, value, 0, low_open=True)
    except ValueError:
        raise ValueError(f"{name} must be a number > 0 or inf, got {name}={value!r}") from None


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """SLOs from vLLM's ``--goodput`` syntax: ``["ttft:500", "tpot:50"]``
    -> ``{"ttft": 500.0, "tpot": 50.0}``, milliseconds.

    Raises:
      ValueError: an item that is not ``KEY:MS`` with KEY one of
        :data:`SLO_KEYS` (each at most once) and MS a finite number >= 0.
    """
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = str(item).partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        if key in slos:
            raise ValueError(f"{key} given twice ({item!r})")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(f"{key}: the SLO must be a finite number of milliseconds >= 0, got {value!r}")
        slos[key] = ms
    return slos


# ---------------------------------------------------------------- records

@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """What happened to one request, on the engine's clock.

    Attributes:
      arrival_s: its arrival in the trace (what latencies count from).
      added_s: when it was added to the engine (>= ``arrival_s``: the end
        of the step it arrived during).
      first_token_s: when its first token reached the host.
      token_times: when each token of its first completion reached the host.
      finish_s: when its output was complete.
      output_len: tokens of its first completion (TPOT, normalized latency).
      generated: tokens of all its completions (throughput).
    """

    request_id: int | str
    prompt_len: int
    output_len: int
    generated: int
    arrival_s: float
    added_s: float
    first_token_s: float
    token_times: tuple[float, ...]
    finish_s: float
    num_preemptions: int = 0

    @classmethod
    def from_output(cls, out: RequestOutput, *, arrival_s: float) -> RequestRecord:
        """The record of a finished output, whose request arrived at ``arrival_s``."""
        first = out.outputs[0]
        return cls(request_id=out.request_id, prompt_len=len(out.prompt_ids), output_len=len(first.output_ids),
                   generated=sum(len(c.output_ids) for c in out.outputs), arrival_s=arrival_s,
                   added_s=out.arrival_s, first_token_s=out.first_token_s, token_times=tuple(first.token_times),
                   finish_s=out.finish_s, num_preemptions=out.num_preemptions)

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2el(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for one token."""
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None

    @property
    def itls(self) -> np.ndarray:
        """f64[output_len - 1] gaps between consecutive tokens."""
        return np.diff(np.asarray(self.token_times, np.float64))

    @property
    def normalized_latency(self) -> float:
        """End-to-end latency per output token (paper section 6.1)."""
        return self.e2el / self.output_len


@dataclasses.dataclass(frozen=True)
class Summary:
    """Mean and percentiles of one latency, seconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary | None:
        """None for no values."""
        v = np.asarray(values, np.float64)
        if v.size == 0:
            return None
        return cls(float(v.mean()), *(float(np.percentile(v, p)) for p in PERCENTILES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingMetrics:
    """One run's metrics (see the module docstring). ``duration_s``: from
    the first arrival to the last finish; ``goodput`` None when no SLO was
    given; ``tpot`` None when no output has 2 or more tokens; ``mean_running``
    the time-weighted mean of running sequences over the run."""

    completed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft: Summary
    tpot: Summary | None
    itl: Summary | None
    e2el: Summary
    normalized_latency: float
    mean_running: float
    peak_running: int
    preemptions: int


def time_weighted_mean(times: Sequence[float], values: Sequence[float], end: float) -> float:
    """The mean over ``[times[0], end]`` of a step function that takes
    ``values[i]`` from ``times[i]`` until ``times[i + 1]`` (the last until
    ``end``); 0 for an empty interval.

    Raises:
      ValueError: lengths differ, or times decrease, or ``end`` precedes them.
    """
    t = np.asarray(list(times) + [end], np.float64)
    v = np.asarray(values, np.float64)
    if len(v) != len(t) - 1 or len(v) == 0:
        raise ValueError(f"need as many values as times, at least one, got {len(v)} and {len(t) - 1}")
    dt = np.diff(t)
    if (dt < 0).any():
        raise ValueError("times must be non-decreasing and end at or after the last")
    span = t[-1] - t[0]
    return float((v * dt).sum() / span) if span > 0 else 0.0


def compute_metrics(records: Sequence[RequestRecord], *, duration_s: float, slos: Mapping[str, float] | None = None,
                    running: tuple[Sequence[float], Sequence[int], float] | None = None) -> ServingMetrics:
    """The metrics of finished requests.

    Args:
      records: one per request, finished.
      duration_s: the run's length (the throughputs' denominator).
      slos: ``{"ttft"|"tpot"|"e2el": milliseconds}`` (:func:`parse_goodput`);
        None or empty: no goodput.
      running: ``(times, running sequences, end)``, the samples of
        :class:`OnlineRun`; None: ``mean_running`` and ``peak_running`` 0.

    Raises:
      ValueError: no records, or ``duration_s`` not > 0.
    """
    if not records:
        raise ValueError("no finished requests to measure")
    check_float("duration_s", duration_s, 0, low_open=True)
    ttft = [r.ttft for r in records]
    e2el = [r.e2el for r in records]
    tpot = [r.tpot for r in records if r.tpot is not None]
    itl = np.concatenate([r.itls for r in records])
    inputs = sum(r.prompt_len for r in records)
    outputs = sum(r.generated for r in records)
    goodput = None
    if slos:
        bounds = {k: ms / 1000 for k, ms in slos.items()}
        good = sum(all(value <= bounds[k] for k, value in
                       (("ttft", r.ttft), ("tpot", r.tpot or 0.0), ("e2el", r.e2el)) if k in bounds)
                   for r in records)
        goodput = good / duration_s
    mean_running, peak = 0.0, 0
    if running is not None:
        times, counts, end = running
        mean_running, peak = time_weighted_mean(times, counts, end), int(max(counts))
    return ServingMetrics(
        completed=len(records), duration_s=duration_s, input_tokens=inputs, output_tokens=outputs,
        request_throughput=len(records) / duration_s, output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s, goodput=goodput,
        ttft=Summary.of(ttft), tpot=Summary.of(tpot), itl=Summary.of(itl), e2el=Summary.of(e2el),
        normalized_latency=float(np.mean([r.normalized_latency for r in records])),
        mean_running=mean_running, peak_running=peak, preemptions=sum(r.num_preemptions for r in records))
