"""Verification: which proposed tokens a sequence keeps, so that what it
emits is what the target model alone would have produced.

A sequence with ``k`` proposals ``x_0 .. x_{k-1}`` runs ``k + 1`` query
tokens in one call (its last token, then the proposals); the target's
distribution at row ``j`` predicts the token after ``x_{j-1}``, so row
``j`` judges ``x_j`` and row ``k`` gives a bonus token when every proposal
is kept. Each function here returns the tokens emitted, ``a + 1`` of them
where ``a`` proposals were accepted: the accepted proposals, then one
token of the target's own (a correction at the first rejection, else the
bonus). The caller then keeps ``a + 1`` of the ``k + 1`` K/V slots the
call wrote and rolls back the rest
(:func:`paged_jax.paging.page_state.truncate`).

- :func:`greedy_verify` (temperature 0): a proposal is kept while it equals
  the target's argmax; the emitted tokens are the target's argmaxes, so
  the output equals greedy decoding without speculation, token for token.
- :func:`rejection_sample` (sampling): Leviathan et al., 2023 (Algorithm 1,
  Theorem 1) and Chen et al., 2023: keep ``x_j`` with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection draw from
  ``norm(max(0, p_j - q_j))``; with every proposal kept draw the bonus
  from ``p_k``. Each emitted token is then distributed exactly as a draw
  from the target ``p``. A proposer without probabilities (n-gram lookup)
  proposes deterministically: ``q_j`` is one-hot at ``x_j``, so ``x_j`` is
  kept with probability ``p_j(x_j)`` and a rejection draws from ``p_j``
  without ``x_j`` (vLLM's rule for such drafts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_array
from paged_jax.paging.page_state import is_traced


def _accepted(ok: jax.Array, num_draft: jax.Array) -> jax.Array:
    """i32[B]: leading ``True`` entries of ``ok`` (bool[B, K]) among the first ``num_draft[b]``."""
    K = ok.shape[1]
    ok = ok & (jnp.arange(K)[None, :] < num_draft[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _emit(draft_ids: jax.Array, accepted: jax.Array, last: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(i32[B, K + 1] tokens, -1 past each row's count; i32[B] counts)``: the
    accepted proposals, then ``last``."""
    K = draft_ids.shape[1]
    j = jnp.arange(K + 1)[None, :]
    padded = jnp.concatenate([draft_ids, jnp.zeros_like(draft_ids[:, :1])], axis=1)
    tokens = jnp.where(j < accepted[:, None], padded, jnp.where(j == accepted[:, None], last[:, None], -1))
    return tokens.astype(jnp.int32), (accepted + 1).astype(jnp.int32)


def _check_draft(draft_ids, num_draft, B: int, K: int, vocab: int | None) -> None:
    ids = check_array("draft_ids", draft_ids, (B, K), "int")
    n = check_array("num_draft", num_draft, (B,), "int")
    bad = np.flatnonzero((n < 0) | (n > K))
    if bad.size:
        raise ValueError(f"num_draft must be in [0, K={K}], got {n[bad].tolist()} at rows {bad.tolist()}")
    high = vocab if vocab is not None else np.iinfo(np.int32).max
    used = np.arange(K)[None, :] < n[:, None]
    if np.any(used & ((ids < 0) | (ids >= high))):
        raise ValueError(f"draft_ids must be token ids in [0, {high}), got "
                         f"{np.unique(ids[used & ((ids < 0) | (ids >= high))]).tolist()}")


def _check_probs(name: str, probs) -> None:
    probs = np.asarray(probs)
    if not np.isfinite(probs).all() or (probs < 0).any() or not (probs.sum(axis=-1) > 0).all():
        raise ValueError(f"{name} must be finite, >= 0 and sum to > 0 over the vocabulary in every row")


def greedy_verify(target_ids, draft_ids, num_draft) -> tuple[jax.Array, jax.Array]:
    """Greedy verification; see :func:`unchecked_greedy_verify`.

    Raises:
      ValueError: (eager calls) an argument of the wrong shape or dtype,
        ``num_draft`` outside ``[0, K]``, or a used proposal not a token id
        (negative).
    """
    if not is_traced(target_ids, draft_ids, num_draft):
        shape = getattr(target_ids, "shape", None)
        if getattr(target_ids, "ndim", 0) != 2 or shape[1] < 1:
            raise ValueError(f"target_ids must be an integer array of shape [B, K + 1], got "
                             f"{getattr(target_ids, 'dtype', type(target_ids).__name__)}{list(shape or [])}")
        B, K = shape[0], shape[1] - 1
        check_array("target_ids", target_ids, (B, K + 1), "int")
        _check_draft(draft_ids, num_draft, B, K, None)
    return unchecked_greedy_verify(target_ids, draft_ids, num_draft)


@jax.jit
def unchecked_greedy_verify(target_ids: jax.Array, draft_ids: jax.Array,
                            num_draft: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy verification (no checks: for callers inside ``jit``).

    Args:
      target_ids: i32[B, K + 1] the target's argmax at each row.
      draft_ids: i32[B, K] the proposals (entries past ``num_draft`` ignored).
      num_draft: i32[B] proposals per sequence, in ``[0, K]``.

    Returns:
      ``(tokens, num_emitted)``: i32[B, K + 1] the emitted tokens
      (``target_ids[b, :num_emitted[b]]``, -1 after), i32[B] in ``[1, K + 1]``.
    """
    accepted = _accepted(draft_ids == target_ids[:, :-1], num_draft)
    last = jnp.take_along_axis(target_ids, accepted[:, None], axis=1)[:, 0]
    return _emit(draft_ids, accepted, last)


def rejection_sample(keys, target_probs, draft_ids, num_draft, draft_probs=None) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling that preserves the target distribution exactly;
    see :func:`unchecked_rejection_sample`.

    Raises:
      ValueError: (eager calls) an argument of the wrong shape or dtype,
        ``keys`` not one PRNG key per sequence, ``num_draft`` outside
        ``[0, K]``, a used proposal outside ``[0, V)``, or probabilities
        that are not finite, non-negative and of positive mass per row.
    """
    if not is_traced(keys, target_probs, draft_ids, num_draft, draft_probs):
        shape = tuple(getattr(target_probs, "shape", ()))
        if len(shape) != 3 or shape[1] < 1:
            raise ValueError(f"target_probs must be a float array of shape [B, K + 1, V], got "
                             f"{getattr(target_probs, 'dtype', type(target_probs).__name__)}{list(shape)}")
        B, K, V = shape[0], shape[1] - 1, shape[2]
        _check_probs("target_probs", check_array("target_probs", target_probs, (B, K + 1, V), "float"))
        _check_draft(draft_ids, num_draft, B, K, V)
        if draft_probs is not None:
            _check_probs("draft_probs", check_array("draft_probs", draft_probs, (B, K, V), "float"))
        if not (isinstance(keys, jax.Array) and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
                and keys.shape == (B,)):
            raise ValueError(f"keys must be {B} typed PRNG keys (jax.random.key, one per sequence), got "
                             f"{getattr(keys, 'dtype', type(keys).__name__)}{list(getattr(keys, 'shape', []))}")
    return unchecked_rejection_sample(keys, target_probs, draft_ids, num_draft, draft_probs)


@jax.jit
def unchecked_rejection_sample(keys: jax.Array, target_probs: jax.Array, draft_ids: jax.Array,
                               num_draft: jax.Array, draft_probs: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling that preserves the target distribution exactly
    (module docstring). No checks: for callers inside ``jit``.

    Args:
      keys: [B] PRNG keys, one per sequence (the caller seeds them per
        request, stream and step, as :func:`paged_jax.engine.sampling.sample`).
      target_probs: f32[B, K + 1, V] the target's probabilities at each
        row, after temperature and top-p.
      draft_ids: i32[B, K] the proposals.
      num_draft: i32[B] proposals per sequence, in ``[0, K]``.
      draft_probs: f32[B, K, V] the proposer's probabilities, each row the
        distribution its proposal was drawn from; None for a deterministic
        proposer (one-hot at its proposal).

    Returns:
      ``(tokens, num_emitted)`` as :func:`greedy_verify`.
    """
    B, K1, V = target_probs.shape
    K = K1 - 1
    one_hot = jax.nn.one_hot(draft_ids, V, dtype=target_probs.dtype)  # [B, K, V]
    q = one_hot if draft_probs is None else draft_probs
    p_draft = jnp.take_along_axis(target_probs[:, :K], draft_ids[..., None], axis=2)[..., 0]  # p_j(x_j)
    q_draft = jnp.take_along_axis(q, draft_ids[..., None], axis=2)[..., 0]  # q_j(x_j)
    split = jax.vmap(lambda key: jax.random.split(key, 2))(keys)
    u = jax.vmap(lambda key: jax.random.uniform(key, (K,), target_probs.dtype))(split[:, 0])
    # u < p / q, without dividing (q > 0 where the proposer drew x_j; q == 0 never accepts).
    accepted = _accepted(u * q_draft < p_draft, num_draft)
    rows = jnp.arange(B)
    p_at = target_probs[rows, accepted]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    residual = jnp.maximum(p_at - q_pad[rows, accepted], 0.0)  # q of the bonus row is 0: p itself
    mass = residual.sum(axis=-1, keepdims=True)
    # A rejection has residual mass > 0 in exact arithmetic; float rounding may leave none: draw from p.
    dist = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    last = jax.vmap(lambda key, pr: jax.random.categorical(key, jnp.log(pr)))(split[:, 1], dist)
    return _emit(draft_ids, accepted, last)
