"""The continuous-batching serving engine (:mod:`~paged_jax.engine.core`) and
the modules it is made of, one concept each: requests and their outputs,
the scheduler, the KV-cache manager, the flat batch of a call, the jitted
step, sampling, beam search, output processing, detokenization and
statistics (the list is in :mod:`paged_jax.engine.core`'s docstring).

The engine's API is re-exported here, so ``from paged_jax.engine import
Engine, EngineConfig, Request`` works as it did when this was one module.
"""

from paged_jax.engine.core import (
    CallRecord,
    CompletionOutput,
    Engine,
    EngineConfig,
    EngineStats,
    PagedModel,
    Request,
    RequestOutput,
    SamplingParams,
    drain,
    num_traces,
)

__all__ = ["CallRecord", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PagedModel", "Request",
           "RequestOutput", "SamplingParams", "drain", "num_traces"]
