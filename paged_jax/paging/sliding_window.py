"""Pages a sliding window no longer sees, returned while the sequence runs.

A layer with a sliding window of ``W`` tokens attends, at query position
``p``, only keys ``(p - W, p]``. Once a page's last token is ``W`` or more
behind the next query, no query of that sequence reads it again; keeping it
until the sequence ends (what a full-attention KV manager does) wastes
``len - W`` tokens of K/V per sequence and layer. Here such pages leave
the block table while the sequence runs: each entry becomes ``NULL_PAGE``
(the window masks it, exactly as it masks padding), the sequence keeps
its length and its table positions (so positions still index the table),
and a page no other sequence holds joins the free queue. The operations of
:mod:`paged_jax.paging.page_state` skip null entries, so such a table forks,
frees, grows and shares like any other.

This is the sliding-window half of vLLM v1's hybrid KV-cache manager
(``SlidingWindowManager.remove_skipped_blocks`` swaps the skipped blocks
for its null block and frees them, last first) and of SGLang's
sliding-window pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_int
from paged_jax.paging import page_state as ps


@jax.jit
def unchecked_drop_pages_before(state: ps.PageState, first_kept: jax.Array) -> ps.PageState:
    """Drops the pages at block-table columns below ``first_kept[s]`` from
    each slot ``s`` (a sliding-window layer group's pages that left the
    window; see the module docstring and :func:`window_first_kept`).

    Each dropped entry becomes ``NULL_PAGE`` and its page loses a reference;
    a page whose count reaches zero joins the free queue (slots ascending,
    each slot's dropped pages tail first). Lengths and ``num_seq_pages``
    (table positions) are unchanged. Entries already null, and columns at
    or past ``num_seq_pages[s]``, are untouched, so a drop is idempotent.

    Args:
      state: the page state.
      first_kept: i32[max_seqs] the first column each slot keeps; 0 drops
        nothing.
    """
    j = jnp.arange(state.max_pages_per_seq)[None, :]
    held = (j < jnp.minimum(first_kept, state.num_seq_pages)[:, None]) & (state.block_tables != ps.NULL_PAGE)
    released = ps.release_entries(state, held)
    return released.replace(block_tables=jnp.where(held, ps.NULL_PAGE, state.block_tables))


def window_first_kept(num_computed, *, sliding_window: int, page_size: int):
    """The first block-table column a sliding-window layer still needs
    once a sequence holds ``num_computed`` tokens.

    The next query sits at position ``num_computed`` and attends keys
    ``(num_computed - sliding_window, num_computed]``; every later query
    sees less of the past. Page ``j`` holds positions ``[j * page_size,
    (j + 1) * page_size)``, so pages ``j < (num_computed - sliding_window +
    1) // page_size`` are never read again (vLLM v1's
    ``SlidingWindowManager.get_num_skipped_tokens``: ``num_computed -
    sliding_window + 1`` tokens skipped).

    Args:
      num_computed: int or i32[...] tokens whose K/V are in the pages.
      sliding_window: W, tokens a query attends (itself included), >= 1.
      page_size: tokens per page, >= 1.

    Returns:
      the same shape as ``num_computed``: columns to drop, >= 0 (numpy on
      numpy input, jax on jax input).

    Raises:
      ValueError: ``sliding_window`` or ``page_size`` not an int >= 1;
        ``num_computed`` not a (signed) integer or integer array, or
        (concrete values) negative.
    """
    sliding_window = check_int("sliding_window", sliding_window, 1)
    page_size = check_int("page_size", page_size, 1)
    if isinstance(num_computed, (int, np.integer)) and not isinstance(num_computed, bool):
        num_computed = check_int("num_computed", int(num_computed), 0)
    else:
        dtype = getattr(num_computed, "dtype", None)
        # signed only: an unsigned count wraps around below zero (10 - 20 + 1 in uint8 is 247)
        if dtype is None or not jnp.issubdtype(dtype, jnp.signedinteger):
            raise ValueError(f"num_computed must be an int or a signed integer array, got {num_computed!r:.80}")
        if not ps.is_traced(num_computed) and (np.asarray(num_computed) < 0).any():
            raise ValueError(f"num_computed must be >= 0, got {np.asarray(num_computed).tolist()!r:.80}")
    skipped = num_computed - sliding_window + 1
    return (skipped * (skipped > 0)) // page_size


def drop_pages_before(state: ps.PageState, first_kept) -> ps.PageState:
    """Drops each slot's pages at columns below ``first_kept[s]``; see
    :func:`unchecked_drop_pages_before`.

    Raises:
      ValueError: ``first_kept`` not an integer array of shape
        (max_seqs,); (eager calls) an entry outside ``[0,
        max_pages_per_seq]`` (checked before the cast to int32, so a large
        value cannot wrap around).
    """
    shape, dtype = getattr(first_kept, "shape", None), getattr(first_kept, "dtype", None)
    if shape != (state.max_seqs,) or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"first_kept must be int[max_seqs={state.max_seqs}], got shape {shape} dtype {dtype}")
    if not ps.is_traced(state, first_kept):
        values = np.asarray(first_kept)
        bad = np.flatnonzero((values < 0) | (values > state.max_pages_per_seq))
        if bad.size:
            raise ValueError(f"first_kept must be in [0, max_pages_per_seq={state.max_pages_per_seq}], got "
                             f"{values[bad].tolist()} at slots {bad.tolist()}")
    return unchecked_drop_pages_before(state, jnp.asarray(first_kept, jnp.int32))
