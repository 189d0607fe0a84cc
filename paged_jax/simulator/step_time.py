"""Step-time models: seconds one engine call adds to the clock, from what
the call does.

A call's work is what the engine records of it
(:class:`paged_jax.engine.stats.CallRecord`, as :class:`StepWork`): its
bucketed token rows and logit rows (the program that runs), its real
tokens, sequences, the K/V tokens its attention reads and the (query, key)
pairs it scores. Three models:

- :class:`ProfiledStepTime` (Vidur's way, Agrawal et al., MLSys 2024): the
  real engine's calls timed on the device at hand
  (``python -m experiments.simulator.profile_steps``) and a non-negative
  least-squares fit over features each proportional to a part of the work
  (:data:`FEATURES`: a fixed cost per call, weights times padded tokens,
  the LM head times logit rows, per-sequence bookkeeping, K/V bytes read,
  attention FLOPs), least squares on the seconds. Non-negative, so no part of the work ever makes a call
  faster; linear, so it extrapolates to batches the profile did not reach
  as the work grows, where a table lookup would clamp.
- :class:`RooflineStepTime`, for devices not at hand: FLOPs and bytes of the
  call from the model's shape (:class:`paged_jax.simulator.hardware.ModelShape`)
  over a device's peaks (:class:`paged_jax.simulator.hardware.DeviceSpec`):
  ``overhead + max(FLOPs / (peak x e_flops), bytes / (bandwidth x e_bw))``,
  with the efficiencies fitted to a profile where one exists
  (:meth:`RooflineStepTime.fitted`) and stated where not.
- :class:`ReplayStepTime`: the seconds a real run measured, call by call, in
  order (for checking that a simulated engine makes the real one's
  decisions).

The time a call adds is what a busy engine's clock shows between the end
of the iteration that read the previous call and the end of the one that
reads it (:func:`call_seconds`): with ``async_scheduling`` it includes the
host's scheduling of the next call, which overlaps the device's work.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Protocol, Sequence

import numpy as np

from paged_jax.checks import check_choice, check_float, check_instance, check_int
from paged_jax.engine.stats import CallRecord
from paged_jax.memory import dtype_bytes
from paged_jax.simulator.hardware import DeviceSpec, ModelShape


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one call does (the fields of
    :class:`paged_jax.engine.stats.CallRecord` a step time depends on).

    Attributes:
      padded_tokens: T, token rows of its program (bucketed, padding
        included).
      logit_rows: R, rows whose logits it computes (bucketed).
      tokens: real query tokens.
      decode_tokens: of them, one-token decodes.
      rows: sequences in the call.
      context_tokens: K/V tokens its attention reads, each sequence's once.
      attention_pairs: (query, key) pairs it scores.
    """

    padded_tokens: int
    logit_rows: int
    tokens: int
    decode_tokens: int
    rows: int
    context_tokens: int
    attention_pairs: int

    @classmethod
    def from_record(cls, rec: CallRecord) -> StepWork:
        return cls(padded_tokens=rec.shape.num_tokens, logit_rows=rec.shape.num_logits, tokens=rec.tokens,
                   decode_tokens=rec.decode_tokens, rows=rec.rows, context_tokens=rec.context_tokens,
                   attention_pairs=rec.attention_pairs)


class StepTimeModel(Protocol):
    """Seconds a call adds to a busy engine's clock."""

    name: str  # what produced the times, for tables ("profiled on cpu", "roofline on a100-40gb")

    def seconds(self, work: StepWork) -> float: ...


def call_seconds(records: Sequence[CallRecord]) -> list[float]:
    """The seconds each call added to the engine's clock: from the later of
    the end of the iteration that read the previous call and the start of
    its own iteration, to the end of the iteration that read it
    (``records`` in call order, all of a run's: ``EngineConfig(
    call_records=None)``). A busy engine's iterations are the sum of them;
    idle time between iterations is in none."""
    out, prev = [], -math.inf
    for rec in records:
        out.append(rec.done_s - max(rec.start_s, prev))
        prev = rec.done_s
    return out


def profile_rows(rows: Sequence[dict]) -> tuple[list[StepWork], list[float]]:
    """The calls and seconds of a profile's rows (dicts with
    :class:`StepWork`'s fields and ``seconds``, as
    ``python -m experiments.simulator.profile_steps`` writes them; strings
    as read from its CSV are parsed).

    Raises:
      ValueError: a row without one of the fields, or a field not a whole
        number >= 0, or seconds not a number > 0, naming the row and field.
    """
    fields = [f.name for f in dataclasses.fields(StepWork)]
    works, seconds = [], []
    for i, row in enumerate(rows):
        missing = [f for f in (*fields, "seconds") if f not in row]
        if missing:
            raise ValueError(f"profile row {i} has no {missing[0]!r} (a step profile's rows hold {fields} and "
                             "'seconds')")
        values = {}
        for f in fields:
            try:
                v = float(row[f])
            except (TypeError, ValueError):
                v = math.nan
            if not (math.isfinite(v) and v == int(v) and v >= 0):
                raise ValueError(f"profile row {i}: {f} must be a whole number >= 0, got {row[f]!r}")
            values[f] = int(v)
        works.append(StepWork(**values))
        try:
            secs = float(row["seconds"])
        except (TypeError, ValueError):
            secs = math.nan
        if not (math.isfinite(secs) and secs > 0):
            raise ValueError(f"profile row {i}: seconds must be a number > 0, got {row['seconds']!r}")
        seconds.append(secs)
    return works, seconds


def mape(predicted: Iterable[float], actual: Iterable[float]) -> float:
    """Mean absolute percentage error, in percent: ``100 * mean(|p - a| / a)``
    (the error serving simulators report: Vidur, BLIS).

    Raises:
      ValueError: lengths differ, nothing to compare, or an actual value
        that is not > 0.
    """
    p, a = np.asarray(list(predicted), np.float64), np.asarray(list(actual), np.float64)
    if p.shape != a.shape or p.size == 0:
        raise ValueError(f"predicted and actual must be equally long and not empty, got {p.shape} and {a.shape}")
    if not (a > 0).all():
        raise ValueError(f"actual values must be > 0, got {a[a <= 0][:3].tolist()}")
    return float(100 * np.mean(np.abs(p - a) / a))


FEATURES = ("call", "padded_tokens", "logit_rows", "rows", "context_tokens", "attention_pairs")
"""What a profiled step time is linear in: 1 per call, then
:class:`StepWork`'s fields of the same names."""


def features(work: StepWork) -> np.ndarray:
    """f64[len(FEATURES)] of one call."""
    return np.array([1.0, work.padded_tokens, work.logit_rows, work.rows, work.context_tokens,
                     work.attention_pairs], np.float64)


@dataclasses.dataclass(frozen=True)
class ProfiledStepTime:
    """A step time fitted to calls the real engine timed (module docstring).

    A call's program is set by its padded token rows (the bucketed shape), so
    each bucket the profile holds at least :data:`MIN_BUCKET_CALLS` calls of
    gets a fit of its own over the other features (a table over shapes,
    interpolated in the work within each); a call of another bucket is
    predicted by the fit over every call.

    Attributes:
      coef: f64[len(FEATURES)] seconds per unit of each feature over every
        call, >= 0.
      bucket_coef: padded token rows -> f64[len(FEATURES)] that bucket's own
        fit (its ``padded_tokens`` entry 0: constant within a bucket).
      name: what produced it ("profiled on <device>").
      fit_mape: the fit's own error over the profile, percent.
      num_calls: calls it was fitted to.
    """

    coef: np.ndarray
    bucket_coef: dict
    name: str
    fit_mape: float
    num_calls: int

    @classmethod
    def fit(cls, works: Sequence[StepWork], seconds: Sequence[float], *, device: str) -> ProfiledStepTime:
        """Fits the coefficients to calls ``works`` that took ``seconds``
        (non-negative least squares on the seconds themselves: what a run's
        latencies add up is their sum, so a long call's error counts for
        more than a short one's).

        Raises:
          ValueError: fewer calls than features, or a time not > 0.
        """
        y = np.asarray(seconds, np.float64)
        if len(works) != len(y) or len(y) < len(FEATURES):
            raise ValueError(f"need as many times as calls and at least {len(FEATURES)} calls, got "
                             f"{len(works)} calls and {len(y)} times")
        bad = ~(np.isfinite(y) & (y > 0))
        if bad.any():
            raise ValueError(f"seconds must be finite and > 0, got {y[bad][:3].tolist()}")
        x = np.stack([features(w) for w in works])
        tokens = x[:, 1]
        buckets = {}
        for t in np.unique(tokens):
            mask = tokens == t
            if mask.sum() >= MIN_BUCKET_CALLS:
                xb = x[mask].copy()
                xb[:, 1] = 0.0
                buckets[int(t)] = _nnls(xb, y[mask])
        fitted = cls(coef=_nnls(x, y), bucket_coef=buckets, name=f"profiled on {device}", fit_mape=0.0,
                     num_calls=len(y))
        return dataclasses.replace(fitted, fit_mape=mape([fitted.seconds(w) for w in works], y))

    def seconds(self, work: StepWork) -> float:
        return float(features(work) @ self.bucket_coef.get(work.padded_tokens, self.coef))

    def table(self) -> list[dict]:
        """One row per feature: its name and seconds per unit, over every
        call and in each bucket (``bucket_<T>``)."""
        return [{"feature": f, "seconds_per_unit": float(c),
                 **{f"bucket_{t}": float(b[i]) for t, b in sorted(self.bucket_coef.items())}}
                for i, (f, c) in enumerate(zip(FEATURES, self.coef))]


MIN_BUCKET_CALLS = 3 * len(FEATURES)
"""Calls of one padded-token bucket a profile needs for the bucket's own fit."""


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``x @ c ~ y``, columns scaled first."""
    from scipy.optimize import nnls  # scipy comes with jax

    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(x / scale, y)[0] / scale


ALLREDUCE_LATENCY_S = 10e-6
"""Seconds one all-reduce of tensor parallelism costs beyond its bytes
(assumed: the order of NCCL's small-message all-reduce over NVLink)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RooflineStepTime:
    """A call's time from its FLOPs and bytes (module docstring), on
    ``num_devices`` chips in tensor parallelism (Megatron-LM's split, as the
    paper's OPT-66B and OPT-175B servers: heads and the MLP divided, so each
    chip does ``1/n`` of the FLOPs and reads ``1/n`` of the weights and K/V;
    two all-reduces of the hidden state per layer, not overlapped):

    ``overhead + max(FLOPs / n / (peak x e_flops), bytes / (bandwidth x e_bw))
    + comm_bytes / (link x e_bw) + 2 L x ALLREDUCE_LATENCY_S`` (the last two
    only where ``n > 1``).

    Args:
      model: the model's shape.
      device: the chip.
      dtype: weights' and activations' dtype (its peak FLOP/s is used).
      kv_dtype: the K/V pages' dtype.
      flops_efficiency: share of the peak FLOP/s a step's matmuls reach, (0, 1].
      bandwidth_efficiency: share of the HBM (and link) bandwidth it
        reaches, (0, 1].
      overhead_s: fixed seconds per call (launches, the host's scheduling
        not hidden), >= 0.
      efficiency_source: where the three numbers come from.
      num_devices: chips in tensor parallelism, >= 1.

    Raises:
      ValueError: (at construction) an argument out of its range, naming it.
    """

    model: ModelShape
    device: DeviceSpec
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    overhead_s: float = 0.002
    efficiency_source: str = "assumed (no profile of this device): 60% of peak FLOP/s, 80% of HBM bandwidth, 2 ms"
    num_devices: int = 1

    def __post_init__(self):
        check_instance("model", self.model, ModelShape, what="paged_jax.simulator.hardware.ModelShape")
        check_instance("device", self.device, DeviceSpec, what="paged_jax.simulator.hardware.DeviceSpec")
        self.device.flops(self.dtype)
        check_choice("kv_dtype", self.kv_dtype, ("bfloat16", "float16", "float32", "float8", "int8"))
        check_float("flops_efficiency", self.flops_efficiency, 0, 1, low_open=True)
        check_float("bandwidth_efficiency", self.bandwidth_efficiency, 0, 1, low_open=True)
        check_float("overhead_s", self.overhead_s, 0)
        check_int("num_devices", self.num_devices)

    @property
    def name(self) -> str:
        n = self.num_devices
        return f"roofline on {self.device.name}" + (f" x{n} (tensor parallel)" if n > 1 else "")

    def flops(self, work: StepWork) -> float:
        """``2 T P + 2 R h V + 4 H d A L``, all chips together: the layers'
        matmuls over the T padded token rows (P weights per layer times L
        layers, each weight a multiply and an add per token), the LM head
        over R logit rows, and attention's QK and PV over the A (query, key)
        pairs of each of the H query heads of width d in each layer."""
        m = self.model
        return (2.0 * work.padded_tokens * m.layer_matmul_params * m.num_layers
                + 2.0 * work.logit_rows * m.hidden * m.vocab_size
                + 4.0 * m.num_q_heads * m.head_dim * work.attention_pairs * m.num_layers)

    def bytes(self, work: StepWork) -> float:
        """HBM bytes one chip moves: its share of every weight once and of
        the K/V the attention reads (``context_tokens``) and writes
        (``tokens``), and the activations: each layer reads and writes its
        hidden state (whole on every chip) and its share of the MLP
        intermediate once per padded token row, ``2 T L (4 h + 2 m / n)``
        elements."""
        m, n = self.model, self.num_devices
        kv = m.kv_bytes_per_token(self.kv_dtype)
        act = 2.0 * work.padded_tokens * m.num_layers * (4 * m.hidden + 2 * m.mlp_dim / n) * dtype_bytes(self.dtype)
        return (m.weight_bytes(self.dtype) + kv * (work.context_tokens + work.tokens)) / n + act

    def comm_bytes(self, work: StepWork) -> float:
        """Bytes one chip sends for the all-reduces: two a layer of the
        hidden state of T rows, a ring moving ``2 (n - 1) / n`` of it; 0 on
        one chip."""
        m, n = self.model, self.num_devices
        return 2.0 * m.num_layers * 2 * (n - 1) / n * work.padded_tokens * m.hidden * dtype_bytes(self.dtype)

    def _comm_latency(self) -> float:
        return 2 * self.model.num_layers * ALLREDUCE_LATENCY_S if self.num_devices > 1 else 0.0

    def seconds(self, work: StepWork) -> float:
        n = self.num_devices
        compute = self.flops(work) / n / (self.device.flops(self.dtype) * self.flops_efficiency)
        memory = self.bytes(work) / (self.device.hbm_bytes_per_s * self.bandwidth_efficiency)
        comm = self.comm_bytes(work) / (self.device.link_bytes_per_s * self.bandwidth_efficiency)
        return self.overhead_s + max(compute, memory) + comm + self._comm_latency()

    def fitted(self, works: Sequence[StepWork], seconds: Sequence[float], *, source: str) -> RooflineStepTime:
        """This model with its efficiencies and overhead fitted to calls that
        took ``seconds`` on this device (a grid over the two efficiencies,
        the overhead by least squares at each point; least relative error).

        Raises:
          ValueError: no calls, or lengths differ.
        """
        y = np.asarray(seconds, np.float64)
        if len(works) != len(y) or not len(y):
            raise ValueError(f"need one time per call, got {len(works)} calls and {len(y)} times")
        if not (np.isfinite(y) & (y > 0)).all():
            raise ValueError(f"seconds must be finite and > 0, got {y[~(np.isfinite(y) & (y > 0))][:3].tolist()}")
        flops = np.array([self.flops(w) for w in works]) / self.num_devices / self.device.flops(self.dtype)
        mem = np.array([self.bytes(w) for w in works]) / self.device.hbm_bytes_per_s
        comm = np.array([self.comm_bytes(w) for w in works]) / self.device.link_bytes_per_s
        grid = np.geomspace(1e-4, 1.0, 81)
        best = None
        w = 1 / y**2
        for ef, eb in itertools.product(grid, grid):
            core = np.maximum(flops / ef, mem / eb) + comm / eb + self._comm_latency()
            overhead = max(float(np.sum(w * (y - core)) / np.sum(w)), 0.0)
            err = float(np.mean(np.abs(core + overhead - y) / y))
            if best is None or err < best[0]:
                best = (err, ef, eb, overhead)
        _, ef, eb, overhead = best
        return dataclasses.replace(self, flops_efficiency=float(ef), bandwidth_efficiency=float(eb),
                                   overhead_s=overhead, efficiency_source=source)


class ReplayStepTime:
    """The seconds a real run's calls took, handed out in order (to replay a
    run into a simulated engine).

    Raises:
      RuntimeError: (from :meth:`seconds`) more calls than times.
    """

    name = "replayed"

    def __init__(self, seconds: Sequence[float]):
        self._times = [check_float("seconds", s, 0) for s in seconds]
        self._next = 0

    def seconds(self, work: StepWork) -> float:
        if self._next >= len(self._times):
            raise RuntimeError(f"the replay has {len(self._times)} call times; the simulation made more calls")
        self._next += 1
        return self._times[self._next - 1]
