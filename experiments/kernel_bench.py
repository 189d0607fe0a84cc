"""Paged versus dense decode attention on the same data: time, ratio, bandwidth.

``python -m experiments.kernel_bench`` times one decode step of attention
(one query token per sequence, SmolLM2's heads: 9 query heads over 3 KV heads,
head dim 64) for every paged implementation this machine runs natively
(``paged_jax.attention.IMPLS``: on CPU the two XLA paths, ``xla`` and
``xla_loop``; on a GPU also ``pallas_gpu``; on a TPU ``pallas_tpu``) and for
dense attention over contiguous K/V holding the same tokens and heads. Dense
attention pads every sequence to the batch's longest, as a non-paged server
must; paged attention may stop at each sequence's length.

Workloads: uniform batches (every sequence at the same context length) and
ragged batches with ShareGPT-like lengths: a log-normal fitted to the 1,000
vLLM-filtered ShareGPT requests of FACTS.md (median total 263 tokens... see
:func:`sharegpt_like_lengths`), clipped to [16, 2048].

Columns: ``ms`` per call (best of several repeats of a timed loop, robust to
other load on the machine); ``x dense`` = paged time / dense time;
``GB/s`` = KV bytes the batch *needs* (sum of lengths * K * H * itemsize * 2
for K and V) per second; ``% copy`` = that bandwidth over the read bandwidth
of a measured device-to-device copy (``-x``) of the same number of bytes
(the copy reads and writes them, so 100 % means "as fast as streaming the KV
once through a copy"). Writes ``results/kernel_bench.{md,csv}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import provenance
from paged_jax import attention

# Axis alphabet: B batch, S key tokens, N query heads, K KV heads, G queries
# per KV head, H head dim, P pages, L page size.

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"
SEED = 0
"""Seed of the benchmark's random K/V, queries, page order and ShareGPT-like lengths."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Shapes of the benchmark (SmolLM2-135M's attention by default)."""

    num_kv_heads: int = 3
    group: int = 3
    head_dim: int = 64
    page_size: int = 16
    max_len: int = 2048

    def __post_init__(self):
        for name in ("num_kv_heads", "group", "head_dim", "page_size", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_len % self.page_size:
            raise ValueError(f"page_size must divide max_len, got {self.page_size=} {self.max_len=}")


def machine() -> str:
    """CPU model, core count, JAX backend and devices, load average."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{model}, {os.cpu_count()} cores; JAX {jax.__version__} backend {jax.default_backend()} "
            f"({len(jax.devices())} x {devices}); load average at start {load}")


def sharegpt_like_lengths(rng: np.random.Generator, batch: int, max_len: int) -> np.ndarray:
    """i32[batch] context lengths: log-normal with median 263 and 90th
    percentile 834 tokens (prompt + output of vLLM-filtered ShareGPT
    requests, FACTS.md), i.e. mu = ln 263, sigma = ln(834 / 263) / 1.2816 =
    0.90; clipped to [16, max_len]."""
    sigma = math.log(834 / 263) / 1.2816
    return np.clip(rng.lognormal(math.log(263), sigma, batch), 16, max_len).astype(np.int32)


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
    """Paged implementations that run natively (not interpreted) here."""
    impls = ["xla", "xla_loop"]
    backend = jax.default_backend()
    if backend == "gpu":
        impls.append("pallas_gpu")
    elif backend == "tpu":
        impls.append("pallas_tpu")
    return [i for i in impls if i in attention.IMPLS]


def run_case(cfg: BenchConfig, lengths: np.ndarray, dtype, impls: list[str], rng: np.random.Generator,
             label: str) -> list[dict]:
    """Times dense and each paged implementation on one batch; one row each."""
    batch = len(lengths)
    num_kv, group, head_dim, page_size = cfg.num_kv_heads, cfg.group, cfg.head_dim, cfg.page_size
    longest = int(lengths.max())
    pages_per_seq = math.ceil(longest / page_size)
    needed = [math.ceil(int(n) / page_size) for n in lengths]
    num_pages = 1 + sum(needed)  # page 0: the null page
    # Pages dealt from a random permutation: a fragmented pool, as after churn.
    perm = 1 + rng.permutation(num_pages - 1)
    tables = np.zeros((batch, pages_per_seq), np.int32)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = perm[start:start + n]
        start += n
    k_pages = jnp.asarray(rng.standard_normal((num_kv, num_pages, page_size, head_dim)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((num_kv, num_pages, page_size, head_dim)), dtype)
    q = jnp.asarray(rng.standard_normal((batch, num_kv * group, head_dim)), dtype)
    block_tables = jnp.asarray(tables)
    kv_lens = jnp.asarray(lengths, jnp.int32)
    q_lens = jnp.ones((batch,), jnp.int32)

    # Dense K/V: the same tokens, contiguous, padded to the longest: [B, K, S, H].
    k_dense = attention.gather_pages(k_pages, block_tables).transpose(1, 0, 2, 3)
    v_dense = attention.gather_pages(v_pages, block_tables).transpose(1, 0, 2, 3)

    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = int(lengths.sum()) * num_kv * head_dim * itemsize * 2
    copy_src = jnp.zeros((kv_bytes // itemsize,), dtype)
    copy_s = time_call(jax.jit(lambda x: -x), copy_src)
    copy_read_gbs = kv_bytes / copy_s / 1e9
    del copy_src

    dense_fn = jax.jit(dense_attention)
    dense_s = time_call(dense_fn, q, k_dense, v_dense, kv_lens)
    expected = dense_fn(q, k_dense, v_dense, kv_lens)
    common = dict(workload=label, batch=batch, mean_len=float(lengths.mean()), max_len=longest,
                  dtype=jnp.dtype(dtype).name, copy_read_gbs=copy_read_gbs)
    rows = [dict(common, impl="dense", ms=dense_s * 1e3, ratio=1.0, gbs=kv_bytes / dense_s / 1e9,
                 pct_copy=100 * (kv_bytes / dense_s / 1e9) / copy_read_gbs)]
    for impl in impls:
        fn = jax.jit(lambda q, kp, vp, bt, kl, ql, impl=impl: attention.paged_attention(
            q[:, None], kp, vp, bt, kl, ql, impl=impl)[:, 0])
        out = fn(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))
        if not err < (1e-3 if itemsize == 4 else 5e-2):
            raise AssertionError(f"{impl} differs from dense attention by {err} on {label} batch {batch}")
        seconds = time_call(fn, q, k_pages, v_pages, block_tables, kv_lens, q_lens)
        gbs = kv_bytes / seconds / 1e9
        rows.append(dict(common, impl=impl, ms=seconds * 1e3, ratio=seconds / dense_s, gbs=gbs,
                         pct_copy=100 * gbs / copy_read_gbs))
    return rows


COLUMNS = ["workload", "batch", "mean_len", "max_len", "dtype", "impl", "ms", "ratio", "gbs", "pct_copy",
           "copy_read_gbs"]
HEADERS = ["workload", "B", "mean len", "max len", "dtype", "impl", "ms", "x dense", "GB/s", "% copy",
           "copy GB/s (read)"]


def to_markdown(rows: list[dict], header: str) -> str:
    def fmt(key, value):
        if isinstance(value, float):
            return f"{value:.0f}" if key in ("mean_len",) else f"{value:.3g}" if key != "ratio" else f"{value:.2f}"
        return str(value)

    lines = [header, "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(fmt(c, r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.kernel_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--ragged-batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 elsewhere")
    parser.add_argument("--out", default=str(RESULTS / "kernel_bench"), help="path stem for .md and .csv")
    args = parser.parse_args(argv)
    record = provenance.collect("experiments.kernel_bench", argv, seeds={"data": SEED})

    cfg = BenchConfig(max_len=max(args.contexts + [2048]))
    dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
    impls = native_impls()
    rng = np.random.default_rng(SEED)
    header = (f"# Paged vs dense decode attention\n\nMachine: {machine()}\n\n"
              f"Heads: {cfg.num_kv_heads} KV x {cfg.group} queries per KV head, head dim {cfg.head_dim}, "
              f"page size {cfg.page_size}; implementations: dense, {', '.join(impls)}. "
              "`x dense` = time / dense time; `GB/s` = KV bytes needed (sum of lengths) per second; "
              "`% copy` = that over the read rate of a same-sized device copy.")
    print(header, flush=True)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            new = run_case(cfg, np.full(batch, context, np.int32), dtype, impls, rng, "uniform")
            rows += new
            for r in new:
                print(f"  uniform B={batch:3d} len={context:5d} {r['impl']:9s} {r['ms']:9.3f} ms "
                      f"x{r['ratio']:.2f} {r['gbs']:.2f} GB/s", flush=True)
    for batch in args.ragged_batches:
        lengths = sharegpt_like_lengths(rng, batch, cfg.max_len)
        new = run_case(cfg, lengths, dtype, impls, rng, "sharegpt")
        rows += new
        for r in new:
            print(f"  sharegpt B={batch:3d} mean={lengths.mean():6.0f} max={lengths.max():5d} {r['impl']:9s} "
                  f"{r['ms']:9.3f} ms x{r['ratio']:.2f} {r['gbs']:.2f} GB/s", flush=True)

    table = to_markdown(rows, header)
    print("\n" + table)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    provenance.write_markdown(out.with_suffix(".md"), table, record)
    provenance.write_csv(out.with_suffix(".csv"),
                         [{c: (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c]) for c in COLUMNS} for r in rows],
                         COLUMNS, record)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
