"""The free-page queue of :class:`paged_jax.paging.page_state.PageState`: a FIFO
ring buffer of page ids, and the order in which released pages join it.

Allocation takes pages off the head; released pages join at the tail, so
the page freed longest ago is handed out first (vLLM's
``FreeKVCacheBlockQueue``: a prefix cache then evicts its least recently
used page first). Pages released by one operation join in
:func:`free_order`: rows in ascending order, each row's pages *tail first*
(vLLM frees a request's blocks in reverse, and its sliding-window manager
frees the blocks that left the window from the last one back), so a prefix
cache loses a chain's last pages before its first ones and what is left of
the chain stays reachable. A page that several released rows held goes
where its last holder puts it, as if the rows were released one by one.

The functions here take the ring's arrays, not the page state, so that
:mod:`paged_jax.paging.page_state` composes them into its operations; everything
is jittable with static shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.checks import check_int


def free_order(tables) -> list[int]:
    """The order in which :func:`push_released` queues the pages of the rows
    it releases in one call, given their page lists (``tables``, in row
    order, each in logical order): every row's pages tail first, one row
    after another, a page that appears more than once at its last place.
    Pages still referenced elsewhere are not freed; drop them from the
    result (the host twin, :class:`paged_jax.paging.block_pool.BlockPool`, does).
    """
    flat = [p for pages in tables for p in reversed(pages)]
    last = {p: i for i, p in enumerate(flat)}
    return [p for i, p in enumerate(flat) if last[p] == i]


def pop(queue: jax.Array, head: jax.Array, num_free: jax.Array, need: jax.Array, width: int):
    """Takes ``need[s]`` pages off the head of the ring, row by row.

    Args:
      queue: i32[cap] the ring of free page ids.
      head: i32[] index of the next page handed out.
      num_free: i32[] pages in the ring.
      need: i32[rows] pages per row, each <= ``width``.
      width: static, columns of the returned page array.

    Returns:
      ``(pages, valid, ok, new_head, new_num_free)``: ``pages``
      i32[rows, width] (entry ``[s, j]`` meaningful where ``valid[s, j] = j
      < need[s]``); ``ok`` False when the ring holds fewer than
      ``need.sum()`` pages. Nothing is committed: the caller keeps the new
      head and count only when ``ok``.
    """
    width = check_int("width", width, 1)
    cap = queue.shape[0]
    total = need.sum()
    ok = total <= num_free
    offset = jnp.cumsum(need) - need  # exclusive prefix sum, i32[rows]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    valid = j < need[:, None]  # [rows, width]
    pages = queue[(head + offset[:, None] + j) % cap]
    return pages, valid, ok, (head + total) % cap, num_free - total


def push_released(queue: jax.Array, head: jax.Array, num_free: jax.Array, tables: jax.Array, held: jax.Array,
                  released: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Appends the released pages to the ring's tail in :func:`free_order`.

    Args:
      queue, head, num_free: the ring, as in :func:`pop`.
      tables: i32[rows, max_pages] block tables.
      held: bool[rows, max_pages] the entries being released (any subset
        of a row's columns: a whole row when a sequence is freed, its
        first columns when a sliding window drops them).
      released: bool[num_pages] pages whose reference count reached zero;
        each must appear among the ``held`` entries.

    Returns:
      ``(queue, num_free)`` with the released pages appended: rows in
      ascending order, each row's held entries from the last column back,
      a page held by several rows at its last place.
    """
    cap, num_pages = queue.shape[0], released.shape[0]
    # Columns reversed, rows kept: the flat order is rows ascending, each tail first.
    pages = jnp.where(held[:, ::-1], tables[:, ::-1], num_pages).ravel()  # num_pages: no page
    pos = jnp.arange(pages.shape[0], dtype=jnp.int32)
    safe = jnp.minimum(pages, num_pages - 1)
    last = jnp.full((num_pages,), -1, jnp.int32).at[pages].max(pos, mode="drop")
    first_free = (pages < num_pages) & released[safe] & (last[safe] == pos)
    rank = jnp.cumsum(first_free) - 1
    tail = (head + num_free + rank) % cap
    queue = queue.at[jnp.where(first_free, tail, cap)].set(pages, mode="drop")
    return queue, num_free + released.sum(dtype=jnp.int32)
