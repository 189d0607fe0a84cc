"""The sampler against exact probabilities, and a row's independence from its batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.engine.sampling import sample, top_p_mask


def _nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """f64 oracle: softmax(logits / T) restricted to the smallest set of most
    likely tokens whose mass reaches top_p, renormalised."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _draws(logits, temperature, top_p, n):
    """n draws of one row: the same row at steps 0..n-1 (independent keys)."""
    b = jnp.asarray(np.tile(logits, (n, 1)), jnp.float32)
    full = lambda x, dt: jnp.full((n,), x, dt)  # noqa: E731
    return np.asarray(sample(b, full(temperature, jnp.float32), full(top_p, jnp.float32), full(7, jnp.uint32),
                             full(0, jnp.int32), jnp.arange(n, dtype=jnp.int32)))


def test_sample_matches_exact_probabilities():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.5, 0.5)):
        expected = _nucleus_probs(logits, temperature, top_p)
        counts = np.bincount(_draws(logits, temperature, top_p, n), minlength=len(logits))
        assert np.all(counts[expected == 0] == 0), (temperature, top_p, counts)  # outside the nucleus: never
        # Five standard errors of a binomial proportion.
        tol = 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9
        np.testing.assert_array_less(np.abs(counts / n - expected), tol + 1e-12)


def test_top_p_mask_matches_the_sorted_definition():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 50)) * 2
    top_p = rng.uniform(0.05, 1.0, 16)
    mask = np.asarray(top_p_mask(jnp.asarray(logits, jnp.float32), jnp.asarray(top_p, jnp.float32)))
    for row, p, m in zip(logits, top_p, mask):
        np.testing.assert_array_equal(m, _nucleus_probs(row, 1.0, p) > 0)


def test_a_row_does_not_depend_on_its_batch():
    """Bit-exact: the same row, seed, stream and step give the same token
    whatever else is in the batch (other rows' logits, temperatures, and
    top_p < 1 forcing the sorted path)."""
    rng = np.random.default_rng(1)
    vocab = 1000
    row = rng.standard_normal(vocab).astype(np.float32)
    for step in range(20):
        alone = sample(jnp.asarray(row[None]), jnp.ones(1), jnp.ones(1), jnp.full(1, 3, jnp.uint32),
                       jnp.zeros(1, jnp.int32), jnp.full(1, step, jnp.int32))
        batch = np.concatenate([rng.standard_normal((3, vocab)).astype(np.float32), row[None]])
        mixed = sample(jnp.asarray(batch), jnp.asarray([0.0, 0.5, 2.0, 1.0]), jnp.asarray([1.0, 0.3, 0.9, 1.0]),
                       jnp.asarray([9, 8, 7, 3], jnp.uint32), jnp.asarray([0, 1, 2, 0], jnp.int32),
                       jnp.asarray([5, 5, 5, step], jnp.int32))
        assert int(mixed[3]) == int(alone[0])
        assert int(mixed[0]) == int(np.argmax(batch[0]))  # temperature 0: greedy


def test_streams_and_steps_draw_independently():
    logits = jnp.zeros((1, 1000), jnp.float32)  # uniform: collisions are rare
    picks = {int(sample(logits, jnp.ones(1), jnp.ones(1), jnp.full(1, 3, jnp.uint32), jnp.full(1, s, jnp.int32),
                        jnp.full(1, t, jnp.int32))[0]) for s in range(4) for t in range(4)}
    assert len(picks) >= 14
    jax.clear_caches()


def test_tiny_temperature_is_greedy_not_an_overflow():
    logits = jnp.asarray([[10.0, 20.0, 30.0, 5.0], [3e38, 1e38, -3e38, 0.0]], jnp.float32)
    picks = sample(logits, jnp.full(2, 2e-38), jnp.ones(2), jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32),
                   jnp.zeros(2, jnp.int32))
    assert picks.tolist() == [2, 0]
