"""An OpenAI-compatible HTTP server over the paged-jax engine.

Layering: ``server -> models -> paged_jax``; nothing in ``models`` or
``paged_jax`` imports this package.

- :mod:`server.protocol`: request bodies (pydantic, strict) and OpenAI
  error objects;
- :mod:`server.limits`: bounds on a request (its body's bytes, each
  field a body can grow);
- :mod:`server.engine_loop`: the one thread that owns the engine, and the
  asyncio side of it (:func:`server.engine_loop.admit`);
- :mod:`server.openai_serving`: completions and chat completions, streamed
  or not;
- :mod:`server.metrics`: ``/metrics`` (Prometheus);
- :mod:`server.app`: the FastAPI app (:func:`build_app`);
- :mod:`server.threaded`: the app in a background thread (tests,
  benchmarks);
- ``python -m server``: the command line.
"""

from server.app import build_app
from server.threaded import ThreadedServer

__all__ = ["ThreadedServer", "build_app"]
