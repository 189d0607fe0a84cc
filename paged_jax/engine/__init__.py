"""The continuous-batching serving engine (:mod:`~paged_jax.engine.core`) and
the modules it is made of, one concept each: requests and their outputs,
the scheduler, the KV-cache manager, the flat batch of a call, the jitted
step, sampling, beam search, output processing, detokenization and
statistics (the list is in :mod:`paged_jax.engine.core`'s docstring).

The engine's API is re-exported here, so ``from paged_jax.engine import
Engine, EngineConfig, Request`` works as it did when this was one module.
The names load on first use: importing one module of the package (the
jitted step, say, in a process that compiles it ahead of time with no
tokenizer installed) does not import the whole engine.
"""

import importlib

__all__ = ["CallRecord", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PagedModel", "Request",
           "RequestOutput", "SamplingParams", "drain", "num_traces"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("paged_jax.engine.core"), name)
    raise AttributeError(f"module 'paged_jax.engine' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
