"""Page state: exact page ids, copy-on-write, out-of-pages as a value, all pages back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.paging import page_state as ps
from paged_jax.paging.slots import slot_mapping


def mask(n, *idx):
    m = np.zeros(n, bool)
    m[list(idx)] = True
    return jnp.asarray(m)


def row(state, seq):
    return np.asarray(state.block_tables[seq]).tolist()


@pytest.fixture
def state():
    # 8 pages: the null page 0 and usable pages 1..7; page size 4; 3 slots of 4 pages.
    return ps.init_page_state(num_pages=8, max_seqs=3, max_pages_per_seq=4, page_size=4)


def test_init(state):
    assert int(state.num_free_pages) == 7
    assert np.asarray(state.free_queue).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert (np.asarray(state.block_tables) == ps.NULL_PAGE).all()
    assert state.max_seq_len == 16


def test_allocate_append_free_exact_ids(state):
    # 5 tokens -> ceil(5/4) = 2 pages, taken from the queue head: 1, 2.
    state, ok = ps.allocate(state, 0, 5)
    assert bool(ok) and row(state, 0) == [1, 2, 0, 0]
    # 4 tokens -> exactly 1 page: 3.
    state, ok = ps.allocate(state, 1, 4)
    assert bool(ok) and row(state, 1) == [3, 0, 0, 0]
    assert int(state.num_free_pages) == 4
    # Seq 0 has 5 tokens in 8 slots: no new page. Seq 1 is full (4/4): page 4.
    state, ok, src, dst = ps.append(state, mask(3, 0, 1))
    assert bool(ok)
    assert row(state, 0) == [1, 2, 0, 0] and row(state, 1) == [3, 4, 0, 0]
    assert np.asarray(state.seq_lens).tolist() == [6, 5, 0]
    assert np.asarray(src).tolist() == [-1, -1, -1] and np.asarray(dst).tolist() == [-1, -1, -1]
    # Free seq 0: pages 1, 2 go to the queue tail, its last page first (2, 1);
    # the next allocation takes 5 6 7 first, then 2.
    state = ps.free(state, mask(3, 0))
    assert int(state.num_free_pages) == 5
    assert row(state, 0) == [0, 0, 0, 0] and int(state.seq_lens[0]) == 0
    state, ok = ps.allocate(state, 2, 16)
    assert bool(ok) and row(state, 2) == [5, 6, 7, 2]
    assert np.asarray(state.ref_counts).tolist() == [0, 0, 1, 1, 1, 1, 1, 1]


def test_out_of_pages_is_a_value_and_state_unchanged(state):
    state, ok = ps.allocate(state, 0, 16)  # 4 pages, 3 left
    assert bool(ok)
    before = state
    after, ok = ps.allocate(state, 1, 13)  # needs 4
    assert not bool(ok)
    for a, b in zip(np.asarray(after.block_tables), np.asarray(before.block_tables)):
        np.testing.assert_array_equal(a, b)
    assert int(after.num_free_pages) == 3 and int(after.seq_lens[1]) == 0
    # Append for three sequences each at a page boundary with only two pages left.
    state, ok = ps.allocate(state, 1, 4)
    state, ok = ps.allocate(state, 2, 4)
    assert bool(ok) and int(state.num_free_pages) == 1
    state_seq_lens = np.asarray(state.seq_lens).tolist()
    new, ok, _, _ = ps.append(state, mask(3, 1, 2))  # both full: need 2 pages, 1 free
    assert not bool(ok)
    assert np.asarray(new.seq_lens).tolist() == state_seq_lens
    assert int(new.num_free_pages) == 1


def test_reserve_tokens_holds_capacity(state):
    # Contiguous-style: 1 token with 16 reserved holds all 4 pages; appends take none.
    state, ok = ps.allocate(state, 0, 1, 16)
    assert bool(ok) and row(state, 0) == [1, 2, 3, 4]
    for _ in range(15):
        state, ok, _, _ = ps.append(state, mask(3, 0))
        assert bool(ok)
    assert int(state.seq_lens[0]) == 16 and int(state.num_free_pages) == 3


def test_fork_and_copy_on_write(state):
    state, _ = ps.allocate(state, 0, 6)  # pages 1, 2 (page 2 half full)
    state = ps.fork(state, 0, 1)
    assert row(state, 1) == [1, 2, 0, 0]
    assert np.asarray(state.ref_counts)[[1, 2]].tolist() == [2, 2]
    # Seq 1 appends into shared page 2 -> private copy on page 3.
    state, ok, src, dst = ps.append(state, mask(3, 1))
    assert bool(ok)
    assert row(state, 1) == [1, 3, 0, 0] and row(state, 0) == [1, 2, 0, 0]
    assert np.asarray(src).tolist() == [-1, 2, -1] and np.asarray(dst).tolist() == [-1, 3, -1]
    assert np.asarray(state.ref_counts)[[1, 2, 3]].tolist() == [2, 1, 1]
    # Seq 0 now owns page 2 alone: no copy.
    state, ok, src, _ = ps.append(state, mask(3, 0))
    assert bool(ok) and np.asarray(src).tolist() == [-1, -1, -1]
    # Freeing both returns every page once.
    state = ps.free(state, mask(3, 0, 1))
    assert int(state.num_free_pages) == 7
    assert (np.asarray(state.ref_counts) == 0).all()
    assert sorted(np.asarray(state.free_queue).tolist()) == [1, 2, 3, 4, 5, 6, 7]


def test_fork_does_not_share_reserved_pages(state):
    state, _ = ps.allocate(state, 0, 3, 16)  # 4 pages reserved, 1 holds tokens
    state = ps.fork(state, 0, 1)
    assert row(state, 1) == [1, 0, 0, 0] and int(state.num_seq_pages[1]) == 1


def test_random_workload_returns_every_page():
    rng = np.random.default_rng(0)
    state = ps.init_page_state(num_pages=33, max_seqs=6, max_pages_per_seq=8, page_size=4)
    for _ in range(200):
        lens = np.asarray(state.seq_lens)
        op = rng.integers(3)
        seq = int(rng.integers(6))
        if op == 0 and lens[seq] == 0:
            state, _ = ps.allocate(state, seq, int(rng.integers(1, 20)))
        elif op == 1:
            active = (lens > 0) & (lens < 32) & (rng.random(6) < 0.7)
            state, _, _, _ = ps.append(state, jnp.asarray(active))
        elif op == 2 and lens[seq] > 0 and int(state.seq_lens[(seq + 1) % 6]) == 0 and rng.random() < 0.3:
            state = ps.fork(state, seq, (seq + 1) % 6)
        elif rng.random() < 0.3:
            state = ps.free(state, mask(6, seq))
        # Invariant: every held reference is counted; no page both free and held.
        bt = np.asarray(state.block_tables)
        held = np.concatenate([bt[s, : int(state.num_seq_pages[s])] for s in range(6)])
        counts = np.bincount(held, minlength=33)
        np.testing.assert_array_equal(counts, np.asarray(state.ref_counts))
        cap = 32
        head, nfree = int(state.free_head), int(state.num_free_pages)
        free_ids = np.asarray(state.free_queue)[(head + np.arange(nfree)) % cap]
        assert set(free_ids.tolist()).isdisjoint(held.tolist())
        assert len(set(free_ids.tolist())) == nfree
        assert ps.NULL_PAGE not in free_ids and ps.NULL_PAGE not in held
        assert nfree + len(set(held.tolist())) == 32
    state = ps.free(state, jnp.ones(6, bool))
    assert int(state.num_free_pages) == 32 and (np.asarray(state.ref_counts) == 0).all()


def test_slot_mapping():
    bt = jnp.asarray([[5, 2, 0], [7, 0, 0]], jnp.int32)
    pos = jnp.asarray([[0, 3, 4, 5], [0, 1, 2, 3]], jnp.int32)
    valid = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    # page size 4: pos 0 -> 5*4+0 = 20, pos 3 -> 23, pos 4 -> page 2 -> 8, pos 5 -> 9.
    slots = slot_mapping(bt, pos, valid, page_size=4)
    assert np.asarray(slots).tolist() == [[20, 23, 8, 9], [28, 29, -1, -1]]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(num_pages=1, max_seqs=1, max_pages_per_seq=1, page_size=4), "num_pages"),
        (dict(num_pages=4, max_seqs=1, max_pages_per_seq=1, page_size=0), "page_size=0"),
        (dict(num_pages=4, max_seqs=1, max_pages_per_seq=1, page_size=-3), "page_size=-3"),
        (dict(num_pages=4, max_seqs=0, max_pages_per_seq=1, page_size=4), "max_seqs"),
    ],
)
def test_bad_sizes(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ps.init_page_state(**kwargs)


def test_check_allocate(state):
    state, _ = ps.allocate(state, 0, 3)
    with pytest.raises(ValueError, match="already holds"):
        ps.check_allocate(state, 0, 2)
    with pytest.raises(ValueError, match="num_tokens=17"):
        ps.check_allocate(state, 1, 17)
    with pytest.raises(ValueError, match="seq_id"):
        ps.check_allocate(state, 3, 1)
    ps.check_allocate(state, 1, 16)


def test_all_sharers_append_together(state):
    # Seqs 0 and 1 share half-full page 2 and append in the same step: the
    # first copies (to 3), the last keeps page 2; nothing leaks.
    state, _ = ps.allocate(state, 0, 6)  # pages 1, 2
    state = ps.fork(state, 0, 1)
    state, ok, src, dst = ps.append(state, mask(3, 0, 1))
    assert bool(ok)
    assert row(state, 0) == [1, 3, 0, 0] and row(state, 1) == [1, 2, 0, 0]
    assert np.asarray(src).tolist() == [2, -1, -1] and np.asarray(dst).tolist() == [3, -1, -1]
    assert np.asarray(state.ref_counts)[[1, 2, 3]].tolist() == [2, 1, 1]
    assert int(state.num_free_pages) == 4


def test_door_checks_refuse_and_leave_state_unchanged(state):
    state, _ = ps.allocate(state, 0, 16)  # full: 4 pages, max_seq_len tokens
    state, _ = ps.allocate(state, 1, 2)
    before = np.asarray(state.ref_counts).tolist(), np.asarray(state.block_tables).tolist()
    bad = [
        (lambda: ps.allocate(state, 1, 3), "seq_id=1 already holds"),
        (lambda: ps.allocate(state, -1, 3), "seq_id must be in"),
        (lambda: ps.allocate(state, 2, -4), "num_tokens must be in"),
        (lambda: ps.allocate(state, 2, 3.7), "num_tokens must be an integer"),
        (lambda: ps.allocate(state, True, 3), "seq_id must be an integer"),
        (lambda: ps.fork(state, 0, 1), "dst=1 already holds"),
        (lambda: ps.fork(state, 0, 0), "must differ"),
        (lambda: ps.fork(state, 0, 3), "dst must be in"),
        (lambda: ps.append(state, mask(3, 0)), r"sequences \[0\] already hold max_seq_len=16"),
        (lambda: ps.append(state, jnp.asarray([2, 0, 0])), "active must be bool"),
        (lambda: ps.free(state, jnp.asarray([True])), r"seq_mask must be bool\[max_seqs=3\]"),
    ]
    for call, needle in bad:
        with pytest.raises(ValueError, match=needle):
            call()
    assert (np.asarray(state.ref_counts).tolist(), np.asarray(state.block_tables).tolist()) == before
    # Under jit the checks cannot read values: a full sequence makes ok False instead.
    _, ok, _, _ = ps.unchecked_append(state, mask(3, 0))
    assert not bool(ok)


def test_slot_mapping_never_aliases_and_checks_shapes():
    bt = jnp.asarray([[1, 2]], jnp.int32)  # capacity 8 tokens at page size 4
    pos = jnp.asarray([[3, 8, 100, -1]], jnp.int32)
    slots = slot_mapping(bt, pos, jnp.ones((1, 4), bool), page_size=4)
    assert np.asarray(slots).tolist() == [[7, -1, -1, -1]]
    with pytest.raises(ValueError, match="page_size"):
        slot_mapping(bt, pos, jnp.ones((1, 4), bool), page_size=0)
    with pytest.raises(ValueError, match="positions"):
        slot_mapping(bt, jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool), page_size=4)
    with pytest.raises(ValueError, match="valid"):
        slot_mapping(bt, pos, jnp.ones((1, 4), jnp.int32), page_size=4)


def test_extend_multi_token_exact_ids_and_copy_on_write(state):
    """A chunk of several tokens takes the pages it needs in slot order; a
    chunk starting in a shared, partly filled page copies that page first
    and takes fresh pages for the rest."""
    # Prompt of 6 in an empty slot -> pages 1, 2; seq 1 gets 4 -> page 3.
    state, ok, src, dst = ps.extend(state, jnp.asarray([6, 4, 0], jnp.int32))
    assert bool(ok) and row(state, 0) == [1, 2, 0, 0] and row(state, 1) == [3, 0, 0, 0]
    assert np.asarray(src).tolist() == [-1, -1, -1]
    state = ps.fork(state, 0, 2)  # seq 2 shares pages 1, 2 (6 tokens; page 2 half full)
    # Seq 2 appends 5 tokens: its first lands in shared page 2 -> copy to 4;
    # 11 tokens need 3 pages, so one more fresh page, 5. Seq 0 is untouched.
    state, ok, src, dst = ps.extend(state, jnp.asarray([0, 0, 5], jnp.int32))
    assert bool(ok)
    assert row(state, 2) == [1, 4, 5, 0] and row(state, 0) == [1, 2, 0, 0]
    assert np.asarray(src).tolist() == [-1, -1, 2] and np.asarray(dst).tolist() == [-1, -1, 4]
    assert np.asarray(state.ref_counts).tolist() == [0, 2, 1, 1, 1, 1, 0, 0]
    assert np.asarray(state.seq_lens).tolist() == [6, 4, 11]
    # Needing 3 more pages with 2 free: refused, nothing changes.
    before = state
    after, ok, src, _ = ps.extend(state, jnp.asarray([0, 12, 0], jnp.int32))  # seq 1: 16 tokens, 3 more pages
    assert not bool(ok) and (np.asarray(src) == ps.NO_PAGE).all()
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_extend_reservation_and_bad_input(state):
    state, ok, _, _ = ps.extend(state, jnp.asarray([1, 0, 0], jnp.int32), 3)
    assert bool(ok) and row(state, 0) == [1, 2, 3, 0] and int(state.seq_lens[0]) == 1
    with pytest.raises(ValueError, match="num_new must be int"):
        ps.extend(state, jnp.asarray([1, 0], jnp.int32))
    with pytest.raises(ValueError, match=">= 0"):
        ps.extend(state, jnp.asarray([-1, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match="would pass max_seq_len=16"):
        ps.extend(state, jnp.asarray([16, 0, 0], jnp.int32))


def test_extend_checks_min_pages_and_negative_growth_under_jit(state):
    n = jnp.asarray([1, 0, 0], jnp.int32)
    for bad, needle in (("2", "min_pages must be an int"), (2.9, "min_pages must be an int"),
                        (True, "min_pages must be an int"), (jnp.asarray([1, 2], jnp.int32), "min_pages must be"),
                        (-1, r"min_pages must be in \[0, max_pages_per_seq=4\]"),
                        (5, r"min_pages must be in \[0, max_pages_per_seq=4\]")):
        with pytest.raises(ValueError, match=needle):
            ps.extend(state, n, bad)
    state, ok, _, _ = ps.extend(state, jnp.asarray([5, 0, 0], jnp.int32))
    _, ok, _, _ = jax.jit(ps.extend)(state, jnp.asarray([-3, 0, 0], jnp.int32))
    assert not bool(ok)  # a shrink under jit is refused, not applied


def test_share_refuses_bad_hits_and_leaves_the_state():
    state = ps.init_page_state(num_pages=10, max_seqs=3, max_pages_per_seq=4, page_size=4)
    state, _, _, _ = ps.extend(state, jnp.array([3, 0, 0], jnp.int32))
    before = jax.tree.map(np.asarray, state)

    def hits(slot, pages):
        n, table = np.zeros(3, np.int32), np.zeros((3, 4), np.int32)
        n[slot], table[slot, : len(pages)] = len(pages), pages
        return n, table

    for args, match in (
        (hits(1, [5, 5]), "lists a page twice"),
        (hits(0, [5]), "already hold a sequence"),
        (hits(1, [0]), "null page after a page or last"),
        (hits(1, [5, 0]), "null page after a page or last"),
        (hits(1, [5, 0, 6]), "null page after a page or last"),
        (hits(1, [10]), r"hit_pages must be in \[0, num_pages=10\)"),
        (hits(1, [-1, 5]), r"hit_pages must be in \[0, num_pages=10\)"),
        ((np.array([5, 0, 0], np.int32), np.zeros((3, 4), np.int32)), "num_hit must be in"),
        (([1, 0, 0], np.ones((3, 4), np.int32)), "got a list"),
    ):
        with pytest.raises(ValueError, match=match):
            ps.share(state, *args)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)))
    new, ok = ps.share(state, *hits(1, [5, 6]))
    assert ok and ps.pages_for_tokens(int(new.seq_lens[1]), 4) == 2 and int(new.ref_counts[5]) == 1


def test_truncate_rolls_back_rejected_tokens_exact_ids(state):
    """Speculative decoding's rollback: a step writes the last token and k
    proposals; verification keeps a prefix; the pages past it go back to
    the free queue at once, tail first."""
    state, ok, _, _ = ps.extend(state, jnp.asarray([6, 0, 0], jnp.int32))  # seq 0: pages 1, 2
    state, ok, _, _ = ps.extend(state, jnp.asarray([4, 0, 0], jnp.int32))  # + the last token and 3 proposals
    assert bool(ok) and row(state, 0) == [1, 2, 3, 0] and int(state.seq_lens[0]) == 10
    # Everything accepted: nothing moves.
    same, ok = ps.truncate(state, jnp.asarray([10, 0, 0], jnp.int32))
    assert bool(ok)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # Everything rejected: back to 7 tokens (the last token's K/V stays), page 3 freed.
    back, ok = ps.truncate(state, jnp.asarray([7, 0, 0], jnp.int32))
    assert bool(ok) and row(back, 0) == [1, 2, 0, 0] and np.asarray(back.seq_lens).tolist() == [7, 0, 0]
    assert np.asarray(back.ref_counts).tolist() == [0, 1, 1, 0, 0, 0, 0, 0] and int(back.num_free_pages) == 5
    back, ok = ps.allocate(back, 1, 16)  # the queue: 4 5 6 7, then the page just freed
    back, ok = ps.allocate(back, 2, 1)
    assert row(back, 1) == [4, 5, 6, 7] and row(back, 2) == [3, 0, 0, 0]


def test_truncate_across_a_page_boundary_keeps_a_forks_pages(state):
    state, ok, _, _ = ps.extend(state, jnp.asarray([7, 0, 0], jnp.int32))  # seq 0: pages 1, 2 (7 tokens)
    state = ps.fork(state, 0, 2)  # seq 2 shares them
    # Seq 2 writes 6 tokens: its first lands in shared page 2 -> private copy 3; 13 tokens -> pages 4, 5 too.
    state, ok, src, dst = ps.extend(state, jnp.asarray([0, 0, 6], jnp.int32))
    assert bool(ok) and row(state, 2) == [1, 3, 4, 5] and np.asarray(dst).tolist() == [-1, -1, 3]
    # Verification keeps 9 tokens: across the boundary at 8, so page 4 stays and 5 goes.
    state, ok = ps.truncate(state, jnp.asarray([7, 0, 9], jnp.int32))
    assert bool(ok) and row(state, 2) == [1, 3, 4, 0] and row(state, 0) == [1, 2, 0, 0]
    assert np.asarray(state.ref_counts).tolist() == [0, 2, 1, 1, 1, 0, 0, 0]  # page 1 still shared
    # Back to within the copied page: page 4 goes; the fork's pages and the shared page stay.
    state, ok = ps.truncate(state, jnp.asarray([7, 0, 8], jnp.int32))
    assert row(state, 2) == [1, 3, 0, 0] and int(state.num_free_pages) == 4
    # Freeing both returns every page.
    state = ps.free(state, mask(3, 0, 2))
    assert int(state.num_free_pages) == 7 and not np.asarray(state.ref_counts).any()


def test_truncate_keeps_a_reservation_and_refuses_growth(state):
    state, ok = ps.allocate(state, 0, 5, reserve_tokens=16)  # a pre-paging reservation: 4 pages
    state, ok, _, _ = ps.extend(state, jnp.asarray([3, 0, 0], jnp.int32))
    kept, ok = ps.truncate(state, jnp.asarray([5, 0, 0], jnp.int32), min_pages=jnp.asarray([4, 0, 0], jnp.int32))
    assert bool(ok) and row(kept, 0) == [1, 2, 3, 4] and int(kept.seq_lens[0]) == 5
    before = state
    for new_lens, needle in (([9, 0, 0], r"new_lens must be in \[0, seq_lens\].*\[9\] at slots \[0\]"),
                             ([-1, 0, 0], r"new_lens must be in"),
                             ([1, 2, 3], r"\[2, 3\] at slots \[1, 2\]")):
        with pytest.raises(ValueError, match=needle):
            ps.truncate(state, jnp.asarray(new_lens, jnp.int32))
    with pytest.raises(ValueError, match=r"new_lens must be an integer array of shape \(3,\)"):
        ps.truncate(state, jnp.asarray([1.0, 0, 0]))
    for bad in (-1, np.asarray(2**32), np.asarray([5, 0, 0]), 1.7, True, np.zeros(2, np.int32)):
        with pytest.raises(ValueError, match=r"min_pages must be an int or an integer array of shape \(3,\) in \[0, "
                                             r"max_pages_per_seq=4\]"):
            ps.truncate(state, jnp.asarray([5, 0, 0], jnp.int32), min_pages=bad)
    # Under jit nothing checks at the door: ok is False and the state unchanged.
    after, ok = jax.jit(ps.unchecked_truncate)(state, jnp.asarray([9, 0, 0], jnp.int32))
    assert not bool(ok)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
