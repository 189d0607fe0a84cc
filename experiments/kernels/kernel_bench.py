"""Paged versus dense decode attention on the same data: time, ratio, bandwidth.

``python -m experiments.kernels.kernel_bench`` times one decode step of attention
(one query token per sequence) at the attention shapes of real models
(``--heads``, :data:`HEAD_PRESETS`: SmolLM2-135M by default, Llama-3-8B,
Qwen2.5-7B) for every paged implementation this machine runs natively
(:func:`native_impls`: on CPU the two XLA paths, ``xla`` and ``xla_loop``; on
a GPU also ``pallas_gpu``, ``pallas_ragged`` and ``flat_gpu``; on a TPU
``pallas_tpu`` and ``flat_tpu``; the ``flat_*`` rows are the engine's flat
ragged kernel, ``pallas_kernels.flat_ragged_attention``, given the decode
batch as a packed token batch, attention only) and
for dense attention over contiguous K/V holding the same tokens and heads.
Dense attention pads every sequence to the batch's longest, as a non-paged
server must; paged attention may stop at each sequence's length. With
``--layers N`` the pages sit in a stacked pool ``[N, K, P, L, H]`` (every
layer but ``N // 2`` NaN, so a read of the wrong layer fails the check against
dense) and each call reads layer ``N // 2`` in place, as the decoder's layer
scan does.

Workloads: uniform batches (every sequence at the same context length) and
ragged batches with ShareGPT-like lengths: a log-normal fitted to the 1,000
vLLM-filtered ShareGPT requests of FACTS.md (median total 263 tokens... see
:func:`sharegpt_like_lengths`), clipped to [16, 2048]; the same ragged
batches for every heads preset. ``--sizes large`` adds uniform batches of 64
and 128 sequences at contexts 2,048 and 4,096, where one call needs at least
1 GB of KV at Llama-3-8B's heads in bfloat16 (64 * 4,096 tokens * 8 KV heads
* 128 * 2 bytes * 2 for K and V = 1.07 GB). On CPU it needs about four times
the largest row's ``KV GB`` of RAM (pages, the dense copy, the XLA path's
gather: about 17 GB at Llama-3-8B in float32 at 128 x 4,096; ``--dtype
bfloat16`` halves it) and minutes per case; ``--layers N`` multiplies the
pages by ``N``.

Columns: ``pages`` = the dtype the row reads K/V in (dense attention: the
values the pages stand for, in ``--dtype``); ``KV GB`` = KV bytes the call
*needs* (sum of lengths * K * 2 for K and V * bytes per token and KV head:
``H * itemsize``, plus a quantized page's 4-byte scale; the layer's, not
the pool's), in 1e9 bytes; ``ms``
per call (best of 5 timed loops of ``--min-seconds`` each, robust to other
load on the machine); ``x dense`` = paged time / dense time; ``GB/s`` = KV GB per
second; ``% peak`` = that over the *peak* read bandwidth: one large
device-to-device copy (``--peak-copy-gb``, default 1 GB on accelerators and
0.25 GB on CPU) measured once per run, as bytes read per second (the copy
also writes as many bytes, so a call that only reads may pass 100 %, and on
CPU so does KV small enough to stay in cache). This is the figure the
project's performance targets (:data:`TARGETS`) refer to. ``% copy`` = the same bandwidth over the read rate of a
copy of the row's own KV size (``copy GB/s (read)``): small copies are
launch-bound (and on CPU cache-resident), so it is not a fraction of what the
memory can do. Writes
``results/kernel_bench.{md,csv}`` with a summary (best paged implementation
per heads preset and workload, and the issue's targets, met or not) after
the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import provenance
from experiments.lib.cli import RESULTS, add_flag, check_out_dir, cpu_model, positive_number, resolve_dtype, time_call
from experiments.lib.tables import markdown_table, write_table
from models.presets import PRESETS as MODEL_PRESETS
from paged_jax.attention import paged as attention
from paged_jax.checks import check_int
from pallas_kernels import flat_ragged_attention
from pallas_kernels.common import dequantize_kv, is_quantized, kv_bytes_per_token, quantize_kv

QUANTIZED_KV_CHOICES = ("int8", "float8_e4m3fn", "float8_e5m2", "fp8")
"""--kv-dtype's choices (``fp8`` is float8_e4m3fn)."""

# Axis alphabet: B batch, S key tokens, N query heads, K KV heads, G queries
# per KV head, H head dim, P pages, L page size.

SEED = 0
"""Seed of the benchmark's random K/V, queries, page order and ShareGPT-like lengths."""
SHAREGPT_MAX_LEN = 2048
"""Longest ShareGPT-like context, in tokens (the log-normal's tail is clipped here)."""
LARGE_BATCHES = (64, 128)
LARGE_CONTEXTS = (2048, 4096)
"""Uniform batches and contexts ``--sizes large`` adds: >= 1 GB of KV per call at Llama-3-8B's heads in bf16."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Shapes of the benchmark: one model's attention heads (SmolLM2-135M's
    by default), the page size and the layers of the stacked pool.

    Attributes:
      name: the heads preset's name, written in every row (``heads``).
      num_kv_heads: K, KV heads.
      group: G, query heads per KV head (N = K * G).
      head_dim: H.
      page_size: L, tokens per page.
      layers: layers of the stacked pool ``[layers, K, P, L, H]``; 1 means a
        single layer's ``[K, P, L, H]`` pages and no ``layer`` argument.
    """

    name: str = "smollm2"
    num_kv_heads: int = 3
    group: int = 3
    head_dim: int = 64
    page_size: int = 16
    layers: int = 1

    def __post_init__(self):
        for name in ("num_kv_heads", "group", "head_dim", "page_size", "layers"):
            check_int(name, getattr(self, name))

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def layer(self) -> int | None:
        """The layer each call reads (``layers // 2``), None without a stacked pool."""
        return None if self.layers == 1 else self.layers // 2


HEAD_PRESETS: dict[str, BenchConfig] = {
    name: BenchConfig(name=name, num_kv_heads=c.num_kv_heads, group=c.group_size, head_dim=c.head_dim)
    for name, c in (("smollm2", MODEL_PRESETS["smollm2-135m"]), ("smollm2-135m", MODEL_PRESETS["smollm2-135m"]),
                    ("llama-3-8b", MODEL_PRESETS["llama-3-8b"]), ("qwen2.5-7b", MODEL_PRESETS["qwen2.5-7b"]))
}
"""Attention shapes of real models (``models.presets.PRESETS``, from their
config.json), by ``--heads`` name (``smollm2`` is ``smollm2-135m``, the
name ``serve_sharegpt --model`` uses)."""


def machine() -> str:
    """CPU model, core count, JAX backend and devices, load average."""
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu_model()}, {os.cpu_count()} cores; JAX {jax.__version__} backend {jax.default_backend()} "
            f"({len(jax.devices())} x {devices}); load average at start {load}")


def sharegpt_like_lengths(rng: np.random.Generator, batch: int, max_len: int) -> np.ndarray:
    """i32[batch] context lengths: log-normal with median 263 and 90th
    percentile 834 tokens (prompt + output of vLLM-filtered ShareGPT
    requests, FACTS.md), i.e. mu = ln 263, sigma = ln(834 / 263) / 1.2816 =
    0.90; clipped to [16, max_len]."""
    sigma = math.log(834 / 263) / 1.2816
    return np.clip(rng.lognormal(math.log(263), sigma, batch), 16, max_len).astype(np.int32)


@functools.partial(jax.jit, donate_argnums=1, keep_unused=True)
def _copy_into(src: jax.Array, dst: jax.Array) -> jax.Array:
    """u32[n], u32[n] -> u32[n]: ``~src`` written into ``dst``'s donated
    buffer. A fresh output buffer per call would time the allocator too (on
    CPU, page faults: a 0.25 GB copy then reads 3 GB/s instead of 15);
    ``keep_unused`` keeps ``dst``, which jit would otherwise drop, donation
    and all."""
    del dst
    return jnp.bitwise_not(src)


def copy_read_gbs(num_bytes: int, min_seconds: float = 0.2) -> float:
    """Read bandwidth of a device-to-device copy of ``num_bytes`` bytes, in
    GB/s (1e9 bytes read per second). The copy is one elementwise pass
    (bitwise not over u32, so no dtype conversion costs anything) from one
    buffer into another that reads every byte once and writes it once: it
    moves twice the bytes counted. ``min_seconds``: see :func:`experiments.lib.cli.time_call`."""
    num_words = max(1, num_bytes // 4)
    src = jnp.zeros((num_words,), jnp.uint32)
    dst = [jnp.ones((num_words,), jnp.uint32)]

    def copy() -> jax.Array:
        dst[0] = _copy_into(src, dst[0])
        return dst[0]

    return num_words * 4 / time_call(copy, min_seconds=min_seconds) / 1e9


def dense_attention(
    q: jax.Array,  # [B, N, H]
    k: jax.Array,  # [B, K, S, H] contiguous, padded to the longest sequence
    v: jax.Array,  # [B, K, S, H]
    lengths: jax.Array,  # i32[B]
) -> jax.Array:
    """Dense decode attention over contiguous K/V with a length mask: the
    baseline. Returns [B, N, H]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim) / math.sqrt(head_dim)
    logits = jnp.einsum("BKGH,BKSH->BKGS", qg, k)
    mask = jnp.arange(num_keys)[None, :] < lengths[:, None]  # [B, S]
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("BKGS,BKSH->BKGH", probs, v).reshape(batch, num_q_heads, head_dim)


def native_impls() -> list[str]:
    """Paged implementations that run natively (not interpreted) here: the
    XLA paths everywhere, the Triton kernels (decode and ragged) on a GPU,
    the Mosaic decode kernel on a TPU."""
    impls = ["xla", "xla_loop"]
    backend = jax.default_backend()
    if backend == "gpu":
        impls += ["pallas_gpu", "pallas_ragged", "flat_gpu"]
    elif backend == "tpu":
        impls += ["pallas_tpu", "flat_tpu"]
    return [i for i in impls if i in attention.IMPLS or i in FLAT_IMPLS]


FLAT_IMPLS = {"flat_gpu": "gpu", "flat_tpu": "tpu"}
"""Benchmark names of the flat ragged kernel's implementations."""


def _flat_decode(impl: str, q, k_pages, v_pages, block_tables, kv_lens, q_lens, layer, k_scales=None,
                 v_scales=None):
    """A decode batch through the flat kernel: sequence ``b`` owns flat row
    ``b``; nothing written (the other rows attend over written pages too)."""
    if layer is None:  # one layer's pages: a one-layer stack (a free reshape)
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        k_scales, v_scales = (None, None) if k_scales is None else (k_scales[None], v_scales[None])
    out, *_ = flat_ragged_attention.unchecked_flat_ragged_paged_attention(
        q, None, None, k_pages, v_pages, layer, block_tables, jnp.arange(q.shape[0], dtype=jnp.int32), q_lens,
        kv_lens, None, k_scales=k_scales, v_scales=v_scales, decode_tiles=q.shape[0], prefill_chunks=0,
        impl=FLAT_IMPLS[impl])
    return out


def paged_decode(impl: str) -> Callable:
    """A jitted decode call of ``attention.paged_attention`` with ``impl``
    (a :data:`FLAT_IMPLS` name: of the flat kernel, :func:`_flat_decode`):
    ``(q [B, N, H], k_pages, v_pages [K, P, L, H] or [layers, K, P, L, H],
    block_tables i32[B, pages_per_seq], kv_lens i32[B], q_lens i32[B],
    layer i32[] or None, k_scales, v_scales f32[(layers,) K, P, L] or None)
    -> [B, N, H]``. The layer is traced, as in the decoder's layer scan;
    scales come with quantized (int8, fp8) pages."""
    if impl in FLAT_IMPLS:
        return jax.jit(functools.partial(_flat_decode, impl))

    def call(q, k_pages, v_pages, block_tables, kv_lens, q_lens, layer, k_scales=None, v_scales=None):
        return attention.paged_attention(q[:, None], k_pages, v_pages, block_tables, kv_lens, q_lens, impl=impl,
                                         layer=layer, k_scales=k_scales, v_scales=v_scales)[:, 0]
    return jax.jit(call)


@functools.partial(jax.jit, static_argnames=("pages_shape", "q_shape", "dtype"))
def _random_kv_q(key: jax.Array, *, pages_shape: tuple[int, ...], q_shape: tuple[int, ...],
                 dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Standard normal K pages, V pages (``pages_shape``, [K, P, L, H]) and
    queries (``q_shape``, [B, N, H]) in ``dtype``, drawn on the device in one
    compiled call (a 1 GB pool would take 4 GB as float64 on the host)."""
    key_k, key_v, key_q = jax.random.split(key, 3)
    return (jax.random.normal(key_k, pages_shape, dtype), jax.random.normal(key_v, pages_shape, dtype),
            jax.random.normal(key_q, q_shape, dtype))


@functools.partial(jax.jit, static_argnames=("layers", "layer"))
def _stack_in_nan_pool(pages: jax.Array, *, layers: int, layer: int) -> jax.Array:
    """[K, P, L, H] pages (or [K, P, L] scales) -> [layers, ...]: the pages
    at ``layer``, NaN in every other layer (a kernel that reads the wrong
    layer returns NaN; int8 pages hold 0 there, and their NaN scales make
    them NaN)."""
    fill = jnp.nan if jnp.issubdtype(pages.dtype, jnp.floating) else 0
    return jnp.full((layers, *pages.shape), fill, pages.dtype).at[layer].set(pages)


@functools.partial(jax.jit, static_argnames=("dtype", "out_dtype"))
def _quantized(pages: jax.Array, *, dtype: jnp.dtype, out_dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    """``(pages in dtype, f32 scales, the values they stand for in out_dtype)``:
    what a quantized pool holds, and dense attention's K/V for it."""
    q, scales = quantize_kv(pages, dtype)
    return q, scales, dequantize_kv(q, scales).astype(out_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One batch's decode inputs, paged and dense (:func:`make_case`)."""

    q: jax.Array  # [B, N, H]
    k_pages: jax.Array  # [K, P, L, H], or [layers, K, P, L, H] with every layer but ``layer`` NaN
    v_pages: jax.Array  # as k_pages
    block_tables: jax.Array  # i32[B, pages_per_seq]; entries past a sequence's pages: the null page 0
    kv_lens: jax.Array  # i32[B]
    q_lens: jax.Array  # i32[B], all 1 (decode)
    layer: jax.Array | None  # i32[]: the layer the calls read; None without a stacked pool
    k_dense: jax.Array  # [B, K, S, H]: the same tokens, contiguous, padded to the longest (dequantized)
    v_dense: jax.Array  # [B, K, S, H]
    k_scales: jax.Array | None = None  # f32[(layers,) K, P, L] with quantized pages
    v_scales: jax.Array | None = None

    @property
    def paged_args(self) -> tuple:
        """The arguments of a :func:`paged_decode` call, in order."""
        return (self.q, self.k_pages, self.v_pages, self.block_tables, self.kv_lens, self.q_lens, self.layer,
                self.k_scales, self.v_scales)


def make_case(cfg: BenchConfig, lengths: np.ndarray, dtype, rng: np.random.Generator, kv_dtype=None) -> Case:
    """A batch of ``lengths`` (i32[B], each >= 1) context tokens at ``cfg``'s
    heads: standard normal K/V and queries in ``dtype``, pages dealt from a
    random permutation of the pool (a fragmented pool, as after churn), page
    0 the null page (no sequence's). With a quantized ``kv_dtype`` (int8,
    fp8) the pages hold the K/V quantized, with f32 scales, and the dense
    K/V the values they stand for (in ``dtype``)."""
    batch = len(lengths)
    num_kv, head_dim, page_size = cfg.num_kv_heads, cfg.head_dim, cfg.page_size
    pages_per_seq = math.ceil(int(lengths.max()) / page_size)
    needed = [math.ceil(int(n) / page_size) for n in lengths]
    num_pages = 1 + sum(needed)  # page 0: the null page
    perm = 1 + rng.permutation(num_pages - 1)
    tables = np.zeros((batch, pages_per_seq), np.int32)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = perm[start:start + n]
        start += n
    # rbg keys: XLA's own generator, compiled in a third of threefry's time on CPU.
    k_pages, v_pages, q = _random_kv_q(jax.random.key(int(rng.integers(2**31)), impl="rbg"), pages_shape=(
        num_kv, num_pages, page_size, head_dim), q_shape=(batch, cfg.num_q_heads, head_dim), dtype=jnp.dtype(dtype))
    block_tables = jnp.asarray(tables)
    k_scales = v_scales = None
    k_values, v_values = k_pages, v_pages
    if kv_dtype is not None and is_quantized(kv_dtype):
        k_pages, k_scales, k_values = _quantized(k_pages, dtype=jnp.dtype(kv_dtype), out_dtype=jnp.dtype(dtype))
        v_pages, v_scales, v_values = _quantized(v_pages, dtype=jnp.dtype(kv_dtype), out_dtype=jnp.dtype(dtype))
    k_dense = attention.gather_pages(k_values, block_tables).transpose(1, 0, 2, 3)
    v_dense = attention.gather_pages(v_values, block_tables).transpose(1, 0, 2, 3)
    layer = None
    if cfg.layer is not None:
        stack = functools.partial(_stack_in_nan_pool, layers=cfg.layers, layer=cfg.layer)
        k_pages, v_pages = stack(k_pages), stack(v_pages)  # [layers, K, P, L, H]
        if k_scales is not None:
            k_scales, v_scales = stack(k_scales), stack(v_scales)
        layer = jnp.int32(cfg.layer)
    return Case(q=q, k_pages=k_pages, v_pages=v_pages, block_tables=block_tables,
                kv_lens=jnp.asarray(lengths, jnp.int32), q_lens=jnp.ones((batch,), jnp.int32), layer=layer,
                k_dense=k_dense, v_dense=v_dense, k_scales=k_scales, v_scales=v_scales)


def run_case(cfg: BenchConfig, lengths: np.ndarray, dtype, impls: list[str], rng: np.random.Generator,
             label: str, peak_read_gbs: float, min_seconds: float = 0.2, kv_dtype=None) -> list[dict]:
    """Times dense and each paged implementation on one batch
    (:func:`make_case`); one row each.

    Args:
      cfg: heads, page size and pool layers.
      lengths: i32[B] context lengths, each >= 1.
      dtype: K/V and query dtype.
      kv_dtype: a quantized page dtype (int8, fp8: pages of 1 byte per value
        plus f32 scales, the bytes ``KV GB`` counts), or None for pages in
        ``dtype``. Dense attention reads the values they stand for in
        ``dtype``.
      impls: paged implementations (``attention.IMPLS``).
      rng: source of the page order and the K/V and query values.
      label: the workload's name, written in every row.
      peak_read_gbs: the run's large-copy read bandwidth, GB/s (``pct_peak``).
      min_seconds: length of each timed loop (:func:`experiments.lib.cli.time_call`).

    Raises:
      AssertionError: a paged implementation's output differs from dense
        attention's (1e-3 in float32, 5e-2 in 16-bit dtypes): a fast wrong
        kernel gives no row.
    """
    batch, num_kv, head_dim = len(lengths), cfg.num_kv_heads, cfg.head_dim
    case = make_case(cfg, lengths, dtype, rng, kv_dtype)
    q, k_dense, v_dense, kv_lens = case.q, case.k_dense, case.v_dense, case.kv_lens
    page_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)

    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = int(lengths.sum()) * num_kv * kv_bytes_per_token(head_dim, page_dtype) * 2
    # Dense attention reads the values the pages stand for, in `dtype`: its own bytes (as many when unquantized).
    dense_bytes = int(lengths.sum()) * num_kv * head_dim * itemsize * 2
    same_size_gbs = copy_read_gbs(kv_bytes, min_seconds)

    dense_fn = jax.jit(dense_attention)
    dense_s = time_call(dense_fn, q, k_dense, v_dense, kv_lens, min_seconds=min_seconds)
    expected = dense_fn(q, k_dense, v_dense, kv_lens)
    common = dict(heads=cfg.name, workload=label, batch=batch, mean_len=float(lengths.mean()),
                  max_len=int(lengths.max()), dtype=jnp.dtype(dtype).name,
                  peak_read_gbs=peak_read_gbs)

    def row(impl: str, seconds: float, nbytes: int = kv_bytes, read_dtype: str = page_dtype.name,
            copy_gbs: float = same_size_gbs) -> dict:
        gbs = nbytes / seconds / 1e9
        return dict(common, impl=impl, kv_dtype=read_dtype, kv_gb=nbytes / 1e9, ms=seconds * 1e3,
                    ratio=seconds / dense_s, gbs=gbs, pct_peak=100 * gbs / peak_read_gbs,
                    pct_copy=100 * gbs / copy_gbs, copy_read_gbs=copy_gbs)

    dense_copy_gbs = same_size_gbs if dense_bytes == kv_bytes else copy_read_gbs(dense_bytes, min_seconds)
    rows = [row("dense", dense_s, dense_bytes, jnp.dtype(dtype).name, dense_copy_gbs)]
    for impl in impls:
        fn = paged_decode(impl)
        out = fn(*case.paged_args)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
        if not err < (1e-3 if itemsize == 4 else 5e-2):
            raise AssertionError(f"{impl} differs from dense attention by {err} on {cfg.name} {label} batch {batch}")
        seconds = time_call(fn, *case.paged_args, min_seconds=min_seconds)
        rows.append(row(impl, seconds))
    return rows


COLUMNS = ["heads", "workload", "batch", "mean_len", "max_len", "dtype", "kv_dtype", "impl", "kv_gb", "ms", "ratio",
           "gbs", "pct_peak", "pct_copy", "copy_read_gbs"]
HEADERS = ["heads", "workload", "B", "mean len", "max len", "dtype", "pages", "impl", "KV GB", "ms", "x dense", "GB/s",
           "% peak", "% copy", "copy GB/s (read)"]
CSV_COLUMNS = COLUMNS + ["peak_read_gbs"]
"""The CSV adds the run's peak copy read rate (the Markdown states it once, above the table)."""


def to_markdown(rows: list[dict], header: str) -> str:
    def fmt(key, value):
        if isinstance(value, float):
            return f"{value:.0f}" if key in ("mean_len",) else f"{value:.3g}" if key != "ratio" else f"{value:.2f}"
        return str(value)

    return header + "\n\n" + markdown_table(rows, COLUMNS, headers=HEADERS, cell=fmt) + "\n"


def describe_case(r: dict) -> str:
    """``B=... len=...`` (uniform) or ``B=... mean=... max=...`` (ragged) for a row."""
    if r["workload"] == "uniform":
        return f"B={r['batch']} len={r['max_len']}"
    return f"B={r['batch']} mean={r['mean_len']:.0f} max={r['max_len']}"


def _case_key(r: dict) -> tuple:
    return r["heads"], r["workload"], r["batch"], r["mean_len"], r["max_len"], r["dtype"], r["kv_dtype"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A performance target of the project (issue 11 of its tracker): on ``backends``, in every case (one batch at
    one heads preset) that ``applies`` selects, the fastest of ``impls``
    (None: any paged implementation) must take at most ``max_ratio`` times
    dense attention's time and read KV at ``min_pct_peak`` % or more of the
    peak copy read bandwidth."""

    name: str
    backends: tuple[str, ...]
    applies: Callable[[dict], bool]
    impls: tuple[str, ...] | None
    max_ratio: float
    min_pct_peak: float = 0.0

    def met(self, r: dict) -> bool:
        return r["ratio"] <= self.max_ratio and r["pct_peak"] >= self.min_pct_peak


TARGETS = (
    Target(name="GPU decode kernel (pallas_gpu / pallas_ragged / flat_gpu), llama-3-8b heads, bfloat16, uniform "
                "B >= 64, context >= 2048: >= 80 % of peak and <= 1.1x dense",
           backends=("gpu",), impls=("pallas_gpu", "pallas_ragged", "flat_gpu"), max_ratio=1.1, min_pct_peak=80.0,
           applies=lambda r: (r["heads"] == "llama-3-8b" and r["kv_dtype"] == "bfloat16" and r["workload"] == "uniform"
                              and r["batch"] >= 64 and r["max_len"] >= 2048)),
    Target(name="ShareGPT-like ragged batches of 128: best paged <= 0.7x dense",
           backends=("cpu", "gpu", "tpu"), impls=None, max_ratio=0.7,
           applies=lambda r: r["workload"] == "sharegpt" and r["batch"] == 128),
    Target(name="CPU: xla_loop <= 0.55x dense on ShareGPT-like ragged batches",
           backends=("cpu",), impls=("xla_loop",), max_ratio=0.55,
           applies=lambda r: r["workload"] == "sharegpt"),
)
"""The project's targets for paged decode attention (issue 11 of its
tracker), checked in the summary where this run measured them."""


def _span(values: list[float], fmt: str) -> str:
    """``"a-b"`` over ``values``, or ``"a"`` when they are all one."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def summary_lines(rows: list[dict], backend: str) -> list[str]:
    """Markdown lines: per (heads, workload) the paged implementation with
    the lowest geometric mean of ``x dense`` over the workload's cases (with
    its range and ``% peak`` range), then each of :data:`TARGETS`: met, not
    met (with every case's numbers) or not measured in this run."""
    lines = ["## Summary", "",
             "Best paged implementation per heads preset and workload (lowest geometric mean of `x dense` "
             "over the cases):", ""]
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        if r["impl"] != "dense":
            groups.setdefault((r["heads"], r["workload"]), {}).setdefault(r["impl"], []).append(r)
    for (heads, workload), by_impl in groups.items():
        cases = max(len(rs) for rs in by_impl.values())  # rank only implementations that ran every case
        geomeans = {impl: math.exp(np.mean([math.log(r["ratio"]) for r in rs]))
                    for impl, rs in by_impl.items() if len(rs) == cases}
        impl = min(geomeans, key=geomeans.get)
        ratios = [r["ratio"] for r in by_impl[impl]]
        peaks = [r["pct_peak"] for r in by_impl[impl]]
        spread = f" (range {_span(ratios, '.2f')}x)" if cases > 1 else ""
        lines.append(f"- {heads} {workload} ({cases} case{'s' * (cases != 1)}): {impl}, {geomeans[impl]:.2f}x dense"
                     f"{spread}, {_span(peaks, '.3g')} % of peak")
    lines += ["", "Targets (each case this run measured; see the module docstring):", ""]
    for target in TARGETS:
        if backend not in target.backends:
            lines.append(f"- {target.name}: not applicable on {backend}")
            continue
        best: dict[tuple, dict] = {}
        for r in rows:
            if r["impl"] != "dense" and (target.impls is None or r["impl"] in target.impls) and target.applies(r):
                if _case_key(r) not in best or r["ratio"] < best[_case_key(r)]["ratio"]:
                    best[_case_key(r)] = r
        if not best:
            lines.append(f"- {target.name}: not measured (no such case in this run)")
            continue
        failed = sum(not target.met(r) for r in best.values())
        verdict = "met" if not failed else f"not met ({failed} of {len(best)} cases)"
        cases = "; ".join(f"{r['heads']} {describe_case(r)} {r['impl']} {r['ratio']:.2f}x dense "
                          f"{r['pct_peak']:.3g} % of peak" for r in best.values())
        lines.append(f"- {target.name}: **{verdict}**: {cases}")
    return lines


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; a bad value is an argparse error naming its flag (exit status 2)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.kernels.kernel_bench", description=__doc__.splitlines()[0])
    at_least_1 = _int_at_least(1)
    parser.add_argument("--heads", nargs="+", action="extend", choices=sorted(HEAD_PRESETS), metavar="PRESET",
                        help=f"attention shapes, repeatable: {', '.join(HEAD_PRESETS)} (default smollm2)")
    parser.add_argument("--batches", type=at_least_1, nargs="+", default=[1, 8, 32],
                        help="uniform batch sizes (default 1 8 32)")
    parser.add_argument("--contexts", type=at_least_1, nargs="+", default=[256, 1024, 2048],
                        help="uniform context lengths, tokens (default 256 1024 2048)")
    parser.add_argument("--ragged-batches", type=at_least_1, nargs="+", default=[8, 32, 64],
                        help="ShareGPT-like ragged batch sizes (default 8 32 64)")
    parser.add_argument("--sizes", choices=("small", "large"), default="small",
                        help=f"large adds uniform batches {LARGE_BATCHES} x contexts {LARGE_CONTEXTS} "
                             "(>= 1 GB of KV per call at llama-3-8b heads in bf16; on CPU it needs about 4x "
                             "the largest row's KV GB of RAM, 17 GB at llama-3-8b in float32)")
    parser.add_argument("--layers", type=at_least_1, default=1,
                        help="layers of the stacked pool [N, K, P, L, H]; calls read layer N // 2 in place "
                             "(default 1: one layer's pages, no layer argument)")
    parser.add_argument("--peak-copy-gb", type=positive_number, default=None,
                        help="size of the one large copy that measures peak read bandwidth, GB "
                             "(default 1.0 on accelerators, 0.25 on CPU)")
    parser.add_argument("--min-seconds", type=positive_number, default=0.2,
                        help="length of each timed loop, s; each figure is the best of 5 loops (default 0.2; "
                             "smaller is quicker and noisier)")
    add_flag(parser, "dtype", choices=("float32", "bfloat16", "float16"),
             help="K/V and query dtype (default float32 on CPU, bfloat16 on GPU and TPU)")
    add_flag(parser, "kv_dtype", choices=QUANTIZED_KV_CHOICES,
             help="quantized pages: int8, float8_e4m3fn (alias fp8) or float8_e5m2, 1 byte per value plus an f32 "
                  "scale per token and KV head, dequantized by each implementation (dense attention reads the "
                  "values in --dtype); default: pages in --dtype")
    parser.add_argument("--out", default=str(RESULTS / "kernel_bench"),
                        help="path stem: writes STEM.md and STEM.csv (default results/kernel_bench)")
    args = parser.parse_args(argv)
    args.heads = list(dict.fromkeys(args.heads or ["smollm2"]))
    if args.peak_copy_gb is not None and args.peak_copy_gb < 1e-3:
        parser.error(f"--peak-copy-gb must be at least 0.001 (1 MB: a smaller copy measures launch time, not "
                     f"bandwidth), got {args.peak_copy_gb}")
    check_out_dir(parser, pathlib.Path(args.out).parent)  # before minutes of timing
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    record = provenance.collect("experiments.kernels.kernel_bench", argv, seeds={"data": SEED})

    backend = jax.default_backend()
    dtype = resolve_dtype(args.dtype)
    impls = native_impls()
    configs = [dataclasses.replace(HEAD_PRESETS[name], layers=args.layers) for name in args.heads]
    uniform = list(dict.fromkeys(itertools.product(args.batches, args.contexts)))
    if args.sizes == "large":
        uniform += [c for c in itertools.product(LARGE_BATCHES, LARGE_CONTEXTS) if c not in uniform]
    rng = np.random.default_rng(SEED)
    # Drawn once: every heads preset sees the same ragged batches.
    ragged = [sharegpt_like_lengths(rng, b, SHAREGPT_MAX_LEN) for b in dict.fromkeys(args.ragged_batches)]
    peak_gb = args.peak_copy_gb or (0.25 if backend == "cpu" else 1.0)
    peak_read_gbs = copy_read_gbs(int(peak_gb * 1e9), args.min_seconds)

    heads = "; ".join(f"{c.name}: {c.num_q_heads} query heads over {c.num_kv_heads} KV heads, head dim {c.head_dim}"
                      for c in configs)
    pool = (f"a stacked pool of {args.layers} layers, each call reading layer {configs[0].layer} in place"
            if args.layers > 1 else "one layer's pages")
    header = (f"# Paged vs dense decode attention\n\nMachine: {machine()}\n\n"
              f"Heads: {heads}. Page size {configs[0].page_size}, {pool}; {dtype.name}"
              f"{'' if args.kv_dtype is None else f' queries, {args.kv_dtype} pages with f32 scales'}; "
              f"implementations: dense, {', '.join(impls)}.\n\n"
              f"Peak: one {peak_gb:g} GB device-to-device copy reads {peak_read_gbs:.3g} GB/s "
              "(and writes as much).\n\n"
              "`KV GB` = KV bytes the call needs (sum of lengths, K and V), 1e9 bytes; `x dense` = time / dense "
              "time; `GB/s` = KV GB per second; `% peak` = that over the peak copy's read rate: the figure to "
              "compare with the targets (a call that only reads may pass 100 %, and on CPU so does KV "
              "that fits in cache); `% copy` = that over the read rate of a copy of the row's own size "
              "(`copy GB/s (read)`), which small sizes leave launch-bound (on CPU, cache-resident): not a "
              "fraction of the memory's bandwidth.")
    print(header, flush=True)
    rows = []
    for cfg in configs:
        cases = [("uniform", np.full(b, n, np.int32)) for b, n in uniform] + [("sharegpt", x) for x in ragged]
        for label, lengths in cases:
            new = run_case(cfg, lengths, dtype, impls, rng, label, peak_read_gbs, args.min_seconds, args.kv_dtype)
            rows += new
            for r in new:
                print(f"  {r['heads']:10s} {r['workload']:8s} {describe_case(r):26s} {r['impl']:13s} "
                      f"{r['ms']:9.3f} ms x{r['ratio']:.2f} {r['gbs']:.3g} GB/s {r['pct_peak']:.3g} % peak",
                      flush=True)

    table = to_markdown(rows, header) + "\n" + "\n".join(summary_lines(rows, backend)) + "\n"
    print("\n" + table)
    out = pathlib.Path(args.out)
    md, csv = write_table(out.parent, out.stem, [{c: (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c])
                                                  for c in CSV_COLUMNS} for r in rows], CSV_COLUMNS, table, record)
    print(f"wrote {md} and {csv}")


if __name__ == "__main__":
    main()
