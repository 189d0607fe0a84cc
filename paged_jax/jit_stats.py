"""Counting what JAX compiles: seconds, programs built, persistent-cache hits.

Read from JAX's own monitoring events (``jax.monitoring``): every
``/jax/core/compile/*`` duration (tracing, lowering, XLA compilation) adds
to ``seconds``; each XLA compilation request is one
``backend_compile_duration`` event, and a request served from the persistent
compilation cache (``jax_compilation_cache_dir``) also records a
``cache_hits`` event, so ``compiled = requests - cache_hits`` counts the
programs XLA actually built.
"""

from __future__ import annotations

import dataclasses

import jax.monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class CompileCounts:
    """Totals since the monitor was made. ``seconds``: tracing, lowering and
    compiling (or loading from the persistent cache); ``requests``: XLA
    programs asked for; ``cache_hits``: of those, loaded from the persistent
    cache."""

    seconds: float = 0.0
    requests: int = 0
    cache_hits: int = 0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled (requests not served by the cache)."""
        return self.requests - self.cache_hits


class CompileMonitor:
    """Accumulates :class:`CompileCounts` from JAX's monitoring events while
    open. Use as a context manager, or call :meth:`close`."""

    def __init__(self):
        self.counts = CompileCounts()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_):
        if event.startswith("/jax/core/compile/"):
            self.counts.seconds += duration
        if event == _BACKEND_COMPILE:
            self.counts.requests += 1

    def _on_event(self, event: str, **_):
        if event == _CACHE_HIT:
            self.counts.cache_hits += 1

    def snapshot(self) -> CompileCounts:
        return dataclasses.replace(self.counts)

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def __enter__(self) -> "CompileMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enable_persistent_cache(path) -> None:
    """Turns on JAX's persistent compilation cache in folder ``path``
    (created if missing), caching every program however fast it compiled,
    so a second run of the same shapes compiles nothing."""
    import pathlib

    import jax

    path = pathlib.Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
