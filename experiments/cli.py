"""What the experiment scripts' command lines share: argument checks that
fail before any work, the results and compile-cache folders, the machine
line of every table.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform

import jax

from paged_jax.jit_stats import enable_persistent_cache


def require_positive(p: argparse.ArgumentParser, args, *names: str) -> None:
    """Exits with an argparse error naming the flag (``--max-seqs``) unless
    every ``args.<name>`` is >= 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
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


DEFAULT_COMPILE_CACHE = pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"


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
    if not args.no_compile_cache:
        check_out_dir(p, args.compile_cache.expanduser(), "--compile-cache")
