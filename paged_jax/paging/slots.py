"""Slot mappings: where each token's K/V go in the KV pool.

A token at position ``t`` of the sequence in block-table row ``r`` lives in
page ``block_tables[r, t // page_size]`` at offset ``t % page_size``: flat
slot ``page * page_size + offset`` of a pool flattened to ``[num_pages *
page_size]`` (PagedAttention, Kwon et al., SOSP 2023, section 4.1; vLLM's
``slot_mapping``). Padding and positions outside a row's table map to -1,
which a write drops, so no token can alias another's slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax.checks import check_int


def slot_mapping(
    block_tables: jax.Array, positions: jax.Array, valid: jax.Array, *, page_size: int
) -> jax.Array:
    """Flat KV slots for token positions: ``page * page_size + offset``.

    Args:
      block_tables: i32[B, pages_per_seq].
      positions: i32[B, T] token positions (0-based) within each sequence.
      valid: bool[B, T] positions that exist; others map to -1.
      page_size: tokens per page, >= 1.

    Returns:
      i32[B, T] slot ids into a pool flattened to ``[num_pages * page_size]``;
      -1 where ``valid`` is False or the position lies outside
      ``[0, pages_per_seq * page_size)`` (so it can never alias another
      token's slot; a write to -1 is dropped).

    Raises:
      ValueError: ``page_size`` < 1, or shapes and dtypes that do not fit.
    """
    check_int("page_size", page_size)
    if getattr(block_tables, "ndim", None) != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables must be an integer [B, pages_per_seq] array, got {block_tables!r:.80}")
    batch = block_tables.shape[0]
    if getattr(positions, "ndim", None) != 2 or positions.shape[0] != batch or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer [B={batch}, T] array, got {getattr(positions, 'shape', positions)}")
    if getattr(valid, "shape", None) != positions.shape or valid.dtype != jnp.bool_:
        raise ValueError(f"valid must be bool{list(positions.shape)}, got {getattr(valid, 'dtype', None)}{list(getattr(valid, 'shape', ()))}")
    return _slot_mapping(block_tables, positions, valid, page_size=page_size)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _slot_mapping(block_tables, positions, valid, *, page_size):
    rows = jnp.broadcast_to(jnp.arange(block_tables.shape[0], dtype=jnp.int32)[:, None], positions.shape)
    return flat_slot_mapping(block_tables, jnp.where(valid, rows, -1), positions, page_size=page_size)


def flat_slot_mapping(block_tables: jax.Array, rows: jax.Array, positions: jax.Array, *, page_size: int) -> jax.Array:
    """Flat KV slots for tokens of a flat batch (inner function: no checks).

    Args:
      block_tables: i32[S, pages_per_seq].
      rows: i32[...] the block-table row of each token; -1 for padding.
      positions: i32[...] each token's position in its sequence.
      page_size: tokens per page.

    Returns:
      i32[...] ``page * page_size + offset``; -1 for padding and for
      positions outside ``[0, pages_per_seq * page_size)`` (a write to -1
      is dropped, so it can never alias another token's slot).
    """
    num_rows, pages_per_seq = block_tables.shape
    valid = (rows >= 0) & (positions >= 0) & (positions < pages_per_seq * page_size)
    col = jnp.clip(positions // page_size, 0, pages_per_seq - 1)
    page = block_tables[jnp.clip(rows, 0, num_rows - 1), col]
    return jnp.where(valid, page * page_size + positions % page_size, -1).astype(jnp.int32)
