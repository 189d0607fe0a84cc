"""Paged attention in XLA, and the dispatcher to the Pallas kernels.

- :mod:`~paged_jax.attention.paged`: the padded ``[B, T]`` batch; the door
  :func:`paged_attention` and its implementations;
- :mod:`~paged_jax.attention.batch`: one call's flat token batch (mixed prefill
  chunks and decode tokens, offsets instead of padding);
- :mod:`~paged_jax.attention.ragged`: attention over that flat batch, the
  engine's path.

The names of :mod:`~paged_jax.attention.paged` are re-exported here, so
``from paged_jax.attention import paged_attention`` works as it did when this
was one module; they load on first use, so importing
:mod:`~paged_jax.attention.batch` alone does not import the kernels.
"""

import importlib

__all__ = ["IMPLS", "causal_attention", "paged_attention", "resolve_impl", "segment_positions",
           "xla_paged_attention", "xla_paged_decode_attention"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("paged_jax.attention.paged"), name)
    raise AttributeError(f"module 'paged_jax.attention' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
