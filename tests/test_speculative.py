"""Speculative decoding's engine-free parts: the n-gram proposer (vLLM's
prompt lookup), greedy verification, and rejection sampling whose emitted
tokens follow the target distribution exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.speculative import verify
from paged_jax.speculative.proposers import NgramProposer, Proposer

# ------------------------------------------------------------ proposers


def test_ngram_proposes_after_the_longest_earliest_match():
    assert NgramProposer(2, 3).propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # vLLM's docstring example
    # The longest n wins over an earlier shorter match: [9, 2, 3] occurs at 4, [2, 3] already at 1.
    assert NgramProposer(1, 3).propose([2, 3, 7, 9, 2, 3, 5, 6, 9, 2, 3], 2) == [5, 6]
    # Of equal matches the earliest: [1, 2] at 0 (then 7) and at 3 (then 8).
    assert NgramProposer(2, 2).propose([1, 2, 7, 1, 2, 8, 1, 2], 1) == [7]
    # Overlapping the suffix is allowed: a run repeats itself.
    assert NgramProposer(1, 2).propose([5, 5, 5], 3) == [5]
    assert NgramProposer(2, 3).propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert NgramProposer(1, 1).propose([7], 2) == [] and NgramProposer().propose([], 2) == []
    assert NgramProposer().propose([1, 2, 1, 2], 0) == []
    assert isinstance(NgramProposer(), Proposer)


def test_ngram_refuses_bad_arguments():
    for kwargs, needle in (({"min_n": 0}, "min_n"), ({"min_n": 3, "max_n": 2}, "max_n"),
                           ({"min_n": 1.5}, "min_n"), ({"max_n": 10**6}, "max_n")):
        with pytest.raises(ValueError, match=needle):
            NgramProposer(**kwargs)
    with pytest.raises(ValueError, match="k"):
        NgramProposer().propose([1, 2], -1)


# ------------------------------------------------------------ greedy


def test_greedy_verify_keeps_proposals_while_they_are_the_argmax():
    target = jnp.asarray([[5, 6, 7, 8]] * 4, jnp.int32)
    draft = jnp.asarray([[5, 6, 7], [9, 6, 7], [5, 6, 0], [5, 6, 7]], jnp.int32)
    tokens, n = verify.greedy_verify(target, draft, jnp.asarray([3, 3, 3, 1], jnp.int32))
    # all kept + bonus; rejected at 0 (the correction 5); rejected at 2 (correction 7); one proposal, kept.
    assert np.asarray(n).tolist() == [4, 1, 3, 2]
    assert np.asarray(tokens).tolist() == [[5, 6, 7, 8], [5, -1, -1, -1], [5, 6, 7, -1], [5, 6, -1, -1]]
    # Whatever is kept, the emitted tokens are the target's argmaxes: greedy output without speculation.
    t, c = np.asarray(tokens), np.asarray(n)
    assert all((t[b, :c[b]] == np.asarray(target)[b, :c[b]]).all() for b in range(4))


# ------------------------------------------------------------ sampling

V, K, N = 5, 2, 200_000
CHI2_DF4_P1E6 = 33.4  # chi-square critical value, 4 degrees of freedom, p = 1e-6


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def _case():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V), size=K + 1).astype(np.float64)  # target rows (f64 truth)
    q = rng.dirichlet(np.ones(V), size=K).astype(np.float64)  # draft rows
    return p, q


def _draw(fn, p, q, *, deterministic: bool, seed: int = 1):
    keys = jax.random.split(jax.random.key(seed), N)
    draft_rng = np.random.default_rng(seed)
    if deterministic:  # a lookup proposer always proposes the same tokens
        draft = np.tile([3, 1], (N, 1))
    else:  # drawn from q row by row (x_1 from q_1 whatever x_0: the test's q does not depend on it)
        draft = np.stack([draft_rng.choice(V, size=N, p=q[j]) for j in range(K)], axis=1)
    tp = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (N, K + 1, V))
    dp = None if deterministic else jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, K, V))
    tokens, n = fn(keys, tp, jnp.asarray(draft, jnp.int32), jnp.full((N,), K, jnp.int32), dp)
    return np.asarray(tokens), np.asarray(n), draft


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-model", "ngram"])
def test_rejection_sampling_emits_the_target_distribution(deterministic):
    p, q = _case()
    tokens, n, draft = _draw(verify.rejection_sample, p, q, deterministic=deterministic)
    assert ((1 <= n) & (n <= K + 1)).all()
    # First emitted token ~ p_0 exactly.
    assert _chi2(np.bincount(tokens[:, 0], minlength=V), p[0]) < CHI2_DF4_P1E6
    # Second, where the first was the proposal kept (the target's row 1 conditions on it) ~ p_1.
    kept = (n >= 2) & (tokens[:, 0] == draft[:, 0])
    assert _chi2(np.bincount(tokens[kept, 1], minlength=V), p[1]) < CHI2_DF4_P1E6
    # Acceptance of the first proposal: sum_x min(p, q) for a draft model, p_0(x_0) for a lookup.
    rate = np.minimum(p[0], q[0]).sum() if not deterministic else p[0][3]
    assert abs((n >= 2).mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / N)


def test_the_chi_square_test_catches_a_sampler_that_skips_the_ratio(monkeypatch):
    """The mutant keeps every proposal (no min(1, p/q) test): its first token
    follows the draft q, not p, and the same check must fail."""
    p, q = _case()
    monkeypatch.setattr(verify, "_accepted", lambda ok, num_draft: num_draft)
    tokens, _, _ = _draw(verify.unchecked_rejection_sample.__wrapped__, p, q, deterministic=False)
    assert _chi2(np.bincount(tokens[:, 0], minlength=V), p[0]) > CHI2_DF4_P1E6


def test_rejection_sampling_is_seeded_per_sequence():
    p, q = _case()
    a = _draw(verify.rejection_sample, p, q, deterministic=False, seed=7)
    b = _draw(verify.rejection_sample, p, q, deterministic=False, seed=7)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_ngram_refuses_what_is_not_token_ids():
    n = NgramProposer()
    for bad, needle in (([1.7, 2.2], "must be ints"), ([True, 1], "must be ints"), (["1"], "must be ints"),
                        (np.zeros((2, 3), np.int32), "flat sequence"), (5, "flat sequence"),
                        ([-1, 2], r"\[0, 2\*\*31\)"), (np.asarray([2**40]), r"\[0, 2\*\*31\)")):
        with pytest.raises(ValueError, match=f"token_ids .*{needle}"):
            n.propose(bad, 2)
    assert n.propose(np.asarray([4, 5, 4], np.int32), 1) == [5] and n.propose((4, 5, 4), 1) == [5]


def test_verification_checks_its_arguments_at_the_door():
    t = jnp.asarray([[5, 6, 7]], jnp.int32)
    d = jnp.asarray([[5, 6]], jnp.int32)
    two, three = jnp.asarray([2], jnp.int32), jnp.asarray([3], jnp.int32)
    for args, needle in (((t[:, :2], d, two), r"draft_ids must be an integer array of shape \(1, 1\)"),
                         ((t, d, three), r"num_draft must be in \[0, K=2\], got \[3\]"),
                         ((t, d, jnp.asarray([2, 2])), r"num_draft must be an integer array of shape \(1,\)"),
                         ((t.astype(jnp.float32), d, jnp.asarray([2], jnp.int32)), "target_ids must be an integer"),
                         ((t, -d, jnp.asarray([2], jnp.int32)), "draft_ids must be token ids")):
        with pytest.raises(ValueError, match=needle):
            verify.greedy_verify(*args)
    keys = jax.random.split(jax.random.key(0), 1)
    probs = jnp.full((1, 3, 4), 0.25, jnp.float32)
    ok_n = jnp.asarray([2], jnp.int32)
    for args, needle in (((keys, probs, jnp.asarray([[-1, -2]], jnp.int32), ok_n), r"token ids in \[0, 4\)"),
                         ((keys, probs, jnp.asarray([[4, 0]], jnp.int32), ok_n), r"token ids in \[0, 4\)"),
                         ((keys, probs.at[0, 0].set(jnp.nan), d * 0, ok_n), "target_probs must be finite"),
                         ((keys, jnp.zeros((1, 3, 4)), d * 0, ok_n), "sum to > 0"),
                         ((jax.random.split(jax.random.key(0), 3), probs, d * 0, ok_n), "keys must be 1 typed"),
                         ((keys, probs[:, :, :, None], d * 0, ok_n), "target_probs must be a float array"),
                         ((keys, probs, d * 0, ok_n, jnp.full((1, 2, 5), 0.2)), r"draft_probs must be a float array")):
        with pytest.raises(ValueError, match=needle):
            verify.rejection_sample(*args)
    # Under jit nothing checks (the unchecked functions): the callers guarantee the shapes.
    tokens, n = jax.jit(verify.greedy_verify)(t, d, ok_n)
    assert np.asarray(n).tolist() == [3] and np.asarray(tokens).tolist() == [[5, 6, 7]]
