"""Device meshes for serving: a data axis and a model axis, and how heads
split over the model axis.

The mesh is ``jax.sharding.Mesh`` with axes ``("data", "model")``:

* **model** (tensor parallelism): each device holds a share of every layer's
  attention heads and MLP columns, and of the KV pool's KV heads; attention
  runs under ``shard_map`` on the device's own heads and pages, and the
  attention and MLP outputs are summed over the axis (``psum``).
* **data**: each data shard serves its own sequences from its own page
  range with its own page state, so a page id never crosses shards.

Head layouts (:func:`head_layout`). With ``K`` KV heads over ``M`` model
devices:

* ``K % M == 0``: each device holds ``K / M`` KV heads and their query heads
  (no waste).
* ``K < M``: KV heads are **replicated**, as serving stacks do when the
  tensor-parallel degree exceeds the KV heads (vLLM's
  ``num_kv_head_replicas``): each device holds one KV head, head ``h`` on
  ``M / K`` consecutive devices, and that head's ``G`` query heads are split
  among its replicas. vLLM requires ``M % K == 0`` and ``N % M == 0``; where
  they do not hold (SmolLM2: 3 KV heads, 9 query heads, on 2, 4 or 8
  devices) the split is made even by **padding**: replica counts differ by
  at most one and each device's query-head slots are filled up with zero
  heads (zero query, key, value and output weights), which add exactly
  nothing to the output.
* ``K > M`` and ``K % M != 0``: KV heads are padded with zero heads up to a
  multiple of ``M``.

The padded layout costs memory (a device's KV pool holds its padding and its
replicas) and is reported by :attr:`HeadLayout.kv_heads_per_device`; the
experiments print it. The MLP's hidden width is split evenly or not at all:
an uneven split is an error naming both numbers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

from paged_jax.checks import check_int

DATA, MODEL = "data", "model"
"""The mesh's axis names."""


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``.

    Either axis may be left out (it is then 1, or what the device count
    leaves, see :func:`make_mesh`).

    Raises:
      ValueError: an unknown axis, a repeated axis, or a size that is not a
        positive integer; names the part of ``spec``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh spec must be like 'data=2,model=4', got {spec!r}")
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in (DATA, MODEL) or name in sizes:
            raise ValueError(f"mesh spec {spec!r}: part {part!r} must be data=N or model=N, each at most once")
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ValueError(f"mesh spec {spec!r}: {name} must be a positive integer, got {value!r}")
        sizes[name] = int(value)
    return sizes


def default_model_size(num_devices: int, num_kv_heads: int) -> int:
    """The model-axis size used when none is given: all devices, if the KV
    heads split evenly over them (``K % M == 0`` or ``M % K == 0``);
    otherwise the largest such divisor of ``num_devices`` (so
    ``data = num_devices / model``)."""
    check_int("num_devices", num_devices)
    check_int("num_kv_heads", num_kv_heads)
    for m in range(num_devices, 0, -1):
        if num_devices % m == 0 and (num_kv_heads % m == 0 or m % num_kv_heads == 0):
            return m
    return 1


def make_mesh(data: int | None = None, model: int | None = None, *, devices=None,
              num_kv_heads: int | None = None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default all of
    ``jax.devices()``, across every process under ``jax.distributed``).

    Args:
      data, model: axis sizes; one left out is what the device count leaves;
        both left out puts every device on the model axis when
        ``num_kv_heads`` splits evenly over them (:func:`default_model_size`),
        else all on the model axis.
      devices: the devices, in mesh order (row-major: data shards are
        consecutive runs of ``model`` devices).
      num_kv_heads: the model's KV heads, for the default split.

    Raises:
      ValueError: ``data * model`` differs from the number of devices, or
        does not divide it when one is left out; names the numbers.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if not n or len(set(devices)) != n:
        raise ValueError(f"devices must be distinct and at least one, got {n} devices ({len(set(devices))} distinct)")
    for name, value in (("data", data), ("model", model), ("num_kv_heads", num_kv_heads)):
        if value is not None:
            check_int(name, value)
    if data is None and model is None:
        model = default_model_size(n, num_kv_heads) if num_kv_heads else n
    if data is None:
        if n % model:
            raise ValueError(f"model={model} does not divide the {n} devices")
        data = n // model
    if model is None:
        if n % data:
            raise ValueError(f"data={data} does not divide the {n} devices")
        model = n // data
    if data * model != n:
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but {n} are given")
    return Mesh(np.asarray(devices, dtype=object).reshape(data, model), (DATA, MODEL))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where each device's attention-head slots come from.

    Attributes:
      num_q_heads, num_kv_heads: N and K of the model.
      model_size: M, devices on the model axis.
      kv_slots: ``M * kv_heads_per_device`` entries: the KV head each slot
        holds (a replica where one head appears more than once), -1 for a
        zero (padding) head. Device ``d`` holds slots ``[d * k, (d + 1) * k)``.
      q_slots: ``M * q_heads_per_device`` entries: the query head each slot
        holds, -1 for a zero head. Slot ``j`` of a device attends with that
        device's KV slot ``j // (q_heads_per_device / kv_heads_per_device)``.
    """

    num_q_heads: int
    num_kv_heads: int
    model_size: int
    kv_slots: tuple[int, ...]
    q_slots: tuple[int, ...]

    @property
    def kv_heads_per_device(self) -> int:
        return len(self.kv_slots) // self.model_size

    @property
    def q_heads_per_device(self) -> int:
        return len(self.q_slots) // self.model_size

    @property
    def padded(self) -> bool:
        """Whether any slot is a zero head."""
        return -1 in self.kv_slots or -1 in self.q_slots

    @property
    def replicated(self) -> bool:
        """Whether a KV head is held by more than one device."""
        real = [h for h in self.kv_slots if h >= 0]
        return len(real) != len(set(real))


def head_layout(num_q_heads: int, num_kv_heads: int, model_size: int) -> HeadLayout:
    """Splits N query heads and K KV heads (GQA, ``G = N / K`` query heads
    per KV head) over M model-axis devices; see the module docstring for the
    three cases.

    Every real query head appears exactly once, on a device that also holds
    (a replica of) its KV head, so attention is computed per device with no
    communication, and exactly as on one device.

    Raises:
      ValueError: a count that is not a positive int, or ``N % K != 0``.
    """
    n = check_int("num_q_heads", num_q_heads)
    k = check_int("num_kv_heads", num_kv_heads)
    m = check_int("model_size", model_size)
    if n % k:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads, got {n=} {k=}")
    g = n // k
    if k >= m:
        per = math.ceil(k / m)
        kv_slots = [h if h < k else -1 for h in range(per * m)]
        q_slots = [h * g + i if h >= 0 else -1 for h in kv_slots for i in range(g)]
        return HeadLayout(n, k, m, tuple(kv_slots), tuple(q_slots))
    # k < m: replicate. Head h gets m // k devices, the first m % k heads one more.
    replicas = [m // k + (h < m % k) for h in range(k)]
    q_per = math.ceil(g / min(replicas))
    kv_slots, q_slots = [], []
    for h, r in enumerate(replicas):
        chunks = np.array_split(np.arange(h * g, (h + 1) * g), r)  # sizes differ by at most one
        for chunk in chunks:
            kv_slots.append(h)
            q_slots.extend(list(map(int, chunk)) + [-1] * (q_per - len(chunk)))
    return HeadLayout(n, k, m, tuple(kv_slots), tuple(q_slots))


def split_evenly(name: str, size: int, model_size: int) -> int:
    """``size / model_size``.

    Raises:
      ValueError: ``size`` does not split evenly over the model axis (names
        both numbers), or either is not a positive int.
    """
    check_int(name, size)
    check_int("model_size", model_size)
    if size % model_size:
        raise ValueError(f"{name}={size} does not split evenly over model={model_size} devices")
    return size // model_size


def init_distributed() -> tuple[int, int]:
    """Joins the processes of a multi-host run, from the usual environment.

    ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0),
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set: calls
    ``jax.distributed.initialize`` with them (CPU, GPU or TPU hosts; on CPU
    the collectives go through gloo). ``JAX_COORDINATOR_ADDRESS`` alone, or
    nothing on a cluster JAX detects (Cloud TPU, SLURM, ...): calls it with
    no arguments and lets JAX find the rest. Nothing set: a single process,
    nothing to do. Call it before anything touches ``jax.devices()``.

    Returns:
      ``(process_index, process_count)``.

    Raises:
      ValueError: ``JAX_NUM_PROCESSES`` or ``JAX_PROCESS_ID`` set without the
        other, or not a non-negative integer (process id below the count);
        ``JAX_COORDINATOR_ADDRESS`` not ``host:port``.
    """
    import os

    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    if (count is None) != (index is None):
        raise ValueError(f"set both JAX_NUM_PROCESSES and JAX_PROCESS_ID or neither, got "
                         f"JAX_NUM_PROCESSES={count!r} JAX_PROCESS_ID={index!r}")
    if address is not None:
        host, _, port = address.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()):
            raise ValueError(f"JAX_COORDINATOR_ADDRESS must be host:port of process 0, got {address!r}")
    if count is not None:
        if not (count.isascii() and count.isdigit() and index.isascii() and index.isdigit()
                and int(index) < int(count)):
            raise ValueError(f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers with 0 <= id < count, got "
                             f"JAX_NUM_PROCESSES={count!r} JAX_PROCESS_ID={index!r}")
        if address is None:
            raise ValueError("JAX_NUM_PROCESSES is set, so JAX_COORDINATOR_ADDRESS (host:port of process 0) "
                             "must be too")
        jax.distributed.initialize(coordinator_address=address, num_processes=int(count), process_id=int(index))
    elif address is not None:
        jax.distributed.initialize(coordinator_address=address)
    return jax.process_index(), jax.process_count()
