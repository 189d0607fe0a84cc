"""Token sampling: greedy, temperature and top-p (nucleus), seeded per request.

A sequence's random stream depends only on its request's seed, its index
among the request's parallel samples (``stream``) and how many tokens it has
generated (``key = fold_in(fold_in(key(seed), stream), num_generated)``),
never on batch position or on what else is running. A sequence preempted and
recomputed therefore samples exactly the tokens it would have sampled
uninterrupted, and the ``n`` samples of one request draw independently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
      temperature: 0 for greedy (argmax), else logits are divided by it.
      top_p: keep the smallest set of tokens whose probability mass reaches
        ``top_p`` (Holtzman et al., 2020); 1.0 keeps all.
      seed: the request's random seed.
      n: parallel samples: continuations of one prompt, which share its
        pages (forked after prefill, paper section 4.4) and draw from their
        own streams.
      beam_width: 0 for sampling; ``w >= 1`` for beam search with ``w``
        beams (:mod:`paged_jax.beam_search`), which returns the ``w`` best
        hypotheses. Needs ``temperature == 0``, ``top_p == 1`` and ``n == 1``.
      length_penalty: beam search ranks finished hypotheses by
        ``cumulative_logprob / num_generated ** length_penalty``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1
    beam_width: int = 0
    length_penalty: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name} must be a number, got {name}={value!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got temperature={self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got seed={self.seed!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, (int, np.integer)) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got n={self.n!r}")
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, (int, np.integer)) or self.beam_width < 0:
            raise ValueError(f"beam_width must be an int >= 0, got beam_width={self.beam_width!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float, np.integer, np.floating)) or not np.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got length_penalty={lp!r}")
        if self.beam_width and (self.temperature != 0 or self.top_p != 1.0 or self.n != 1):
            raise ValueError(
                "beam search is deterministic and returns beam_width hypotheses: it needs temperature=0, top_p=1 "
                f"and n=1, got temperature={self.temperature} top_p={self.top_p} n={self.n}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_seqs(self) -> int:
        """Sequences a request runs at most at once: its beams or its
        samples."""
        return self.beam_width or self.n


@jax.jit
def greedy(logits: jax.Array) -> jax.Array:
    """logits: f32[B, V] -> i32[B] argmax (lowest id on ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@jax.jit
def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B]
    top_p: jax.Array,  # f32[B]
    seeds: jax.Array,  # u32[B]
    streams: jax.Array,  # i32[B] index of the sequence among its request's samples
    steps: jax.Array,  # i32[B] tokens generated so far per sequence
) -> jax.Array:
    """Samples one token per row; rows with ``temperature == 0`` take the argmax.

    Returns:
      i32[B] token ids.
    """
    logits = logits.astype(jnp.float32)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    # Top-p: sort descending, keep tokens whose preceding mass is below top_p
    # (the most likely token is always kept).
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    sorted_logits = jnp.where(mass_before < top_p[:, None], sorted_logits, -jnp.inf)

    def draw(seed, stream, step, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), step)
        return jax.random.categorical(key, row)

    pick = jax.vmap(draw)(seeds, streams, steps, sorted_logits)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
