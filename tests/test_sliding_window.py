"""Pages a sliding window no longer sees: exact counts, order, the host
twin, and attention that reads a table with dropped pages as if they were
kept (paged_jax.paging.sliding_window)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import ragged as ra
from paged_jax.paging import page_state as ps
from paged_jax.paging import sliding_window as sw
from paged_jax.paging.block_pool import BlockPool


def brute_first_kept(n: int, window: int, page: int) -> int:
    """Leading pages no query at position >= n can see (keys (q - W, q])."""
    count = 0
    while (count + 1) * page - 1 <= n - window:  # the page's last position is out of the next query's window
        count += 1
    return count


@pytest.mark.parametrize("window,page", [(1, 1), (1, 4), (3, 2), (4, 4), (5, 4), (16, 16), (17, 16)])
def test_window_first_kept_is_the_brute_force_count(window, page):
    n = np.arange(0, 80)
    got = sw.window_first_kept(n, sliding_window=window, page_size=page)
    assert got.tolist() == [brute_first_kept(int(i), window, page) for i in n]
    assert int(sw.window_first_kept(jnp.int32(40), sliding_window=window, page_size=page)) == got[40]


@pytest.mark.parametrize("kwargs,match", [
    (dict(sliding_window=0, page_size=4), "sliding_window"),
    (dict(sliding_window=4, page_size=0), "page_size"),
])
def test_window_first_kept_refuses_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sw.window_first_kept(10, **kwargs)


def grown(lens, *, num_pages=20, max_pages=6, page=4):
    state = ps.init_page_state(num_pages=num_pages, max_seqs=len(lens), max_pages_per_seq=max_pages,
                               page_size=page)
    pool = BlockPool(num_pages=num_pages, max_seqs=len(lens), max_pages_per_seq=max_pages, page_size=page)
    state, ok, _, _ = ps.extend(state, jnp.asarray(lens, jnp.int32))
    assert ok and pool.extend(np.asarray(lens, np.int64)) == []
    return state, pool


def drop(state, pool, first_kept):
    for s, n in enumerate(first_kept):
        pool.drop_before(s, n)
    state = sw.drop_pages_before(state, jnp.asarray(pool.first_kept(), jnp.int32))
    pool.flush()
    pool.check(state)
    return state


def test_drop_returns_exactly_the_out_of_window_pages_tail_first():
    state, pool = grown([23, 9, 0])  # 6, 3 and 0 pages of 4
    tables = pool.block_tables.copy()
    free_before = int(state.num_free_pages)
    state = drop(state, pool, [4, 2, 3])
    assert int(state.num_free_pages) == free_before + 4 + 2
    assert (pool.block_tables[0, :4] == ps.NULL_PAGE).all() and (pool.block_tables[0, 4:6] == tables[0, 4:6]).all()
    assert (pool.block_tables[1, :2] == ps.NULL_PAGE).all() and pool.block_tables[1, 2] == tables[1, 2]
    assert state.seq_lens.tolist() == [23, 9, 0] and state.num_seq_pages.tolist() == [6, 3, 0]
    # slots ascending, each slot's dropped pages tail first, at the queue's tail
    freed = pool.free_pages()[-6:]
    assert freed == [int(p) for p in tables[0, :4][::-1]] + [int(p) for p in tables[1, :2][::-1]]
    # idempotent: the same columns again drop nothing
    again = drop(state, pool, [4, 2, 0])
    assert int(again.num_free_pages) == int(state.num_free_pages)


def test_a_page_another_sequence_holds_stays_until_its_last_holder_drops_it():
    state, pool = grown([12, 0])
    state = ps.fork(state, 0, 1)
    pool.fork(0, 1)
    shared = int(pool.block_tables[0, 0])
    free_before = int(state.num_free_pages)
    state = drop(state, pool, [2, 0])
    assert int(state.num_free_pages) == free_before and pool.ref_counts[shared] == 1
    state = drop(state, pool, [0, 1])
    assert int(state.num_free_pages) == free_before + 1 and pool.ref_counts[shared] == 0
    # the fork's second page is still shared: slot 1 drops it, slot 0 already has
    state = drop(state, pool, [0, 2])
    assert int(state.num_free_pages) == free_before + 2


def test_tables_with_dropped_pages_grow_fork_and_free_exactly():
    state, pool = grown([16, 0, 0])
    state = drop(state, pool, [3, 0, 0])  # keeps page 3 of 4
    total = int(state.num_free_pages)
    state, ok, _, _ = ps.extend(state, jnp.asarray([5, 0, 0], jnp.int32))  # 21 tokens: pages 4, 5 new
    pool.extend(np.array([5, 0, 0]))
    assert ok and int(state.num_free_pages) == total - 2
    state = ps.fork(state, 0, 2)
    pool.fork(0, 2)
    pool.check(state)
    assert (pool.block_tables[2, :3] == ps.NULL_PAGE).all()  # a fork shares the nulls, referencing nothing
    state = ps.free(state, jnp.asarray([True, False, False]))
    pool.release(0)
    pool.flush()
    pool.check(state)
    assert int(state.num_free_pages) == total - 2  # slot 2 still holds pages 3..5
    state = ps.free(state, jnp.asarray([False, False, True]))
    pool.release(2)
    pool.flush()
    pool.check(state)
    assert int(state.num_free_pages) == total + 1 and int(state.ref_counts.sum()) == 0


def test_a_drop_and_a_free_in_one_call_queue_as_on_device():
    """The twin records a drop then a release of the same slot, or of a
    slot sharing its pages, and queues them in the device's order (drops
    first, then frees)."""
    state, pool = grown([16, 0, 0])
    state = ps.fork(state, 0, 1)
    pool.fork(0, 1)
    pool.drop_before(0, 3)
    pool.release(1)
    dev = sw.drop_pages_before(state, jnp.asarray(pool.first_kept(), jnp.int32))
    dev = ps.free(dev, jnp.asarray([False, True, False]))
    pool.flush()
    pool.check(dev)
    assert pool.drop_before(1, 4) == (0, 0)  # a released slot has nothing left to drop


def test_drop_refuses_bad_arguments_and_leaves_the_state():
    state, pool = grown([8, 4])
    before = jax.tree.map(np.asarray, state)
    for bad, match in ((np.array([1, -1], np.int32), "must be in \\[0, max_pages_per_seq=6\\]"),
                       (np.array([2**32 + 1, 0], np.int64), "must be in \\[0, max_pages_per_seq=6\\]"),
                       (np.array([1], np.int32), "int\\[max_seqs=2\\]"),
                       (np.array([1.0, 0.0]), "int\\[max_seqs=2\\]")):
        with pytest.raises(ValueError, match=match):
            sw.drop_pages_before(state, bad)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)))
    tables = pool.block_tables.copy()
    for slot, first, match in ((0, -1, "first_kept"), (-2, 1, "slot"), (2, 1, "slot"), (0, 2.7, "first_kept"),
                               (0, True, "first_kept")):
        with pytest.raises(ValueError, match=match):
            pool.drop_before(slot, first)
    assert np.array_equal(pool.block_tables, tables)
    for bad in (np.array([10], np.uint8), np.array([10.5]), "10", None, -1):
        with pytest.raises(ValueError, match="num_computed"):
            sw.window_first_kept(bad, sliding_window=20, page_size=2)


def test_a_hit_with_dropped_pages_shares_only_the_live_ones():
    state, pool = grown([0, 0], num_pages=10)
    num_hit = np.array([3, 0], np.int32)
    table = np.zeros((2, 6), np.int32)
    table[0, :3] = [0, 0, 7]  # a sliding-window hit: the first two pages out of the window
    state, ok = ps.share(state, num_hit, table)
    pool.share(0, [0, 0, 7])
    assert ok and int(state.ref_counts[7]) == 1 and int(state.ref_counts.sum()) == 1
    assert int(state.seq_lens[0]) == 12
    pool.check(state)


@pytest.mark.parametrize("quantized", [False, True])
def test_attention_over_dropped_pages_equals_keeping_them(quantized):
    """A sliding-window layer reads a table whose out-of-window pages are
    null (the null page full of NaN) exactly as the table that keeps them."""
    rng = np.random.default_rng(0)
    L, K, N, H, W = 4, 2, 4, 16, 6
    lens = np.array([23, 9, 30, 5], np.int32)
    q_lens = np.array([1, 3, 7, 1], np.int32)
    P, M = 40, 8
    dtype = jnp.int8 if quantized else jnp.float32
    kp = rng.standard_normal((1, K, P, L, H)).astype(np.float32)
    vp = rng.standard_normal((1, K, P, L, H)).astype(np.float32)
    kp[:, :, 0], vp[:, :, 0] = np.nan, np.nan  # the null page
    k_scales = v_scales = None
    if quantized:
        kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
        k_scales = jnp.ones((1, K, P, L), jnp.float32).at[:, :, 0].set(jnp.nan)
        v_scales = jnp.ones((1, K, P, L), jnp.float32).at[:, :, 0].set(jnp.nan)
    kp, vp = jnp.asarray(kp).astype(dtype), jnp.asarray(vp).astype(dtype)
    tables = np.zeros((4, M), np.int32)
    nxt = 1
    for s, n in enumerate(lens):
        k = -(-int(n) // L)
        tables[s, :k] = range(nxt, nxt + k)
        nxt += k
    dropped = tables.copy()
    first_kept = sw.window_first_kept(lens - q_lens, sliding_window=W, page_size=L)  # before this call's tokens
    for s, n in enumerate(first_kept):
        dropped[s, :n] = ps.NULL_PAGE
    assert first_kept.sum() > 0
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), N, H)).astype(np.float32))
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    n_tiles = ra.count_work(q_lens, lens, tile_q=4, block_tokens=2 * L, sliding_window=W)[0]
    outs = [ra.ragged_paged_attention(q, kp, vp, 0, jnp.asarray(t), jnp.asarray(starts), jnp.asarray(q_lens),
                                      jnp.asarray(lens), num_tiles=n_tiles, tile_q=4, pages_per_block=2,
                                      sliding_window=W, k_scales=k_scales, v_scales=v_scales)
            for t in (tables, dropped)]
    assert np.isfinite(np.asarray(outs[0])).all()
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
