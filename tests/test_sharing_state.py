"""A hypothesis state machine over the device page state, the host's twin of
it and the prefix cache.

Random operations (allocate, append, extend, fork, a write into a shared
page, free, cache hits, evictions through new allocations, swap out and swap
in, pages a sliding window drops, and refused calls) run on the device functions of
``paged_jax.paging.page_state`` and ``paged_jax.paging.sliding_window`` and on the
NumPy twin ``paged_jax.paging.block_pool.BlockPool``, which is written separately
from the same rules. After every step:

* the twin equals the device state, field by field, free-queue order included;
* every page's reference count equals the block-table entries holding it;
* no page is both free and held; the null page is never handed out;
* free + cached + used = the usable pages, a shared page counted once;
* every cached page holds, slot by slot, the tokens its cache entry names
  (a shadow of page contents follows every write and copy-on-write copy),
  so a hit can never hand out wrong K/V;
* a refused call leaves the device state bit-identical;
* null entries (dropped pages) sit only at columns a window of ``WINDOW``
  tokens can no longer see.

A second machine (``GroupedRowsMachine``) runs a hybrid model's page state:
a row per slot and layer group (``paged_jax.paging.kv_groups``), slot operations
acting on all of a slot's rows, only the sliding group's rows dropping.
"""

import jax
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.engine.step import _group_rows
from paged_jax.paging import page_state as ps
from paged_jax.paging import sliding_window as sw
from paged_jax.paging.block_pool import BlockPool
from paged_jax.paging.prefix_cache import PrefixCache, chain_keys

NUM_PAGES, MAX_SEQS, MAX_PAGES, PAGE = 14, 4, 5, 2
VOCAB = 2  # few distinct tokens: many equal pages, many hits
WINDOW = 3  # tokens a sliding-window layer sees: pages fall out of it while slots grow
EXTRA = (None,)


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class SharingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = ps.init_page_state(num_pages=NUM_PAGES, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES,
                                        page_size=PAGE)
        self.cache = PrefixCache(PAGE)
        self.pool = BlockPool(num_pages=NUM_PAGES, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES, page_size=PAGE,
                              on_evict=self.cache.evict)
        self.tokens = [[] for _ in range(MAX_SEQS)]  # each slot's token ids
        self.keyed = [0] * MAX_SEQS  # leading pages offered to the cache
        self.content = np.full((NUM_PAGES, PAGE), -1)  # shadow: token id held at each page slot
        self.refused = 0
        self.swapped = []  # (tokens, page contents) of swapped-out sequences

    # ------------------------------------------------------------ helpers

    def _extend(self, num_new: np.ndarray, new_tokens: list[list[int]]):
        before = self.state
        state, ok, cow_src, cow_dst = ps.unchecked_extend(self.state, jax.numpy.asarray(num_new, jax.numpy.int32))
        copies = self.pool.extend(num_new.astype(np.int64))
        assert bool(ok) == (copies is not None)
        if not ok:
            assert same(state, before)
            self.refused += 1
            return
        self.state = state
        dev = sorted((int(a), int(b)) for a, b in zip(np.asarray(cow_src), np.asarray(cow_dst)) if a != ps.NO_PAGE)
        assert dev == sorted(copies)
        for src, dst in copies:
            self.content[dst] = self.content[src]
        for s in range(MAX_SEQS):
            start = len(self.tokens[s])
            for i, t in enumerate(new_tokens[s]):
                pos = start + i
                self.content[self.pool.block_tables[s, pos // PAGE], pos % PAGE] = t
            self.tokens[s] += new_tokens[s]
            self._offer(s)

    def _offer(self, s):
        keys = chain_keys(self.tokens[s], PAGE, EXTRA, [])
        for j in range(self.keyed[s], len(keys)):
            if self.pool.block_tables[s, j] == ps.NULL_PAGE:  # dropped by the window before it was offered
                continue
            self.cache.insert(int(self.pool.block_tables[s, j]), self.tokens[s], keys, EXTRA, j)
        self.keyed[s] = len(keys)

    def _free(self, mask: np.ndarray):
        self.state = ps.free(self.state, jax.numpy.asarray(mask))
        for s in np.flatnonzero(mask):
            self.pool.release(int(s))
            self.tokens[s] = []
            self.keyed[s] = 0
        self.pool.flush()

    # -------------------------------------------------------------- rules

    @rule(data=st.data())
    def extend(self, data):
        """Allocate (an empty slot), append (1 token), or a chunk; several
        slots at once, some of them writing into shared pages."""
        num_new = np.array(data.draw(st.lists(st.integers(0, 5), min_size=MAX_SEQS, max_size=MAX_SEQS)))
        num_new = np.minimum(num_new, MAX_PAGES * PAGE - np.array([len(t) for t in self.tokens]))
        new = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=int(n), max_size=int(n))) for n in num_new]
        self._extend(num_new, new)

    @rule(data=st.data())
    def fork(self, data):
        busy = [s for s in range(MAX_SEQS) if self.tokens[s]]
        empty = [s for s in range(MAX_SEQS) if not self.tokens[s] and not self.pool.num_seq_pages[s]]
        if not busy or not empty:
            return
        src, dst = data.draw(st.sampled_from(busy)), data.draw(st.sampled_from(empty))
        self.state = ps.fork(self.state, src, dst)
        self.pool.fork(src, dst)
        self.tokens[dst] = list(self.tokens[src])
        self.keyed[dst] = len(self.tokens[dst]) // PAGE  # its full pages are the source's

    @rule(data=st.data())
    def free(self, data):
        mask = np.array(data.draw(st.lists(st.booleans(), min_size=MAX_SEQS, max_size=MAX_SEQS)))
        self._free(mask)

    @rule(data=st.data())
    def cache_hit(self, data):
        """A new sequence whose first tokens may be cached takes the hit
        pages (some of them freed, back out of the free queue)."""
        empty = [s for s in range(MAX_SEQS) if not self.tokens[s] and not self.pool.num_seq_pages[s]]
        if not empty:
            return
        s = data.draw(st.sampled_from(empty))
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=PAGE, max_size=MAX_PAGES * PAGE))
        keys = chain_keys(tokens, PAGE, EXTRA, [])
        hits = self.cache.lookup(tokens, keys, EXTRA, len(keys))
        if not hits:
            return
        for j, p in enumerate(hits):  # the hit's content is the request's
            assert self.content[p].tolist() == tokens[j * PAGE : (j + 1) * PAGE]
        num_hit = np.zeros(MAX_SEQS, np.int32)
        table = np.zeros((MAX_SEQS, MAX_PAGES), np.int32)
        num_hit[s], table[s, : len(hits)] = len(hits), hits
        self.state, ok = ps.share(self.state, num_hit, table)
        assert ok
        self.pool.share(s, hits)
        self.tokens[s] = tokens[: len(hits) * PAGE]
        self.keyed[s] = len(hits)

    @rule(data=st.data())
    def swap_out(self, data):
        """Copy a sequence's page contents out and free its slot."""
        busy = [s for s in range(MAX_SEQS) if self.tokens[s]]
        if not busy:
            return
        s = data.draw(st.sampled_from(busy))
        table = np.array(self.pool.pages(s))
        self.swapped.append((list(self.tokens[s]), table != ps.NULL_PAGE, self.content[table[table != ps.NULL_PAGE]]))
        mask = np.zeros(MAX_SEQS, bool)
        mask[s] = True
        self._free(mask)

    @rule(data=st.data())
    def swap_in(self, data):
        """Fresh pages off the free queue's head take a swapped sequence's
        contents back (a partial last page included)."""
        empty = [s for s in range(MAX_SEQS) if not self.tokens[s] and not self.pool.num_seq_pages[s]]
        if not self.swapped or not empty:
            return
        tokens, live, content = self.swapped[-1]
        if len(content) > self.pool.num_free:
            return
        self.swapped.pop()
        s = data.draw(st.sampled_from(empty))
        fresh = self.pool.take_free(len(content))
        self.content[fresh] = content
        pages = np.zeros(len(live), np.int64)  # dropped pages stay dropped: nothing to copy back
        pages[live] = fresh
        num_hit = np.zeros(MAX_SEQS, np.int32)
        table = np.zeros((MAX_SEQS, MAX_PAGES), np.int32)
        lens = np.zeros(MAX_SEQS, np.int32)
        num_hit[s], table[s, : len(pages)], lens[s] = len(pages), pages, len(tokens)
        self.state, ok = ps.unchecked_share(self.state, jax.numpy.asarray(num_hit), jax.numpy.asarray(table),
                                            jax.numpy.asarray(lens))
        assert ok
        self.pool.share(s, pages.tolist(), len(tokens))
        self.tokens[s] = tokens
        self.keyed[s] = 0
        self._offer(s)

    @rule(data=st.data())
    def slide(self, data):
        """Some slots drop the pages a window of ``WINDOW`` tokens no longer
        sees (a sliding-window layer group while its sequences run)."""
        mask = data.draw(st.lists(st.booleans(), min_size=MAX_SEQS, max_size=MAX_SEQS))
        for s in range(MAX_SEQS):
            if mask[s]:
                self.pool.drop_before(s, int(sw.window_first_kept(len(self.tokens[s]), sliding_window=WINDOW,
                                                                  page_size=PAGE)))
        first_kept = self.pool.first_kept()
        self.state = sw.drop_pages_before(self.state, first_kept.astype(np.int32))
        self.pool.flush()

    @rule(data=st.data())
    def refused_share(self, data):
        """A hit into a busy slot or of the null page is refused and leaves
        the state bit-identical (unchecked: the checked door raises)."""
        busy = [s for s in range(MAX_SEQS) if self.pool.num_seq_pages[s]]
        num_hit = np.zeros(MAX_SEQS, np.int32)
        table = np.zeros((MAX_SEQS, MAX_PAGES), np.int32)
        if busy and data.draw(st.booleans()):
            num_hit[data.draw(st.sampled_from(busy))] = 1
            table[:, 0] = 1
        else:
            num_hit[0] = 1  # page 0: the null page
        new, ok = ps.unchecked_share(self.state, jax.numpy.asarray(num_hit), jax.numpy.asarray(table))
        assert not ok and same(new, self.state)
        self.refused += 1

    @precondition(lambda self: any(self.tokens))
    @rule()
    def refused_growth(self):
        """Asking for more pages than are free is refused, state unchanged."""
        num_new = np.zeros(MAX_SEQS, np.int64)
        s = next(s for s in range(MAX_SEQS) if self.tokens[s])
        num_new[s] = MAX_PAGES * PAGE + 1  # past max_pages_per_seq too
        new, ok, _, _ = ps.unchecked_extend(self.state, jax.numpy.asarray(num_new, jax.numpy.int32))
        assert not ok and same(new, self.state)
        assert self.pool.extend(num_new) is None

    # --------------------------------------------------------- invariants

    @invariant()
    def twin_equals_device(self):
        self.pool.check(self.state)

    @invariant()
    def ref_counts_count_block_table_entries(self):
        held = np.arange(MAX_PAGES)[None, :] < self.pool.num_seq_pages[:, None]
        dropped = self.pool.block_tables == ps.NULL_PAGE
        first_kept = sw.window_first_kept(np.array([len(t) for t in self.tokens]), sliding_window=WINDOW,
                                          page_size=PAGE)
        seen = np.arange(MAX_PAGES)[None, :] >= first_kept[:, None]
        assert not (held & dropped & seen).any(), "a page the window still sees was dropped (or never given)"
        entries = self.pool.block_tables[held & ~dropped]
        assert np.array_equal(np.bincount(entries, minlength=NUM_PAGES), self.pool.ref_counts)
        free = self.pool.free_pages()
        assert ps.NULL_PAGE not in free and len(set(free)) == len(free)
        assert not set(free) & set(entries.tolist()), "a page is both free and held"
        cached = [p for p in self.cache.pages if self.pool.ref_counts[p] == 0]
        used = int(np.count_nonzero(self.pool.ref_counts))
        assert (len(free) - len(cached)) + len(cached) + used == NUM_PAGES - 1
        assert set(cached) <= set(free)

    @invariant()
    def cached_pages_hold_their_tokens(self):
        for p in self.cache.pages:
            e = self.cache._by_page[p]
            assert self.content[p].tolist() == list(e.tokens), p

    @invariant()
    def slots_hold_their_tokens(self):
        for s in range(MAX_SEQS):
            for pos, t in enumerate(self.tokens[s]):
                page = self.pool.block_tables[s, pos // PAGE]
                assert page != ps.NULL_PAGE or pos <= len(self.tokens[s]) - WINDOW, (s, pos)
                if page != ps.NULL_PAGE:
                    assert self.content[page, pos % PAGE] == t


SharingMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSharingMachine = SharingMachine.TestCase


# ------------------------------------------------------------ layer groups

G_WINDOWS = (WINDOW, None)  # a sliding group and a full group (paged_jax.paging.kv_groups), one row each per slot
G, SLOTS = len(G_WINDOWS), 3


class GroupedRowsMachine(RuleBasedStateMachine):
    """The page state of a hybrid model: ``G * SLOTS`` rows, row ``group *
    SLOTS + slot``; every slot operation (grow, fork, free, swap out and
    in) acts on the slot's ``G`` rows as the engine's step does
    (``paged_jax.engine.step._group_rows``), and only the sliding group's rows
    drop pages. After every step: the twin equals the device (free-queue
    order included), a slot's rows hold the same tokens and table positions,
    the full group's rows hold every page, the sliding group's only null
    entries its window no longer sees, reference counts count the entries,
    and each row's pages hold its tokens."""

    def __init__(self):
        super().__init__()
        rows = G * SLOTS
        self.state = ps.init_page_state(num_pages=NUM_PAGES, max_seqs=rows, max_pages_per_seq=MAX_PAGES, page_size=PAGE)
        self.pool = BlockPool(num_pages=NUM_PAGES, max_seqs=rows, max_pages_per_seq=MAX_PAGES, page_size=PAGE)
        self.tokens = [[] for _ in range(SLOTS)]
        self.content = np.full((NUM_PAGES, PAGE), -1)
        self.swapped = []  # (tokens, per group: live mask and contents)

    def _rows(self, slot):
        return [g * SLOTS + slot for g in range(G)]

    def _empty(self):
        return [s for s in range(SLOTS) if not self.tokens[s] and not self.pool.num_seq_pages[s]]

    @rule(data=st.data())
    def extend(self, data):
        num_new = np.array(data.draw(st.lists(st.integers(0, 4), min_size=SLOTS, max_size=SLOTS)))
        num_new = np.minimum(num_new, MAX_PAGES * PAGE - np.array([len(t) for t in self.tokens]))
        new = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=int(n), max_size=int(n))) for n in num_new]
        rows_new = np.tile(num_new, G)
        before = self.state
        state, ok, cow_src, cow_dst = ps.unchecked_extend(self.state, jax.numpy.asarray(rows_new, jax.numpy.int32))
        copies = self.pool.extend(rows_new.astype(np.int64))
        assert bool(ok) == (copies is not None)
        if not ok:
            assert same(state, before)
            return
        self.state = state
        for src, dst in copies:
            self.content[dst] = self.content[src]
        for s in range(SLOTS):
            start = len(self.tokens[s])
            for row in self._rows(s):
                for i, t in enumerate(new[s]):
                    pos = start + i
                    self.content[self.pool.block_tables[row, pos // PAGE], pos % PAGE] = t
            self.tokens[s] += new[s]

    @rule(data=st.data())
    def fork(self, data):
        busy, empty = [s for s in range(SLOTS) if self.tokens[s]], self._empty()
        if not busy or not empty:
            return
        src, dst = data.draw(st.sampled_from(busy)), data.draw(st.sampled_from(empty))
        src_of = np.full(SLOTS, -1, np.int32)
        src_of[dst] = src
        rows_src = _group_rows(jax.numpy.asarray(src_of), G, SLOTS)  # the step's own expansion
        self.state, ok = ps.unchecked_fork_many(self.state, rows_src)
        assert ok
        for a, b in zip(self._rows(src), self._rows(dst)):
            self.pool.fork(a, b)
        self.tokens[dst] = list(self.tokens[src])

    def _free(self, slots):
        mask = np.zeros(G * SLOTS, bool)
        for s in slots:
            mask[self._rows(s)] = True
            for row in self._rows(s):
                self.pool.release(row)
            self.tokens[s] = []
        self.state = ps.free(self.state, jax.numpy.asarray(mask))
        self.pool.flush()

    @rule(data=st.data())
    def free(self, data):
        self._free([s for s in range(SLOTS) if data.draw(st.booleans())])

    @rule(data=st.data())
    def slide(self, data):
        """Some slots' sliding-group rows drop what the window no longer
        sees; the full group's rows never drop."""
        for s in range(SLOTS):
            if data.draw(st.booleans()):
                for g, window in enumerate(G_WINDOWS):
                    if window is not None:
                        first = int(sw.window_first_kept(len(self.tokens[s]), sliding_window=window, page_size=PAGE))
                        self.pool.drop_before(g * SLOTS + s, first)
        self.state = sw.drop_pages_before(self.state, self.pool.first_kept().astype(np.int32))
        self.pool.flush()

    @rule(data=st.data())
    def swap_out(self, data):
        busy = [s for s in range(SLOTS) if self.tokens[s]]
        if not busy:
            return
        s = data.draw(st.sampled_from(busy))
        groups = []
        for row in self._rows(s):
            table = np.array(self.pool.pages(row))
            groups.append((table != ps.NULL_PAGE, self.content[table[table != ps.NULL_PAGE]]))
        self.swapped.append((list(self.tokens[s]), groups))
        self._free([s])

    @rule(data=st.data())
    def swap_in(self, data):
        empty = self._empty()
        if not self.swapped or not empty:
            return
        tokens, groups = self.swapped[-1]
        need = sum(len(c) for _, c in groups)
        if need > self.pool.num_free:
            return
        self.swapped.pop()
        s = data.draw(st.sampled_from(empty))
        fresh = self.pool.take_free(need)
        num_hit = np.zeros(G * SLOTS, np.int32)
        table = np.zeros((G * SLOTS, MAX_PAGES), np.int32)
        lens = np.zeros(G * SLOTS, np.int32)
        for row, (live, content) in zip(self._rows(s), groups):
            mine, fresh = fresh[: len(content)], fresh[len(content):]
            self.content[mine] = content
            pages = np.zeros(len(live), np.int64)
            pages[live] = mine
            num_hit[row], table[row, : len(pages)], lens[row] = len(pages), pages, len(tokens)
            self.pool.share(row, pages.tolist(), len(tokens))
        self.state, ok = ps.unchecked_share(self.state, jax.numpy.asarray(num_hit), jax.numpy.asarray(table),
                                            jax.numpy.asarray(lens))
        assert ok
        self.tokens[s] = tokens

    @invariant()
    def twin_equals_device(self):
        self.pool.check(self.state)

    @invariant()
    def a_slots_rows_agree_and_hold_their_tokens(self):
        held = np.arange(MAX_PAGES)[None, :] < self.pool.num_seq_pages[:, None]
        entries = self.pool.block_tables[held & (self.pool.block_tables != ps.NULL_PAGE)]
        assert np.array_equal(np.bincount(entries, minlength=NUM_PAGES), self.pool.ref_counts)
        for s in range(SLOTS):
            n = len(self.tokens[s])
            rows = self._rows(s)
            assert set(self.pool.seq_lens[rows].tolist()) == {n}
            assert len(set(self.pool.num_seq_pages[rows].tolist())) == 1
            for row, window in zip(rows, G_WINDOWS):
                for pos, t in enumerate(self.tokens[s]):
                    page = self.pool.block_tables[row, pos // PAGE]
                    if page == ps.NULL_PAGE:  # only a sliding group's, only out of its window
                        assert window is not None and pos <= n - window, (row, pos)
                    else:
                        assert self.content[page, pos % PAGE] == t, (row, pos)


GroupedRowsMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestGroupedRowsMachine = GroupedRowsMachine.TestCase
