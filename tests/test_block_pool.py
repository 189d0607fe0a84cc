"""BlockPool, the host's twin of the device page state: exact page ids.

In vLLM's style (tests/v1/core/test_prefix_caching.py), every test names
the page ids it expects and the free queue's order, so a change to who gets
which page shows here first. Pools are small: ``new_pool()`` has pages 1 to
7 (page 0 is the null page), 4 slots of at most 4 pages of 4 tokens.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.paging.block_pool import BlockPool
from paged_jax.paging.page_state import (
    NO_PAGE,
    NULL_PAGE,
    init_page_state,
    unchecked_extend,
    unchecked_fork_many,
    unchecked_free,
    unchecked_share,
    unchecked_truncate,
)

MAX_SEQS, MAX_PAGES, PAGE = 4, 4, 4


def new_pool(num_pages=8, on_evict=None):
    return BlockPool(num_pages=num_pages, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES, page_size=PAGE,
                     on_evict=on_evict)


def grow(pool, tokens, min_pages=0):
    """``pool.extend`` with ``tokens`` = {slot: new tokens}; returns its copies."""
    num_new = np.zeros(MAX_SEQS, np.int64)
    for slot, n in tokens.items():
        num_new[slot] = n
    return pool.extend(num_new, min_pages)


def snapshot(pool):
    return (pool.block_tables.tolist(), pool.seq_lens.tolist(), pool.num_seq_pages.tolist(),
            pool.ref_counts.tolist(), pool.free_pages())


def test_a_fresh_pool_hands_out_pages_1_2_3_and_never_the_null_page():
    pool = new_pool()
    assert pool.free_pages() == [1, 2, 3, 4, 5, 6, 7]  # page 0 is the null page
    assert pool.num_free == 7
    assert grow(pool, {0: 6}) == []
    assert pool.pages(0) == [1, 2]
    assert pool.block_tables[0].tolist() == [1, 2, NULL_PAGE, NULL_PAGE]
    assert grow(pool, {0: 14}) is None  # 20 tokens: 5 pages > max_pages_per_seq=4
    assert grow(pool, {0: -1}) is None
    assert pool.pages(0) == [1, 2] and pool.free_pages() == [3, 4, 5, 6, 7]
    assert grow(pool, {2: 1, 1: 4}) == []  # slots take pages in ascending slot order
    assert [pool.pages(s) for s in range(MAX_SEQS)] == [[1, 2], [3], [4], []]
    assert pool.seq_lens.tolist() == [6, 4, 1, 0]
    assert pool.ref_counts.tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert pool.free_pages() == [5, 6, 7]
    assert grow(pool, {2: 11}) == []  # 1 + 11 = 12 tokens: page 4 filled, then two new ones
    assert pool.pages(2) == [4, 5, 6]
    assert pool.free_pages() == [7]
    before = snapshot(pool)
    assert grow(pool, {3: 5}) is None  # two pages wanted, one queued: refused, nothing changed
    assert snapshot(pool) == before
    assert grow(pool, {3: 4}) == []
    assert pool.pages(3) == [7]
    assert pool.free_pages() == [] and pool.num_free == 0
    assert pool.ref_counts[NULL_PAGE] == 0


def test_free_queue_order_after_release():
    """The one test that pins the order released pages join the free queue.

    The order is defined by ``BlockPool.flush`` and
    ``page_state.unchecked_free`` (whose order the twin copies): pages that
    reach zero references in one call are queued together at the tail;
    pages freed in an earlier call stay ahead of them; allocations take the
    queue's head, so never-used pages go first, then the least recently
    freed. If the order changes, change ``freed_together`` here.
    """
    # Slot 1 ([4, 5]) and then slot 0 ([1, 2, 3]) released before one flush:
    # queued slot by slot in ascending slot order, each slot's pages tail
    # first, so a cached chain loses its last page before its first.
    freed_together = [3, 2, 1, 5, 4]

    pool = new_pool(num_pages=10)  # pages 1..9
    grow(pool, {0: 12, 1: 8, 2: 4})
    assert [pool.pages(s) for s in range(3)] == [[1, 2, 3], [4, 5], [6]]
    assert pool.release(1) == 2 and pool.release(0) == 3
    assert pool.free_pages() == [7, 8, 9] + freed_together  # already listed in the order flush queues them
    pool.flush()
    assert pool.free_pages() == [7, 8, 9] + freed_together
    assert pool.release(2) == 1
    pool.flush()  # a later call: page 6 joins behind them
    assert pool.free_pages() == [7, 8, 9] + freed_together + [6]
    assert grow(pool, {3: 16}) == []  # 4 pages off the head
    assert pool.pages(3) == [7, 8, 9] + freed_together[:1]
    assert pool.free_pages() == freed_together[1:] + [6]


def test_released_pages_wait_for_flush_but_count_as_free():
    pool = new_pool()
    grow(pool, {0: 4, 1: 4})  # [1], [2]
    assert pool.release(0) == 1
    assert pool.ref_counts[1] == 0 and pool.num_free == 6 and pool.pages(0) == []
    assert pool.block_tables[0].tolist() == [NULL_PAGE] * MAX_PAGES and pool.seq_lens[0] == 0
    assert pool.free_pages() == [3, 4, 5, 6, 7, 1]
    assert grow(pool, {2: 4}) == []  # extend flushes first: page 1 queues behind 3..7
    assert pool.pages(2) == [3]
    assert pool.free_pages() == [4, 5, 6, 7, 1]


def test_a_prefix_hit_takes_a_cached_page_out_of_the_middle_of_the_queue():
    evicted = []
    pool = new_pool(on_evict=evicted.append)
    grow(pool, {0: 4, 1: 4})  # [1], [2]
    pool.release(0)
    pool.flush()
    pool.release(1)
    pool.flush()
    assert pool.free_pages() == [3, 4, 5, 6, 7, 1, 2]
    assert pool.share(2, [1]) == 1  # one page left the free queue
    assert pool.pages(2) == [1] and pool.seq_lens[2] == PAGE and pool.ref_counts[1] == 1
    assert pool.free_pages() == [3, 4, 5, 6, 7, 2]  # the others keep their order
    pool.release(2)  # released, not flushed yet: a hit takes it back all the same
    assert pool.share(3, [1]) == 1 and pool.free_pages() == [3, 4, 5, 6, 7, 2]
    assert evicted == [1, 2]  # the first allocations only: a hit is not an eviction


def test_on_evict_is_called_with_each_page_taken_for_new_content():
    evicted = []
    pool = new_pool(num_pages=4, on_evict=evicted.append)  # pages 1, 2, 3
    grow(pool, {0: 4, 1: 4})
    assert evicted == [1, 2]
    pool.release(0)
    pool.flush()
    pool.release(1)
    pool.flush()
    assert pool.free_pages() == [3, 1, 2]
    assert pool.share(2, [2]) == 1 and evicted == [1, 2]  # a hit keeps page 2's content
    assert grow(pool, {3: 8}) == []
    assert pool.pages(3) == [3, 1]
    assert evicted == [1, 2, 3, 1]  # page 1 is reused: the prefix cache must forget it
    assert pool.free_pages() == []


def test_shared_pages_keep_ref_counts_and_are_freed_with_their_last_holder():
    pool = new_pool()
    grow(pool, {0: 10})  # [1, 2, 3], 10 tokens
    assert pool.share(1, [1, 2]) == 0  # a hit on pages in use: nothing leaves the free queue
    assert pool.pages(1) == [1, 2] and pool.seq_lens[1] == 8
    pool.fork(0, 2)
    assert pool.pages(2) == [1, 2, 3] and pool.seq_lens[2] == 10
    assert pool.ref_counts.tolist() == [0, 3, 3, 2, 0, 0, 0, 0]
    assert pool.release(0) == 0 and pool.num_free == 4
    assert pool.ref_counts.tolist() == [0, 2, 2, 1, 0, 0, 0, 0]
    assert pool.release(2) == 1  # page 3
    pool.flush()
    assert pool.free_pages() == [4, 5, 6, 7, 3]
    assert pool.release(1) == 2
    pool.flush()
    assert pool.free_pages()[:5] == [4, 5, 6, 7, 3]
    assert sorted(pool.free_pages()[5:]) == [1, 2]  # their order: test_free_queue_order_after_release
    assert not pool.ref_counts.any()


def test_fork_shares_only_the_pages_that_hold_tokens():
    pool = new_pool()
    assert grow(pool, {0: 2}, min_pages=3) == []  # a reservation: 3 pages for 2 tokens
    assert pool.pages(0) == [1, 2, 3]
    pool.fork(0, 1)
    assert pool.pages(1) == [1] and pool.seq_lens[1] == 2
    assert pool.block_tables[1].tolist() == [1, NULL_PAGE, NULL_PAGE, NULL_PAGE]
    assert pool.ref_counts[:4].tolist() == [0, 2, 1, 1]


def test_extend_copies_a_shared_last_page_on_write():
    pool = new_pool()
    grow(pool, {0: 6})  # [1, 2]: page 2 holds tokens 4 and 5
    pool.fork(0, 1)
    assert pool.cow_needed(0) and pool.cow_needed(1)
    assert grow(pool, {1: 1}) == [(2, 3)]  # slot 1 writes token 6 into its own copy of page 2
    assert pool.pages(0) == [1, 2] and pool.pages(1) == [1, 3]
    assert pool.ref_counts[:4].tolist() == [0, 2, 1, 1]
    assert not pool.cow_needed(0) and not pool.cow_needed(1)
    assert grow(pool, {0: 5}) == []  # page 2 is slot 0's alone now: written in place, then page 4
    assert pool.pages(0) == [1, 2, 4]


def test_a_copy_comes_before_growth_and_the_last_sharer_keeps_the_page():
    pool = new_pool()
    grow(pool, {0: 6})  # [1, 2]
    pool.fork(0, 1)
    pool.fork(0, 2)
    # All three write into page 2 in one call: slots 0 and 1 copy it (in
    # slot order), slot 2, the last, keeps it; slot 1 also grows a page,
    # taken after its copy.
    assert grow(pool, {0: 1, 1: 5, 2: 1}) == [(2, 3), (2, 4)]
    assert [pool.pages(s) for s in range(3)] == [[1, 3], [1, 4, 5], [1, 2]]
    assert pool.ref_counts[:6].tolist() == [0, 3, 1, 1, 1, 1]
    assert pool.free_pages() == [6, 7]


def test_a_full_shared_page_needs_no_copy_and_a_short_pool_refuses_the_copy():
    pool = new_pool(num_pages=5)  # pages 1..4
    grow(pool, {0: 8})  # [1, 2], both full
    pool.fork(0, 1)
    assert not pool.cow_needed(1)
    assert grow(pool, {1: 1}) == []
    assert pool.pages(1) == [1, 2, 3]
    grow(pool, {2: 2})  # [4]
    pool.fork(2, 3)
    before = snapshot(pool)
    assert pool.free_pages() == [] and pool.cow_needed(3)
    assert grow(pool, {3: 1}) is None  # the copy needs a page; none is queued
    assert snapshot(pool) == before


def test_take_free_pops_the_head_for_a_swap_in():
    evicted = []
    pool = new_pool(on_evict=evicted.append)
    grow(pool, {0: 4})  # [1]
    pool.release(0)
    assert pool.take_free(2) == [2, 3]  # flushes first: page 1 queues behind 2..7
    assert evicted == [1, 2, 3]
    assert pool.free_pages() == [4, 5, 6, 7, 1] and pool.num_free == 5
    assert pool.share(1, [2, 3], num_tokens=7) == 0  # already off the queue
    assert pool.pages(1) == [2, 3] and pool.seq_lens[1] == 7
    assert pool.ref_counts[:4].tolist() == [0, 0, 1, 1]
    with pytest.raises(RuntimeError, match="block pool short: 6 pages wanted, 5 queued"):
        pool.take_free(6)
    assert pool.free_pages() == [4, 5, 6, 7, 1] and evicted == [1, 2, 3]


class Twins:
    """A device page state and a BlockPool driven call by call: each call
    runs, on device, ``unchecked_free``, ``unchecked_share``,
    ``unchecked_extend`` and ``unchecked_fork_many`` in that order, and on
    the host the matching ``release``, ``take_free``/``share``, ``extend``
    and ``fork``."""

    def __init__(self, **dims):
        self.state = init_page_state(**dims)
        self.pool = BlockPool(**dims)

    def call(self, free=(), share=None, swap_in=None, grow=None, fork=None):
        """free: slots; share: {slot: (pages, num_tokens)} (prefix hits);
        swap_in: {slot: (num_pages, num_tokens)} into pages off the queue's
        head; grow: {slot: tokens}; fork: {dst: src}. Returns the copies."""
        S, P = self.state.max_seqs, self.state.max_pages_per_seq
        pool = self.pool
        mask = np.zeros(S, bool)
        for slot in free:
            pool.release(slot)
            mask[slot] = True
        share = dict(share or {})
        for slot, (count, num_tokens) in (swap_in or {}).items():
            share[slot] = (pool.take_free(count), num_tokens)
        num_hit, hit_pages, hit_tokens = np.zeros(S, np.int32), np.zeros((S, P), np.int32), np.zeros(S, np.int32)
        for slot, (pages, num_tokens) in share.items():
            pool.share(slot, pages, num_tokens)
            num_hit[slot], hit_pages[slot, : len(pages)], hit_tokens[slot] = len(pages), pages, num_tokens
        num_new = np.zeros(S, np.int64)
        for slot, n in (grow or {}).items():
            num_new[slot] = n
        copies = pool.extend(num_new)
        src_of = np.full(S, -1, np.int32)
        for dst, src in sorted((fork or {}).items()):
            pool.fork(src, dst)
            src_of[dst] = src
        pool.flush()

        state = unchecked_free(self.state, jnp.asarray(mask))
        state, ok = unchecked_share(state, jnp.asarray(num_hit), jnp.asarray(hit_pages), jnp.asarray(hit_tokens))
        assert bool(ok)
        state, ok, cow_src, cow_dst = unchecked_extend(state, jnp.asarray(num_new, jnp.int32))
        assert bool(ok) == (copies is not None)
        state, ok = unchecked_fork_many(state, jnp.asarray(src_of))
        assert bool(ok)
        self.state = state
        device_copies = [(int(s), int(d)) for s, d in zip(np.asarray(cow_src), np.asarray(cow_dst)) if s != NO_PAGE]
        assert device_copies == (copies or [])
        pool.check(state)
        return copies


def test_the_twin_equals_the_device_page_state_after_the_same_calls():
    """``BlockPool.check`` finds block tables, lengths, reference counts and
    the free queue (its order too) equal after every call."""
    t = Twins(num_pages=12, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES, page_size=PAGE)
    assert t.call(grow={0: 6, 1: 9, 2: 4}) == []
    assert [t.pool.pages(s) for s in range(3)] == [[1, 2], [3, 4, 5], [6]]
    assert t.call(grow={1: 3}, fork={3: 0}) == []  # slot 3 shares [1, 2]
    assert t.call(grow={0: 1, 3: 1}) == [(2, 7)]  # both write into page 2: slot 0 copies, slot 3 keeps it
    # Slots 2 and 0 freed: page 6 and page 7 free, page 1 still held by slot 3;
    # then a hit on cached page 6 and one on page 1, in use.
    assert t.call(free=[2, 0], share={2: ([6], 4), 0: ([1], 4)}, grow={2: 2}) == []
    assert [t.pool.pages(s) for s in range(MAX_SEQS)] == [[1], [3, 4, 5], [6, 8], [1, 2]]
    assert t.call(free=[1], swap_in={1: (2, 7)}) is not None  # a swap-in takes two pages off the head
    assert t.pool.pages(1) == [9, 10]
    assert t.call(grow={0: 13}) is None  # 17 tokens: too many pages; both refuse
    assert t.call(free=range(MAX_SEQS)) == []
    assert t.pool.num_free == 11 and not t.pool.ref_counts.any()


def test_a_rollback_frees_tail_first_on_both_twins_before_pending_releases():
    """Speculative decoding's rollback: ``BlockPool.truncate`` queues the
    pages it frees at once (rows ascending, each tail first) as
    ``unchecked_truncate`` does in a call of its own, ahead of pages released
    earlier and freed by the next call; a page whose other holder was
    released before reaches zero on device only with that free, and queues
    with it."""
    t = Twins(num_pages=14, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES, page_size=PAGE)
    t.call(grow={0: 5, 1: 8, 2: 6})  # 0: [1, 2], 1: [3, 4], 2: [5, 6]
    t.call(grow={0: 10, 2: 9}, fork={3: 1})  # 0: [1, 2, 7, 8], 2: [5, 6, 9, 10], 3 shares [3, 4]
    t.call(grow={1: 4})  # 1: [3, 4, 11]
    t.pool.release(1)  # page 11 released; 3 and 4 still held by slot 3. The device frees slot 1 next call
    assert t.pool.truncate({0: 5, 2: 9, 3: 4}, {2: 4}) == 3  # 8, 7 now; 4 with slot 1's free
    assert [t.pool.pages(s) for s in range(MAX_SEQS)] == [[1, 2], [], [5, 6, 9, 10], [3]]
    assert t.pool.seq_lens.tolist() == [5, 0, 9, 4]
    state, ok = unchecked_truncate(t.state, jnp.asarray([5, 12, 9, 4], jnp.int32),
                                   jnp.asarray([0, 3, 4, 0], jnp.int32))  # slot 1 as it is on device
    assert bool(ok)
    t.state = unchecked_free(state, jnp.asarray([False, True, False, False]))  # the next call's frees
    t.pool.flush()
    assert t.pool.free_pages()[-4:] == [8, 7, 11, 4]
    t.pool.check(t.state)
    with pytest.raises(ValueError, match="new_lens"):
        t.pool.truncate({0: 6})  # a rollback never grows
    assert t.pool.seq_lens[0] == 5


def test_check_names_the_first_difference():
    dims = dict(num_pages=8, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES, page_size=PAGE)
    state, pool = init_page_state(**dims), BlockPool(**dims)
    pool.check(state)
    grow(pool, {0: 4})
    with pytest.raises(RuntimeError, match=r"differ in block_tables at \[\[0, 0\]\]"):
        pool.check(state)
    state, _, _, _ = unchecked_extend(state, jnp.asarray([4, 0, 0, 0], jnp.int32))
    pool.check(state)
    pool.ref_counts[1] += 1
    with pytest.raises(RuntimeError, match=r"differ in ref_counts at \[\[1\]\]"):
        pool.check(state)
    pool.ref_counts[1] -= 1
    pool.release(0)
    state = unchecked_free(state, jnp.asarray([True, False, False, False]))
    with pytest.raises(RuntimeError, match="unflushed releases"):
        pool.check(state)
    pool.flush()
    pool.check(state)
    # Two slots freed in one device call but flushed one by one on the host:
    # the same pages, queued in another order.
    grow(pool, {0: 4, 1: 4})  # [2], [3]
    state, _, _, _ = unchecked_extend(state, jnp.asarray([4, 4, 0, 0], jnp.int32))
    pool.check(state)
    pool.release(1)
    pool.flush()
    pool.release(0)
    pool.flush()
    state = unchecked_free(state, jnp.asarray([True, True, False, False]))
    with pytest.raises(RuntimeError, match=r"free queues differ: device \[4, 5, 6, 7, 1, 2, 3\]"):
        pool.check(state)
