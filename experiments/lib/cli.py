"""What the experiment scripts' command lines share: the flags several
scripts take (:data:`FLAGS`, added by :func:`add_flag`, one definition and
one default each), argument checks that fail before any work, the results
and compile-cache folders, the machine line of every table.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.provenance import REPO
from paged_jax.engine.core import Engine
from paged_jax.engine.requests import Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.jit_stats import enable_persistent_cache
from paged_jax.paging.kv_cache import default_kv_dtype
from pallas_kernels.common import KV_DTYPE_ALIASES

RESULTS = REPO / "results"
"""Where the scripts write their tables by default (``--out``)."""

KV_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "fp8")
"""--kv-dtype's choices; ``fp8`` is float8_e4m3fn (``KV_DTYPE_ALIASES``)."""


def kv_dtype_name(value: str) -> str:
    """--kv-dtype's value with an alias resolved (``fp8`` -> ``float8_e4m3fn``), so the rest of a script, and its
    tables' K/V dtype, see the dtype the pool is allocated in."""
    alias = KV_DTYPE_ALIASES.get(value)
    return value if alias is None else alias.name


def positive_number(text: str) -> float:
    """An argparse ``type``: a finite float > 0 (``--min-seconds``), else an
    error naming the flag."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


FLAGS: dict[str, dict] = {
    "model": dict(default="smollm2",
                  help="'smollm2' (the packaged GGUF, default), a Hugging Face checkpoint folder, a random-weight "
                       "preset or 'toy' (a two-layer random decoder; packaged ShareGPT lengths, random ids)"),
    "max_batched_tokens": dict(type=int, default=256, help="tokens per model call (default %(default)s)"),
    "out": dict(type=pathlib.Path, default=RESULTS,
                help="results folder (default: the repository's results/, replacing the tables committed there)"),
    "seed": dict(type=int, default=0, help="ShareGPT shuffle seed (default %(default)s)"),
    "num_requests": dict(type=int, default=48, help="ShareGPT requests to serve (default %(default)s)"),
    "max_output_len": dict(type=int, default=48, help="cap on each request's output tokens (default %(default)s)"),
    "page_size": dict(type=int, default=16, help="tokens per KV page (default %(default)s)"),
    "max_seqs": dict(type=int, default=64, help="most sequences running at once (default %(default)s)"),
    "dtype": dict(choices=("float32", "bfloat16"), default=None,
                  help="weight dtype (default float32 on CPU, bfloat16 on GPU and TPU)"),
    "kv_dtype": dict(type=kv_dtype_name, choices=KV_DTYPES, default=None,
                     help="K/V page dtype (default float32 on CPU, bfloat16 on GPU and TPU). The quantized ones, "
                          "int8, float8_e4m3fn (alias fp8) and float8_e5m2, allocate 1-byte pages of that exact "
                          "dtype plus one f32 scale per token and KV head beside them: H + 4 bytes per token, KV "
                          "head and K or V, about a quarter of float32 and half of bfloat16 at H = 64"),
    "kv_budget_tokens": dict(type=int, default=8192, help="KV pool size in tokens, at least one sequence of "
                                                          "--max-seq-len (default %(default)s)"),
    "max_seq_len": dict(type=int, default=2048,
                        help="most tokens per sequence, prompt plus output (default %(default)s)"),
    "min_seconds": dict(type=positive_number, default=0.2,
                        help="each timed loop lasts about this long, seconds (default %(default)s)"),
}
"""The flags several scripts take, by ``args`` attribute: the keyword
arguments of ``ArgumentParser.add_argument``. A script that needs another
default for its experiment (``--num-requests 12``) says so where it adds
the flag."""
POSITIVE = frozenset({"num_requests", "max_output_len", "page_size", "max_seqs", "max_batched_tokens",
                      "kv_budget_tokens", "max_seq_len"})
"""Flags of :data:`FLAGS` that :func:`check_flags` requires to be >= 1."""


def add_flag(p: argparse.ArgumentParser, name: str, **overrides) -> None:
    """Adds ``--<name>`` (underscores as dashes) as :data:`FLAGS` defines it;
    ``overrides`` replace ``add_argument`` keywords (``default=12``)."""
    p.add_argument("--" + name.replace("_", "-"), **{**FLAGS[name], **overrides})


def add_flags(p: argparse.ArgumentParser, *names: str) -> None:
    """Adds each of ``names`` as :data:`FLAGS` defines it."""
    for name in names:
        add_flag(p, name)


def check_flags(p: argparse.ArgumentParser, args) -> None:
    """Exits with an argparse error naming the flag unless every flag of
    :data:`POSITIVE` that ``args`` holds is >= 1 and ``--seed`` (if any) is
    >= 0. Cheap and side-effect
    free: run it before the script's own checks (which may divide by
    ``--page-size``); :func:`check_outputs` comes last."""
    require_positive(p, args, *sorted(POSITIVE & vars(args).keys()))
    if getattr(args, "seed", 0) < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if {"kv_budget_tokens", "max_seq_len", "page_size"} <= vars(args).keys() and (
            args.kv_budget_tokens // args.page_size * args.page_size < args.max_seq_len):
        p.error(f"--kv-budget-tokens rounded down to pages of --page-size {args.page_size} must hold one sequence of "
                f"--max-seq-len {args.max_seq_len}, got {args.kv_budget_tokens}")


def check_outputs(p: argparse.ArgumentParser, args) -> None:
    """Fails now, not after minutes of work, when ``--out`` or the compile
    cache (where ``args`` holds them) cannot be written."""
    if "out" in vars(args):
        check_out_dir(p, args.out)
    if "compile_cache" in vars(args):
        check_compile_cache(p, args)


def resolve_dtype(name: str | None) -> jnp.dtype:
    """``--dtype``'s dtype: ``name``, else (the flag's default, None) float32
    on CPU and bfloat16 on GPU and TPU."""
    return jnp.dtype(name or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))


def resolve_kv_dtype(name: str | None) -> jnp.dtype:
    """``--kv-dtype``'s dtype: ``name``, else float32 on CPU and bfloat16 on
    GPU and TPU (``paged_jax.paging.kv_cache.default_kv_dtype``)."""
    return jnp.dtype(name or default_kv_dtype())


def require_positive(p: argparse.ArgumentParser, args, *names: str) -> None:
    """Exits with an argparse error naming the flag (``--max-seqs``) unless
    every ``args.<name>`` is >= 1 or None (a default the script computes)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def available_memory_bytes() -> int | None:
    """Memory a new array can take: the default device's ``bytes_limit``
    less what it has in use (GPU, TPU), else the host's ``MemAvailable``
    (``/proc/meminfo``); None when neither can be read."""
    try:
        stats = jax.devices()[0].memory_stats()
        if stats and "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    except Exception:  # backends without memory stats  # noqa: BLE001
        pass
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """The CPU model, core count, JAX version and backend, for tables."""
    return f"{cpu_model()}, {os.cpu_count()} cores, JAX {jax.__version__} on {jax.default_backend()}"


DEFAULT_COMPILE_CACHE = REPO / ".jax_cache"


def add_compile_cache_args(p: argparse.ArgumentParser) -> None:
    """``--compile-cache DIR`` / ``--no-compile-cache``: JAX's persistent
    compilation cache, on by default so a second run compiles nothing."""
    p.add_argument(
        "--compile-cache", type=pathlib.Path, default=DEFAULT_COMPILE_CACHE,
        help=f"folder of JAX's persistent compilation cache (default {DEFAULT_COMPILE_CACHE.name}/ in the repository)",
    )
    p.add_argument("--no-compile-cache", action="store_true", help="compile everything afresh")


def setup_compile_cache(args) -> str:
    """Applies the compile-cache flags (checked by :func:`check_compile_cache`);
    returns a line saying what was done."""
    if args.no_compile_cache:
        return "persistent compilation cache: off"
    enable_persistent_cache(args.compile_cache)
    return f"persistent compilation cache: {args.compile_cache}"


def check_out_dir(p: argparse.ArgumentParser, out: pathlib.Path, flag: str = "--out") -> None:
    """Fails now, not after minutes of serving, when the folder a flag names
    cannot be created or written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        p.error(f"{flag} {str(out)!r} is not a writable folder: {e}")


def check_compile_cache(p: argparse.ArgumentParser, args) -> None:
    """Fails now when the compile cache (unless ``--no-compile-cache``)
    cannot be written."""
    if not args.no_compile_cache:
        check_out_dir(p, args.compile_cache.expanduser(), "--compile-cache")


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
