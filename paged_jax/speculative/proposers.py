"""Proposers: what guesses a sequence's next tokens for the target model to
verify in one call.

A proposer is any object with ``propose(token_ids, k) -> list[int]``
(:class:`Proposer`): given a sequence's tokens so far (prompt and output),
up to ``k`` guesses of the tokens that follow, fewer or none when it has no
good guess. Verification (:mod:`paged_jax.speculative.verify`) makes any
guess safe, so a proposer is free to be wrong; it is only slow when it is.
A researcher trying a new proposer writes this one method.

:class:`NgramProposer` is prompt lookup (vLLM's ``ngram`` method, Saxena's
prompt lookup decoding): the longest suffix of the tokens, between
``min_n`` and ``max_n`` tokens long, that occurred earlier in them, and the
tokens that followed its earliest occurrence.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from paged_jax.checks import check_int


@runtime_checkable
class Proposer(Protocol):
    """Guesses the tokens after ``token_ids``."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` proposed token ids (possibly none)."""
        ...


def as_token_ids(token_ids) -> np.ndarray:
    """``token_ids`` as i64[n], or a ValueError naming it: a flat sequence
    (list, tuple, 1-D array) of ints in ``[0, 2**31)``, never floats,
    bools or strings."""
    values = list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids
    arr = np.asarray(values)
    if isinstance(values, list) and not values:
        return np.zeros(0, np.int64)
    if isinstance(values, list) and not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                            for t in values):
        raise ValueError(f"token_ids must be ints, got {sorted({type(t).__name__ for t in values})}")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        raise ValueError(f"token_ids must be a flat sequence of ints, got {arr.dtype}{list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**31):
        raise ValueError(f"token_ids must be in [0, 2**31), got values from {arr.min()} to {arr.max()}")
    return arr.astype(np.int64)


MAX_NGRAM = 64
"""Longest n-gram :class:`NgramProposer` looks up."""


class NgramProposer:
    """Prompt lookup: propose what followed the last n-gram the last time.

    For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens
    occur earlier in ``token_ids`` (an occurrence may overlap the suffix,
    never be it), propose the up to ``k`` tokens after the earliest such
    occurrence; the longest ``n`` that matches wins. vLLM's ``NgramProposer``
    picks the same tokens (longest match, earliest position).

    Example: tokens ``[1, 2, 3, 4, 2, 3]`` with ``min_n=2``, ``max_n=3``,
    ``k=4``: ``[4, 2, 3]`` never occurred before, ``[2, 3]`` did at
    position 1, followed by ``[4, 2, 3]`` (three tokens left, fewer than k).

    Args:
      min_n: shortest n-gram matched, >= 1.
      max_n: longest, in ``[min_n, MAX_NGRAM]`` (a lookup costs about
        ``max_n`` passes over the tokens, every sequence, every call).

    Raises:
      ValueError: ``min_n`` < 1 or ``max_n`` outside ``[min_n, MAX_NGRAM]``.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n = check_int("min_n", min_n, 1, MAX_NGRAM + 1)
        self.max_n = check_int("max_n", max_n, self.min_n, MAX_NGRAM + 1)

    def __repr__(self) -> str:
        return f"NgramProposer(min_n={self.min_n}, max_n={self.max_n})"

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix
        n-gram's earliest occurrence; ``[]`` when none matches.

        Args:
          token_ids: the sequence's tokens so far (prompt, then output).
          k: most tokens proposed, >= 0.

        Raises:
          ValueError: ``k`` negative or not an int; ``token_ids`` not a
            flat sequence of token ids (ints >= 0 below 2**31).
        """
        check_int("k", k, 0)
        tokens = as_token_ids(token_ids)
        total = tokens.shape[0]
        if k == 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. total - n - 1: every n-gram but the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
