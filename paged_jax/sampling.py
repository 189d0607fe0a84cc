"""Token sampling: greedy, temperature and top-p (nucleus), seeded per request.

A request's random stream depends only on its seed and on how many tokens it
has generated (``key = fold_in(key(seed), num_generated)``), never on batch
position or on what else is running. A request preempted and recomputed
therefore samples exactly the tokens it would have sampled uninterrupted.
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
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    steps: jax.Array,  # i32[B] tokens generated so far per request
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

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row)

    pick = jax.vmap(draw)(seeds, steps, sorted_logits)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
