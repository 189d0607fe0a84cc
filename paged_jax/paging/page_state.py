"""Functional page state: block tables, reference counts and a free-page queue.

Every operation is a pure function ``state -> state`` that jits with static
shapes (PagedAttention, Kwon et al., SOSP 2023, section 4.2 "KV cache
manager"). The state lives on device as a pytree of arrays; the host never
mutates it in place.

Vocabulary (vLLM's): a *page* (block) holds ``page_size`` token slots of K and
V for every layer and KV head; a sequence's *block table* lists its pages in
logical order; ``ref_counts[p]`` counts the sequences whose block tables hold
page ``p`` (more than one after ``fork``: copy-on-write).

The null page. Page id ``NULL_PAGE = 0`` is reserved: it is never handed out,
never freed and never counted. Every unused block-table entry points at it, so
a kernel that reads a padded entry reads a real (garbage) page instead of
going out of bounds; attention masks such positions by length, so the null
page's content never reaches an output. A pool of ``num_pages`` pages
therefore has ``num_pages - 1`` usable pages.

The free queue. Free pages sit in a FIFO ring buffer
(:mod:`paged_jax.paging.free_queue`): allocation takes pages from the head,
freeing appends them at the tail, least recently freed first, in
:func:`paged_jax.paging.free_queue.free_order` (slots ascending, each slot's pages
tail first). The order is exact and testable.

Null entries. A block-table entry below ``num_seq_pages`` may be
``NULL_PAGE``: a page a sliding window no longer sees, dropped while the
sequence runs (:mod:`paged_jax.paging.sliding_window`). Every operation here
skips null entries, so such a table forks, frees, grows and shares like any
other.

Running out of pages is not an error: ``allocate`` and ``append`` return
``ok = False`` together with the *unchanged* state, and the caller (the
engine) decides whom to preempt.

Two tiers. :func:`allocate`, :func:`append`, :func:`free` and :func:`fork`
check their arguments at the door (shapes and dtypes always; values and
slot occupancy when called eagerly, reading the state back to the host) and
raise ``ValueError`` naming what is wrong, with the state untouched. Their
``unchecked_*`` twins are the bare jitted functions, for callers that
guarantee the arguments themselves (inside ``jit``, simulators).

Capacity versus length. A sequence holds ``num_seq_pages[s]`` pages
(capacity ``num_seq_pages[s] * page_size`` slots) and ``seq_lens[s]`` tokens.
Normally capacity is the smallest multiple of ``page_size`` above the length;
``allocate(..., reserve_tokens=n)`` can hold more, which is how the engine
models pre-paging servers that reserve a request's maximum length up front.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_jax.checks import check_array, check_int
from paged_jax.paging import free_queue

NULL_PAGE = 0
"""Reserved page id: padding in block tables; never allocated, never freed."""

NO_PAGE = -1
"""Marks "no copy" in the copy-on-write pairs returned by :func:`append`."""


@struct.dataclass
class PageState:
    """Device-side page bookkeeping for up to ``max_seqs`` sequences.

    Attributes:
      block_tables: i32[max_seqs, max_pages_per_seq] page ids in logical
        order; unused entries hold ``NULL_PAGE``.
      seq_lens: i32[max_seqs] tokens stored per sequence slot (0 = empty).
      num_seq_pages: i32[max_seqs] pages held per sequence slot.
      ref_counts: i32[num_pages] sequences holding each page; ``NULL_PAGE``
        stays 0.
      free_queue: i32[num_pages - 1] ring buffer of free page ids.
      free_head: i32[] index in ``free_queue`` of the next page handed out.
      num_free_pages: i32[] free pages (excludes the null page).
      page_size: tokens per page (static).
    """

    block_tables: jax.Array  # i32[max_seqs, max_pages_per_seq]
    seq_lens: jax.Array  # i32[max_seqs]
    num_seq_pages: jax.Array  # i32[max_seqs]
    ref_counts: jax.Array  # i32[num_pages]
    free_queue: jax.Array  # i32[num_pages - 1]
    free_head: jax.Array  # i32[]
    num_free_pages: jax.Array  # i32[]
    page_size: int = struct.field(pytree_node=False)

    @property
    def num_pages(self) -> int:
        """Pages in the pool, the null page included."""
        return self.ref_counts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Most tokens one sequence can hold: max_pages_per_seq * page_size."""
        return self.max_pages_per_seq * self.page_size


def init_page_state(
    *, num_pages: int, max_seqs: int, max_pages_per_seq: int, page_size: int
) -> PageState:
    """An empty page state: every usable page free, every sequence slot empty.

    Args:
      num_pages: pages in the pool, the null page included (>= 2).
      max_seqs: sequence slots (rows of the block table), >= 1.
      max_pages_per_seq: block-table columns, >= 1.
      page_size: tokens per page, >= 1.

    Raises:
      ValueError: any argument out of range; the message names it.
    """
    for name, value, low in (
        ("num_pages", num_pages, 2),
        ("max_seqs", max_seqs, 1),
        ("max_pages_per_seq", max_pages_per_seq, 1),
        ("page_size", page_size, 1),
    ):
        check_int(name, value, low)
    return PageState(
        block_tables=jnp.full((max_seqs, max_pages_per_seq), NULL_PAGE, jnp.int32),
        seq_lens=jnp.zeros((max_seqs,), jnp.int32),
        num_seq_pages=jnp.zeros((max_seqs,), jnp.int32),
        ref_counts=jnp.zeros((num_pages,), jnp.int32),
        free_queue=jnp.arange(1, num_pages, dtype=jnp.int32),
        free_head=jnp.zeros((), jnp.int32),
        num_free_pages=jnp.asarray(num_pages - 1, jnp.int32),
        page_size=page_size,
    )


def pages_for_tokens(num_tokens, page_size: int):
    """ceil(num_tokens / page_size): pages needed to hold ``num_tokens``."""
    return (num_tokens + page_size - 1) // page_size


def _select(ok, new: PageState, old: PageState) -> PageState:
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _take_pages(state: PageState, need: jax.Array) -> tuple[PageState, jax.Array]:
    """Hands ``need[s]`` new pages to each sequence slot ``s``, appended to its
    block table after the pages it holds. Returns the new state (unchanged
    when the pool is short) and ``ok``."""
    max_pages = state.max_pages_per_seq
    pages, valid, ok, head, num_free = free_queue.pop(state.free_queue, state.free_head, state.num_free_pages, need,
                                                      max_pages)
    j = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    col = jnp.where(valid, state.num_seq_pages[:, None] + j, max_pages)
    rows = jnp.broadcast_to(jnp.arange(state.max_seqs)[:, None], col.shape)
    new = state.replace(
        block_tables=state.block_tables.at[rows, col].set(pages, mode="drop"),
        num_seq_pages=state.num_seq_pages + need,
        ref_counts=state.ref_counts.at[jnp.where(valid, pages, state.num_pages)].add(
            1, mode="drop"
        ),
        free_head=head,
        num_free_pages=num_free,
    )
    return _select(ok, new, state), ok


@jax.jit
def unchecked_allocate(
    state: PageState, seq_id: jax.Array, num_tokens: jax.Array, reserve_tokens: jax.Array = 0
) -> tuple[PageState, jax.Array]:
    """:func:`allocate` without the door checks (jitted)."""
    want = jnp.maximum(num_tokens, reserve_tokens)
    need = jnp.zeros((state.max_seqs,), jnp.int32).at[seq_id].set(
        pages_for_tokens(want, state.page_size).astype(jnp.int32)
    )
    state, ok = _take_pages(state, need)
    seq_lens = jnp.where(ok, state.seq_lens.at[seq_id].set(num_tokens), state.seq_lens)
    return state.replace(seq_lens=seq_lens), ok


def is_traced(*args) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def _index(name: str, value, high: int) -> int:
    """An integer in [0, high) from a Python/NumPy int or a 0-d integer array."""
    if isinstance(value, bool) or not (
        isinstance(value, (int, np.integer))
        or (hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0 and jnp.issubdtype(value.dtype, jnp.integer))
    ):
        raise ValueError(f"{name} must be an integer, got {name}={value!r}")
    value = int(value)
    if not 0 <= value < high:
        raise ValueError(f"{name} must be in [0, {high}), got {name}={value}")
    return value


def _mask(name: str, mask, state: PageState) -> np.ndarray:
    shape = getattr(mask, "shape", None)
    dtype = getattr(mask, "dtype", None)
    if shape != (state.max_seqs,) or dtype is None or dtype != jnp.bool_:
        raise ValueError(
            f"{name} must be bool[max_seqs={state.max_seqs}], got shape {shape} dtype {dtype}"
        )
    return mask


def check_allocate(state: PageState, seq_id, num_tokens, reserve_tokens=0) -> None:
    """Eager validation for :func:`allocate` (reads the state back to host).

    Raises:
      ValueError: ``seq_id`` not an integer in ``[0, max_seqs)`` or not
        empty; ``num_tokens`` or ``reserve_tokens`` not an integer in
        ``[0, max_seq_len]``.
    """
    seq_id = _index("seq_id", seq_id, state.max_seqs)
    _index("num_tokens", num_tokens, state.max_seq_len + 1)
    _index("reserve_tokens", reserve_tokens, state.max_seq_len + 1)
    if int(state.num_seq_pages[seq_id]) or int(state.seq_lens[seq_id]):
        raise ValueError(f"seq_id={seq_id} already holds a sequence; free it first")


def allocate(state: PageState, seq_id, num_tokens, reserve_tokens=0) -> tuple[PageState, jax.Array]:
    """Gives an empty sequence slot the pages for a prompt of ``num_tokens``.

    The slot then holds ``num_tokens`` tokens (their K/V still to be written
    through :func:`paged_jax.paging.slots.slot_mapping`) in ``ceil(max(num_tokens, reserve_tokens) /
    page_size)`` pages.

    Args:
      state: the page state.
      seq_id: i32[] an empty sequence slot.
      num_tokens: i32[] prompt tokens, ``0 <= num_tokens <= max_seq_len``.
      reserve_tokens: i32[] slots to hold beyond need (contiguous-style
        reservation); 0 for paging.

    Returns:
      ``(state, ok)``; ``ok`` is False when the pool has too few free pages,
      and the state is then returned unchanged.

    Raises:
      ValueError: (eager calls) see :func:`check_allocate`. Under ``jit`` the
        arguments are traced and only the caller can guarantee them.
    """
    if not is_traced(state, seq_id, num_tokens, reserve_tokens):
        check_allocate(state, seq_id, num_tokens, reserve_tokens)
    return unchecked_allocate(state, seq_id, num_tokens, reserve_tokens)


def append(state: PageState, active) -> tuple[PageState, jax.Array, jax.Array, jax.Array]:
    """Adds one token slot to every active sequence (one decode step); see
    :func:`unchecked_append` for copy-on-write and the returned pairs.

    Args:
      state: the page state.
      active: bool[max_seqs] sequences that grow by one token.

    Returns:
      ``(state, ok, cow_src, cow_dst)``: ``ok`` is False when the pool has too
      few free pages (state unchanged); ``cow_src, cow_dst``: i32[max_seqs]
      page copies to make before writing, ``NO_PAGE`` where none.

    Raises:
      ValueError: ``active`` not bool[max_seqs]; (eager calls) an active
        sequence already at ``max_seq_len`` tokens.
    """
    _mask("active", active, state)
    if not is_traced(state, active):
        full = np.flatnonzero(np.asarray(active) & (np.asarray(state.seq_lens) >= state.max_seq_len))
        if full.size:
            raise ValueError(
                f"sequences {full.tolist()} already hold max_seq_len={state.max_seq_len} tokens and cannot grow"
            )
    return unchecked_append(state, active)


def extend(state: PageState, num_new, min_pages=0) -> tuple[PageState, jax.Array, jax.Array, jax.Array]:
    """Grows every sequence by ``num_new[s]`` tokens (a prefill chunk, a
    decode token, a prompt in an empty slot); see :func:`unchecked_extend`
    for copy-on-write, the page order and the returned pairs.

    Args:
      state: the page state.
      num_new: i32[max_seqs] tokens to add per sequence, >= 0.
      min_pages: i32[max_seqs] or a scalar, pages each extended sequence
        must hold at least (a reservation).

    Returns:
      ``(state, ok, cow_src, cow_dst)``; ``ok`` is False (state unchanged)
      when the pool is short.

    Raises:
      ValueError: ``num_new`` not an integer array of shape (max_seqs,), or
        ``min_pages`` not an integer (array); (eager calls) a negative
        entry, a sequence that would pass ``max_seq_len`` tokens, or
        ``min_pages`` outside ``[0, max_pages_per_seq]``.
    """
    shape, dtype = getattr(num_new, "shape", None), getattr(num_new, "dtype", None)
    if shape != (state.max_seqs,) or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"num_new must be int[max_seqs={state.max_seqs}], got shape {shape} dtype {dtype}")
    if isinstance(min_pages, bool) or not (
        isinstance(min_pages, (int, np.integer))
        or (hasattr(min_pages, "dtype") and jnp.issubdtype(min_pages.dtype, jnp.integer)
            and getattr(min_pages, "shape", None) in ((), (state.max_seqs,)))
    ):
        raise ValueError(
            f"min_pages must be an int or int[max_seqs={state.max_seqs}], got {min_pages!r:.80}"
        )
    if not is_traced(state, num_new, min_pages):
        m = np.asarray(min_pages)
        if (m < 0).any() or (m > state.max_pages_per_seq).any():
            raise ValueError(
                f"min_pages must be in [0, max_pages_per_seq={state.max_pages_per_seq}], got {m.tolist()}"
            )
        n = np.asarray(num_new)
        if (n < 0).any():
            raise ValueError(f"num_new must be >= 0, got {n.tolist()}")
        over = np.flatnonzero(np.asarray(state.seq_lens) + n > state.max_seq_len)
        if over.size:
            raise ValueError(
                f"sequences {over.tolist()} would pass max_seq_len={state.max_seq_len} tokens "
                f"(lengths {np.asarray(state.seq_lens)[over].tolist()} + num_new {n[over].tolist()})"
            )
    return unchecked_extend(state, jnp.asarray(num_new, jnp.int32), jnp.asarray(min_pages, jnp.int32))


def free(state: PageState, seq_mask) -> PageState:
    """Frees every sequence in ``seq_mask`` (bool[max_seqs]); see
    :func:`unchecked_free`. Freeing an empty slot is a no-op.

    Raises:
      ValueError: ``seq_mask`` not bool[max_seqs].
    """
    _mask("seq_mask", seq_mask, state)
    return unchecked_free(state, seq_mask)


def fork(state: PageState, src, dst) -> PageState:
    """Makes empty slot ``dst`` share ``src``'s tokens (copy-on-write); see
    :func:`unchecked_fork`.

    Raises:
      ValueError: (eager calls) ``src`` or ``dst`` not an integer in
        ``[0, max_seqs)``, ``src == dst``, or ``dst`` not empty.
    """
    if not is_traced(state, src, dst):
        src = _index("src", src, state.max_seqs)
        dst = _index("dst", dst, state.max_seqs)
        if src == dst:
            raise ValueError(f"src and dst must differ, got src=dst={src}")
        if int(state.num_seq_pages[dst]) or int(state.seq_lens[dst]):
            raise ValueError(f"dst={dst} already holds a sequence; free it first")
    return unchecked_fork(state, src, dst)


@jax.jit
def unchecked_append(state: PageState, active: jax.Array) -> tuple[PageState, jax.Array, jax.Array, jax.Array]:
    """Adds one token slot to every active sequence (one decode step):
    :func:`unchecked_extend` with ``num_new = active``.

    Args:
      state: the page state.
      active: bool[max_seqs] sequences that grow by one token.

    Returns:
      ``(state, ok, cow_src, cow_dst)`` as :func:`unchecked_extend`.
    """
    return unchecked_extend(state, active.astype(jnp.int32))


@jax.jit
def unchecked_extend(
    state: PageState, num_new: jax.Array, min_pages: jax.Array | int = 0
) -> tuple[PageState, jax.Array, jax.Array, jax.Array]:
    """Grows every sequence ``s`` by ``num_new[s]`` token slots: a decode
    step (1), a prefill chunk (any number), or a new prompt in an empty slot.

    A sequence takes new pages only for the slots its pages cannot hold
    (and, with ``min_pages``, up to that many pages: the contiguous
    baseline's reservation). If the page its first new token lands in is
    shared (``ref_counts > 1`` after :func:`fork`), the sequence gets a
    private copy of it (copy-on-write): the shared page keeps its other
    owners, this sequence's block table points at a fresh page, and the
    caller must copy the KV content ``src -> dst`` before writing. Later
    pages of the chunk are new, so at most one page per sequence is copied.
    Pages leave the free queue in slot order, the copy first, then growth.

    Args:
      state: the page state.
      num_new: i32[max_seqs] token slots to add per sequence (0: untouched).
      min_pages: i32[max_seqs] (or a scalar) pages each extended sequence
        must hold afterwards at least.

    Returns:
      ``(state, ok, cow_src, cow_dst)``: ``ok`` is False when the pool has too
      few free pages for all of it at once, or (arguments only :func:`extend`
      checks) a sequence would pass ``max_seq_len`` tokens or
      ``max_pages_per_seq`` pages, or ``num_new`` is negative; the state is
      then unchanged. ``cow_src, cow_dst``: i32[max_seqs] page copies to
      make, ``NO_PAGE`` where none.
    """
    page_size, max_pages = state.page_size, state.max_pages_per_seq
    rows = jnp.arange(state.max_seqs)
    num_new = num_new.astype(jnp.int32)
    active = num_new > 0
    idx = state.seq_lens // page_size  # page index the first new token lands in
    has_page = idx < state.num_seq_pages
    cur = state.block_tables[rows, jnp.minimum(idx, max_pages - 1)]
    shared = active & has_page & (state.ref_counts[cur] > 1)
    # Sharers of one page that all extend in this step: each earlier one
    # takes a private copy, the last keeps the original (else it would leak).
    earlier = (cur[None, :] == cur[:, None]) & shared[None, :] & (rows[None, :] < rows[:, None])
    cow = shared & (state.ref_counts[cur] - earlier.sum(axis=1) > 1)
    want = jnp.maximum(pages_for_tokens(state.seq_lens + num_new, page_size), min_pages)
    grow = jnp.where(active, jnp.maximum(want - state.num_seq_pages, 0), 0).astype(jnp.int32)
    need = grow + cow.astype(jnp.int32)
    pages, valid, ok, head, num_free = free_queue.pop(state.free_queue, state.free_head, state.num_free_pages, need,
                                                      max_pages + 1)
    ok &= ~jnp.any(active & (state.seq_lens + num_new > state.max_seq_len))
    ok &= ~jnp.any(num_new < 0)  # under jit nothing else catches it
    ok &= ~jnp.any(state.num_seq_pages + grow > max_pages)
    # Column of each popped page: a copy replaces column ``idx``; growth
    # appends after the pages held.
    j = jnp.arange(max_pages + 1, dtype=jnp.int32)[None, :]
    c = cow.astype(jnp.int32)[:, None]
    col = jnp.where(j < c, idx[:, None], state.num_seq_pages[:, None] + j - c)
    col = jnp.where(valid, col, max_pages)  # out of range: dropped
    ref_counts = state.ref_counts.at[jnp.where(valid, pages, state.num_pages)].add(1, mode="drop")
    ref_counts = ref_counts.at[jnp.where(cow, cur, state.num_pages)].add(-1, mode="drop")
    new = state.replace(
        block_tables=state.block_tables.at[rows[:, None], col].set(pages, mode="drop"),
        seq_lens=state.seq_lens + num_new,
        num_seq_pages=state.num_seq_pages + grow,
        ref_counts=ref_counts,
        free_head=head,
        num_free_pages=num_free,
    )
    new = _select(ok, new, state)
    cow_ok = cow & ok
    cow_src = jnp.where(cow_ok, cur, NO_PAGE)
    cow_dst = jnp.where(cow_ok, pages[:, 0], NO_PAGE)
    return new, ok, cow_src, cow_dst


def release_entries(state: PageState, held: jax.Array) -> PageState:
    """Drops one reference from each block-table entry in ``held``
    (bool[max_seqs, max_pages]; null entries are skipped) and queues the
    pages that reach zero (:func:`paged_jax.paging.free_queue.push_released`).
    Tables, lengths and page counts are left to the caller."""
    held = held & (state.block_tables != NULL_PAGE)
    pages = jnp.where(held, state.block_tables, state.num_pages)
    ref_counts = state.ref_counts.at[pages].add(-1, mode="drop")
    released = (state.ref_counts > 0) & (ref_counts == 0)
    queue, num_free = free_queue.push_released(state.free_queue, state.free_head, state.num_free_pages,
                                               state.block_tables, held, released)
    return state.replace(ref_counts=ref_counts, free_queue=queue, num_free_pages=num_free)


@jax.jit
def unchecked_free(state: PageState, seq_mask: jax.Array) -> PageState:
    """Frees every sequence in ``seq_mask`` (bool[max_seqs]).

    Each of their pages loses one reference; a page whose count reaches zero
    goes back to the free queue at once, in
    :func:`paged_jax.paging.free_queue.free_order` (each slot's pages tail first).
    The slots become empty: length 0, no pages, block-table rows all
    ``NULL_PAGE``. Freeing an empty slot is a no-op.
    """
    j = jnp.arange(state.max_pages_per_seq)[None, :]
    released = release_entries(state, seq_mask[:, None] & (j < state.num_seq_pages[:, None]))
    return released.replace(
        block_tables=jnp.where(seq_mask[:, None], NULL_PAGE, state.block_tables),
        seq_lens=jnp.where(seq_mask, 0, state.seq_lens),
        num_seq_pages=jnp.where(seq_mask, 0, state.num_seq_pages),
    )



@jax.jit
def unchecked_truncate(state: PageState, new_lens: jax.Array, min_pages: jax.Array | int = 0
                       ) -> tuple[PageState, jax.Array]:
    """Rewinds sequences to ``new_lens[s]`` tokens: the rollback of tokens a
    step wrote and the caller rejected (speculative decoding's proposals
    that verification refused; vLLM's ``num_computed_tokens`` rewind).

    Each sequence keeps ``max(ceil(new_lens[s] / page_size), min_pages[s])``
    pages (no more than it holds); the pages past them lose one reference
    and go back to the free queue at once when no other sequence holds
    them, tail first (:func:`paged_jax.paging.free_queue.free_order`), their
    block-table entries back to ``NULL_PAGE``. A page shared by a fork
    keeps its other holders; the K/V of the rejected tokens in a kept page
    stays where it is, past the length, unread (attention masks by
    length) and overwritten by the next tokens.

    Args:
      state: the page state.
      new_lens: i32[max_seqs] tokens each sequence holds afterwards, at
        most its length now (equal: untouched).
      min_pages: i32[max_seqs] (or a scalar) pages a sequence keeps at
        least: a pre-paging baseline's reservation, not given back by a
        rollback.

    Returns:
      ``(state, ok)``; ``ok`` is False, and the state unchanged, when a
      ``new_lens`` entry is negative or above its sequence's length.
    """
    ok = ~jnp.any((new_lens < 0) | (new_lens > state.seq_lens))
    keep = jnp.minimum(jnp.maximum(pages_for_tokens(new_lens, state.page_size), min_pages), state.num_seq_pages)
    j = jnp.arange(state.max_pages_per_seq)[None, :]
    drop = (j >= keep[:, None]) & (j < state.num_seq_pages[:, None])
    new = release_entries(state, drop).replace(
        block_tables=jnp.where(drop, NULL_PAGE, state.block_tables),
        seq_lens=new_lens.astype(jnp.int32),
        num_seq_pages=keep.astype(jnp.int32),
    )
    return _select(ok, new, state), ok


def truncate(state: PageState, new_lens, min_pages=0) -> tuple[PageState, jax.Array]:
    """Rewinds sequences to ``new_lens`` tokens, giving back the pages past
    them; see :func:`unchecked_truncate`.

    Args:
      new_lens: int[max_seqs] tokens per sequence afterwards.
      min_pages: int[max_seqs] or an int, pages kept at least.

    Returns:
      ``(state, ok)`` as :func:`unchecked_truncate`.

    Raises:
      ValueError: ``new_lens`` not an integer array of shape
        ``[max_seqs]``; (eager calls) an entry negative or above its
        sequence's length, or ``min_pages`` not an int (or ints of shape
        ``[max_seqs]``) in ``[0, max_pages_per_seq]``. The state is then
        untouched.
    """
    S = state.max_seqs
    check_array("new_lens", new_lens, (S,))
    if not is_traced(state, new_lens, min_pages):
        n, lens = np.asarray(new_lens), np.asarray(state.seq_lens)
        bad = np.flatnonzero((n < 0) | (n > lens))
        if bad.size:
            raise ValueError(f"new_lens must be in [0, seq_lens] (a rollback never grows a sequence), got "
                             f"{n[bad].tolist()} at slots {bad.tolist()} whose lengths are {lens[bad].tolist()}")
        m = np.asarray(min_pages)
        if (m.shape not in ((), (S,)) or not np.issubdtype(m.dtype, np.integer) or m.dtype == np.bool_
                or (m < 0).any() or (m > state.max_pages_per_seq).any()):
            raise ValueError(f"min_pages must be an int or an integer array of shape ({S},) in [0, "
                             f"max_pages_per_seq={state.max_pages_per_seq}], got {m.dtype}{list(m.shape)} "
                             f"{m.tolist() if m.size <= 16 else ''}".rstrip())
    return unchecked_truncate(state, jnp.asarray(new_lens, jnp.int32), jnp.asarray(min_pages, jnp.int32))

@jax.jit
def unchecked_fork(state: PageState, src: jax.Array, dst: jax.Array) -> PageState:
    """Makes empty slot ``dst`` share ``src``'s tokens: :func:`unchecked_fork_many`
    with one pair (state unchanged if it is refused)."""
    src_of = jnp.full((state.max_seqs,), -1, jnp.int32).at[dst].set(src)
    return unchecked_fork_many(state, src_of)[0]


@jax.jit
def unchecked_fork_many(state: PageState, src_of: jax.Array) -> tuple[PageState, jax.Array]:
    """Forks sequences: every slot ``d`` with ``src_of[d] >= 0`` becomes a
    copy of slot ``src_of[d]`` that shares its pages (parallel sampling,
    beam search; paper section 4.4).

    The pages holding the source's tokens gain one reference per copy;
    reserved pages beyond its length are not shared. A later write into a
    shared page copies it first (:func:`unchecked_extend`).

    Args:
      state: the page state.
      src_of: i32[max_seqs] source slot per destination slot, -1 for none.

    Returns:
      ``(state, ok)``; ``ok`` is False, and the state unchanged, when a
      destination is not empty, is its own source, or is itself a source in
      this call, or a source is out of range.
    """
    rows = jnp.arange(state.max_seqs, dtype=jnp.int32)
    is_dst = src_of >= 0
    src = jnp.clip(src_of, 0, state.max_seqs - 1)
    n = jnp.where(is_dst, pages_for_tokens(state.seq_lens[src], state.page_size), 0)
    shared = jnp.arange(state.max_pages_per_seq)[None, :] < n[:, None]  # [S, max_pages]
    table = jnp.where(shared, state.block_tables[src], NULL_PAGE)
    occupied = (state.num_seq_pages > 0) | (state.seq_lens > 0)
    src_is_dst = jnp.zeros((state.max_seqs,), bool).at[jnp.where(is_dst, src, state.max_seqs)].set(True, mode="drop") & is_dst
    ok = ~jnp.any(is_dst & (occupied | (src_of == rows) | (src_of >= state.max_seqs))) & ~jnp.any(src_is_dst)
    new = state.replace(
        block_tables=jnp.where(is_dst[:, None], table, state.block_tables),
        seq_lens=jnp.where(is_dst, state.seq_lens[src], state.seq_lens),
        num_seq_pages=jnp.where(is_dst, n, state.num_seq_pages),
        ref_counts=state.ref_counts.at[jnp.where(shared & (table != NULL_PAGE), table, state.num_pages)].add(
            1, mode="drop"),
    )
    return _select(ok, new, state), ok


@jax.jit
def unchecked_share(
    state: PageState, num_hit: jax.Array, hit_pages: jax.Array, num_tokens: jax.Array | None = None
) -> tuple[PageState, jax.Array]:
    """Gives empty slots pages that already hold their tokens' K/V: a
    prefix-cache hit (:mod:`paged_jax.paging.prefix_cache` finds the pages) or a
    swap-in (:mod:`paged_jax.paging.swap` has written them).

    Slot ``s`` takes pages ``hit_pages[s, :num_hit[s]]`` as its first
    ``num_hit[s]`` pages and then holds ``num_tokens[s]`` tokens (default
    ``num_hit[s] * page_size``: full pages). Each page gains a reference. A page
    with no reference before (a cached page sitting in the free queue)
    leaves the free queue; the others keep their order (so the queue stays
    least recently freed first).

    Args:
      state: the page state.
      num_hit: i32[max_seqs] pages to take per slot, 0 for none.
      hit_pages: i32[max_seqs, max_pages_per_seq] their ids, in logical
        order; entries past ``num_hit[s]`` are ignored; ``NULL_PAGE``
        entries in a leading run before a slot's last page stand for pages
        a sliding window dropped (:mod:`paged_jax.paging.sliding_window`) and take
        no reference.
      num_tokens: i32[max_seqs] tokens each slot holds afterwards, which
        the ``num_hit[s]`` pages must fit exactly (``ceil(num_tokens /
        page_size) == num_hit``); None for full pages.

    Returns:
      ``(state, ok)``; ``ok`` is False, and the state unchanged, when a slot
      with a hit is not empty, ``num_hit`` is outside ``[0,
      max_pages_per_seq]``, ``num_tokens`` does not fit the pages, a
      slot's null pages are not a leading run before a real one, or a page
      id is outside the pool.
    """
    num_pages, max_pages, cap = state.num_pages, state.max_pages_per_seq, state.free_queue.shape[0]
    active = num_hit > 0
    take = jnp.arange(max_pages)[None, :] < num_hit[:, None]  # [S, max_pages]
    occupied = (state.num_seq_pages > 0) | (state.seq_lens > 0)
    ok = ~jnp.any(active & occupied) & ~jnp.any((num_hit < 0) | (num_hit > max_pages))
    ok &= ~jnp.any(take & ((hit_pages < NULL_PAGE) | (hit_pages >= num_pages)))
    last = jnp.take_along_axis(hit_pages, jnp.clip(num_hit - 1, 0, max_pages - 1)[:, None], axis=1)[:, 0]
    ok &= ~jnp.any(active & (last == NULL_PAGE))  # null entries only where a window dropped pages:
    after_live = jnp.cumsum(take & (hit_pages != NULL_PAGE), axis=1) > 0  # a leading run, never a hole
    ok &= ~jnp.any(take & after_live & (hit_pages == NULL_PAGE))
    lens = num_hit * state.page_size if num_tokens is None else num_tokens
    ok &= ~jnp.any(active & (pages_for_tokens(lens, state.page_size) != num_hit))
    table = jnp.where(take, hit_pages, NULL_PAGE)
    ref_counts = state.ref_counts.at[jnp.where(take & (table != NULL_PAGE), table, num_pages)].add(1, mode="drop")
    taken = (state.ref_counts == 0) & (ref_counts > 0)  # bool[num_pages] leaving the free queue
    # Compact the ring without them, head first, into a queue that starts at 0.
    queue = state.free_queue[(state.free_head + jnp.arange(cap)) % cap]
    keep = (jnp.arange(cap) < state.num_free_pages) & ~taken[queue]
    dest = jnp.where(keep, jnp.cumsum(keep) - 1, cap)
    new = state.replace(
        block_tables=jnp.where(active[:, None], table, state.block_tables),
        seq_lens=jnp.where(active, lens, state.seq_lens),
        num_seq_pages=jnp.where(active, num_hit, state.num_seq_pages),
        ref_counts=ref_counts,
        free_queue=jnp.zeros_like(queue).at[dest].set(queue, mode="drop"),
        free_head=jnp.zeros((), jnp.int32),
        num_free_pages=state.num_free_pages - taken.sum(dtype=jnp.int32),
    )
    return _select(ok, new, state), ok


def share(state: PageState, num_hit, hit_pages) -> tuple[PageState, jax.Array]:
    """Gives empty slots pages that already hold their first tokens (a
    prefix-cache hit); see :func:`unchecked_share`.

    Args:
      num_hit: int[max_seqs] pages per slot.
      hit_pages: int[max_seqs, max_pages_per_seq] page ids.

    Returns:
      ``(state, ok)`` as :func:`unchecked_share`.

    Raises:
      ValueError: wrong shapes or dtypes; (eager calls) a slot with a hit
        that is not empty, ``num_hit`` outside ``[0, max_pages_per_seq]``,
        a page listed twice for one slot, a slot whose null pages are not
        a leading run before a real one, or a page id outside the pool. The state is then
        untouched.
    """
    S, P = state.max_seqs, state.max_pages_per_seq
    check_array("num_hit", num_hit, (S,))
    check_array("hit_pages", hit_pages, (S, P))
    if not is_traced(state, num_hit, hit_pages):
        n, pages = np.asarray(num_hit), np.asarray(hit_pages)
        bad = np.flatnonzero((n < 0) | (n > P))
        if bad.size:
            raise ValueError(f"num_hit must be in [0, max_pages_per_seq={P}], got {n[bad].tolist()} at slots {bad.tolist()}")
        busy = np.flatnonzero((n > 0) & ((np.asarray(state.num_seq_pages) > 0) | (np.asarray(state.seq_lens) > 0)))
        if busy.size:
            raise ValueError(f"slots {busy.tolist()} already hold a sequence; a hit needs an empty slot")
        for slot in np.flatnonzero(n > 0):
            row = [p for p in pages[slot, : n[slot]].tolist() if p != NULL_PAGE]
            if len(set(row)) < len(row):
                raise ValueError(f"hit_pages[{slot}] lists a page twice ({row}): each logical page needs its own page")
            full = pages[slot, : n[slot]].tolist()
            live = [j for j, p in enumerate(full) if p != NULL_PAGE]
            if full[-1] == NULL_PAGE or live != list(range(live[0] if live else 0, len(full))):
                raise ValueError(f"hit_pages[{slot}] = {full} has the null page after a page or last; only a "
                                 f"leading run of pages a sliding window dropped may be null")
        taken = pages[np.arange(P)[None, :] < n[:, None]]
        bad_pages = taken[(taken < NULL_PAGE) | (taken >= state.num_pages)]
        if bad_pages.size:
            raise ValueError(f"hit_pages must be in [0, num_pages={state.num_pages}), got {bad_pages.tolist()}")
    return unchecked_share(state, jnp.asarray(num_hit, jnp.int32), jnp.asarray(hit_pages, jnp.int32))
