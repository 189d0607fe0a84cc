"""The host's twin of the device page state, for the scheduler and the prefix cache.

Why a twin. The engine's page state (:class:`paged_jax.paging.page_state.PageState`)
lives on device and changes inside the jitted step. Once pages are shared,
the scheduler needs more than counts: which page ids a sequence holds (to
key full pages in the prefix cache and hand them to later requests), how
many pages a release really frees (a page shared by k sequences is freed
with the last of them), and which growth needs a copy-on-write copy.
Reading the device state back would stall async scheduling (the host plans
call ``i + 1`` before call ``i`` is done), so the host keeps an exact NumPy
twin: the same block tables, reference counts and FIFO free queue, changed
by the same rules in the same order as the device functions in one call
(:func:`~paged_jax.paging.sliding_window.unchecked_drop_pages_before`, then
:func:`~paged_jax.paging.page_state.unchecked_free`, then
:func:`~paged_jax.paging.page_state.unchecked_share`, then
:func:`~paged_jax.paging.page_state.unchecked_extend`, then
:func:`~paged_jax.paging.page_state.unchecked_fork_many`). The engine checks the
device's free count against the twin after every call, and the whole state
with ``Engine(check_page_state=True)`` (the tests do); the hypothesis state
machine in ``tests/test_sharing_state.py`` drives both with random
operations and compares them after each.

Like vLLM v1's ``BlockPool``, the free queue is ordered least recently
freed first and removes a page from its middle in O(1) (a dict keeps
insertion order) when a prefix-cache hit takes a freed page back, and
``on_evict(page)`` is called when a page leaves the free queue for new use,
so the prefix cache forgets what the page held.

Releases are deferred, as on device: :meth:`BlockPool.release` drops the
references at once (the scheduler plans with the new counts) and
:meth:`BlockPool.flush` queues the pages that reached zero in the order
``unchecked_free`` queues them for all the slots freed in one call: slots in
ascending order, each one's pages tail first, a page several of them shared
where its last holder puts it (:func:`paged_jax.paging.free_queue.free_order`).
Pages a sliding window drops (:meth:`BlockPool.drop_before`) are queued
before the released slots' pages, as the device call drops before it
frees (:func:`paged_jax.paging.sliding_window.unchecked_drop_pages_before`).
Tail first is what keeps a prefix cache's chains whole: eviction takes the
least recently freed page, which is then a chain's last page, never its
head, so the pages before it stay reachable (vLLM frees a request's blocks
in reverse for the same reason; SGLang evicts radix-tree leaves first).
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import numpy as np

from paged_jax.checks import check_int
from paged_jax.paging.free_queue import free_order
from paged_jax.paging.page_state import NULL_PAGE, PageState, pages_for_tokens


class BlockPool:
    """Block tables, reference counts and the free queue, on the host.

    Attributes:
      block_tables: i64[max_seqs, max_pages_per_seq] page ids, ``NULL_PAGE``
        where unused.
      seq_lens: i64[max_seqs] tokens per slot.
      num_seq_pages: i64[max_seqs] pages per slot.
      ref_counts: i64[num_pages] slots holding each page.
      on_evict: called with a page id when the page leaves the free queue
        for new use (its content is about to be overwritten).
    """

    def __init__(
        self,
        *,
        num_pages: int,
        max_seqs: int,
        max_pages_per_seq: int,
        page_size: int,
        on_evict: Callable[[int], None] | None = None,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.block_tables = np.full((max_seqs, max_pages_per_seq), NULL_PAGE, np.int64)
        self.seq_lens = np.zeros(max_seqs, np.int64)
        self.num_seq_pages = np.zeros(max_seqs, np.int64)
        self.ref_counts = np.zeros(num_pages, np.int64)
        self._queue: dict[int, None] = dict.fromkeys(range(1, num_pages))
        self._released: set[int] = set()  # reached zero references; queued by flush()
        self._freed: list[tuple[int, list[int]]] = []  # (slot, its pages) released since the last flush
        self._dropped: dict[int, tuple[int, list[int]]] = {}  # slot -> (first kept column, pages dropped)
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Pages with no reference (queued or about to be), cached ones
        included."""
        return len(self._queue) + len(self._released)

    def pages(self, slot: int) -> list[int]:
        """The page ids ``slot`` holds, in logical order."""
        return self.block_tables[slot, : self.num_seq_pages[slot]].tolist()

    def free_pages(self) -> list[int]:
        """Pages with no reference, in the order new allocations take them
        (the released ones after the queued ones, in free order)."""
        return list(self._queue) + self._release_order()

    # ------------------------------------------------------------ changes

    def release(self, slot: int) -> int:
        """Empties ``slot``; its pages lose a reference. Returns how many
        reached zero (they join the free queue at :meth:`flush`)."""
        if self.num_seq_pages[slot]:
            if any(s == slot for s, _ in self._freed):
                raise RuntimeError(f"internal: slot {slot} released twice before one flush")
            self._freed.append((slot, self.pages(slot)))
        freed = self._unref(self.pages(slot))
        self.block_tables[slot] = NULL_PAGE
        self.seq_lens[slot] = 0
        self.num_seq_pages[slot] = 0
        return freed

    def truncate(self, new_lens: dict[int, int], min_pages: dict[int, int] | None = None) -> int:
        """Rewinds each slot ``s`` in ``new_lens`` to ``new_lens[s]`` tokens at
        once, as :func:`paged_jax.paging.page_state.unchecked_truncate` does on
        device in a call of its own: a slot keeps ``max(ceil(new_len /
        page_size), min_pages[s])`` of its pages, the pages past them lose a
        reference, and those that reach zero join the free queue now, slots
        in ascending order, each slot's tail first. Pages released before
        (queued at :meth:`flush`) stay behind them, as the device frees
        them in its next call; so does a page this rollback drops whose
        other holder was released before (on device that holder still
        holds it until the next call frees it).

        Returns:
          pages that reached zero references.

        Raises:
          ValueError: a new length negative or above the slot's length (the
            pool is then unchanged).
        """
        min_pages = min_pages or {}
        bad = {s: n for s, n in new_lens.items() if not 0 <= n <= self.seq_lens[s]}
        if bad:
            raise ValueError(f"new_lens must be in [0, seq_lens] (a rollback never grows a slot), got {bad} for "
                             f"lengths {[int(self.seq_lens[s]) for s in bad]}")
        dropped = []
        for s in sorted(new_lens):
            held = int(self.num_seq_pages[s])
            keep = min(max(pages_for_tokens(new_lens[s], self.page_size), min_pages.get(s, 0)), held)
            dropped.append([p for p in self.block_tables[s, keep:held].tolist() if p != NULL_PAGE])
            self.block_tables[s, keep:] = NULL_PAGE
            self.num_seq_pages[s] = keep
            self.seq_lens[s] = new_lens[s]
        entries = collections.Counter(p for pages in dropped for p in pages)  # a shared page: one per holder
        # A page a released slot still holds on device (freed by the next call) reaches zero there, not now.
        pending = {p for _, pages in self._freed for p in pages} | {p for _, pages in self._dropped.values()
                                                                     for p in pages}
        freed = 0
        for p in free_order(dropped):
            self.ref_counts[p] -= entries[p]
            if self.ref_counts[p] == 0:
                if p in pending:
                    self._released.add(p)
                else:
                    self._queue[p] = None
                freed += 1
        return freed

    def drop_before(self, slot: int, first_kept: int) -> tuple[int, int]:
        """Drops ``slot``'s pages at columns below ``first_kept`` (a
        sliding window's, see :mod:`paged_jax.paging.sliding_window`): their
        entries become ``NULL_PAGE`` and they lose a reference. Pages that
        reach zero are queued at :meth:`flush`, before the released slots'
        pages.

        Returns:
          ``(dropped, freed)``: entries dropped now, and pages of them that
          reached zero. Dropped entries form a leading run, so when column
          ``first_kept - 1`` is already null nothing is scanned: ``(0, 0)``.
        """
        slot = check_int("slot", slot, 0)
        first_kept = check_int("first_kept", first_kept, 0)
        if slot >= len(self.seq_lens):
            raise ValueError(f"slot must be in [0, {len(self.seq_lens)}), got slot={slot}")
        n = min(first_kept, int(self.num_seq_pages[slot]))
        if n == 0 or self.block_tables[slot, n - 1] == NULL_PAGE:
            return 0, 0
        row = self.block_tables[slot, :n]
        pages = row[row != NULL_PAGE].tolist()
        if slot in self._dropped:  # the device drops once per call
            raise RuntimeError(f"internal: slot {slot} dropped pages twice before one flush")
        self._dropped[slot] = (n, pages)
        self.block_tables[slot, :n] = NULL_PAGE
        return len(pages), self._unref(pages)

    def first_kept(self) -> np.ndarray:
        """i64[max_seqs] the columns each slot drops below in the next call
        (0: none), for :func:`paged_jax.paging.sliding_window.unchecked_drop_pages_before`."""
        out = np.zeros(len(self.seq_lens), np.int64)
        for slot, (n, _) in self._dropped.items():
            out[slot] = n
        return out

    def _unref(self, pages: list[int]) -> int:
        """Drops a reference from each non-null page; returns how many
        reached zero (released, queued at :meth:`flush`)."""
        freed = 0
        for p in pages:
            if p == NULL_PAGE:
                continue
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self._released.add(p)
                freed += 1
        return freed

    def _release_order(self) -> list[int]:
        """The released pages in the order the device queues them: the
        dropped pages (slots ascending), then the freed slots' pages."""
        dropped = [pages for _, (_, pages) in sorted(self._dropped.items())]
        freed = [[p for p in pages if p != NULL_PAGE] for _, pages in sorted(self._freed, key=lambda e: e[0])]
        order = free_order(dropped) + free_order(freed)
        last = {p: i for i, p in enumerate(order)}  # a page dropped here and freed there goes where it is freed
        return [p for i, p in enumerate(order) if last[p] == i and p in self._released]

    def flush(self) -> None:
        """Queues the released pages in the device's order."""
        for p in self._release_order():
            self._queue[p] = None
        self._released.clear()
        self._freed.clear()
        self._dropped.clear()

    def share(self, slot: int, pages: Sequence[int], num_tokens: int | None = None) -> int:
        """Gives empty ``slot`` ``pages`` holding ``num_tokens`` tokens
        (default: full pages), as ``unchecked_share``: a prefix-cache hit,
        or a swap-in into pages from :meth:`take_free`. Returns how many
        left the free queue here (pages with no reference that
        :meth:`take_free` did not already take)."""
        taken = 0
        for p in pages:
            if p == NULL_PAGE:  # a page a sliding window dropped
                continue
            if self.ref_counts[p] == 0:
                if p in self._released:
                    self._released.remove(p)
                    taken += 1
                elif p in self._queue:
                    del self._queue[p]
                    taken += 1
            self.ref_counts[p] += 1
        self.block_tables[slot, : len(pages)] = pages
        self.num_seq_pages[slot] = len(pages)
        self.seq_lens[slot] = len(pages) * self.page_size if num_tokens is None else num_tokens
        return taken

    def append_full_pages(self, slot: int, pages: Sequence[int]) -> None:
        """Appends ``pages`` (from :meth:`take_free`) to ``slot``'s table
        as full pages, as ``unchecked_share`` gives a slot its hits and then
        these in one list."""
        n = int(self.num_seq_pages[slot])
        self.ref_counts[list(pages)] += 1
        self.block_tables[slot, n : n + len(pages)] = pages
        self.num_seq_pages[slot] = n + len(pages)
        self.seq_lens[slot] = (n + len(pages)) * self.page_size

    def take_free(self, count: int) -> list[int]:
        """Takes ``count`` pages off the free queue's head for new content
        (evicting what the prefix cache kept in them), to be given to slots
        by :meth:`share` in the same call. The pages released since the
        last call are queued first (:meth:`flush`): the call frees them
        before it shares, and no release may follow in the same call."""
        self.flush()
        if count > len(self._queue):
            raise RuntimeError(f"block pool short: {count} pages wanted, {len(self._queue)} queued")
        return [self._pop() for _ in range(count)]

    def _pop(self) -> int:
        page = next(iter(self._queue))
        del self._queue[page]
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def cow_needed(self, slot: int) -> bool:
        """Whether ``slot``'s next token lands in a page another slot holds
        (a copy-on-write copy, unless every other holder also grows in the
        same call: then the last in slot order keeps the page)."""
        idx = self.seq_lens[slot] // self.page_size
        return bool(idx < self.num_seq_pages[slot] and self.ref_counts[self.block_tables[slot, idx]] > 1)

    def extend(self, num_new: np.ndarray, min_pages: np.ndarray | int = 0) -> list[tuple[int, int]] | None:
        """Grows slot ``s`` by ``num_new[s]`` tokens, as ``unchecked_extend``:
        released pages are queued (:meth:`flush`), then slots in ascending
        order take pages off the queue's head, a copy-on-write copy first.
        A grown slot holds at least ``min_pages[s]`` pages afterwards
        (``min_pages``: i32[max_seqs] or one int for all; a reservation).

        Returns:
          the ``(src, dst)`` page copies; ``None``, with nothing changed, when
          ``unchecked_extend`` would refuse (the pool is short, a sequence
          would pass ``max_pages_per_seq`` pages, a negative count).
        """
        if (num_new < 0).any():
            return None
        self.flush()
        active = np.flatnonzero(num_new > 0)
        idx = self.seq_lens[active] // self.page_size
        has_page = idx < self.num_seq_pages[active]
        cur = self.block_tables[active, np.minimum(idx, self.max_pages_per_seq - 1)]
        shared = has_page & (self.ref_counts[cur] > 1)
        cow = np.zeros(len(active), bool)
        for i in range(len(active)):  # an earlier sharer copies; the last one keeps the page
            earlier = int(np.sum(shared[:i] & (cur[:i] == cur[i])))
            cow[i] = shared[i] and self.ref_counts[cur[i]] - earlier > 1
        floor = np.broadcast_to(np.asarray(min_pages), num_new.shape)[active]
        want = np.maximum(pages_for_tokens(self.seq_lens[active] + num_new[active], self.page_size), floor)
        grow = np.maximum(want - self.num_seq_pages[active], 0)
        if int(grow.sum() + cow.sum()) > len(self._queue) or (self.num_seq_pages[active] + grow > self.max_pages_per_seq).any():
            return None
        copies = []
        before = self.ref_counts.copy()
        for i, s in enumerate(active):
            if cow[i]:
                dst = self._pop()
                self.ref_counts[dst] += 1
                self.ref_counts[cur[i]] -= 1
                self.block_tables[s, idx[i]] = dst
                copies.append((int(cur[i]), dst))
            for _ in range(int(grow[i])):
                page = self._pop()
                self.ref_counts[page] += 1
                self.block_tables[s, self.num_seq_pages[s]] = page
                self.num_seq_pages[s] += 1
            self.seq_lens[s] += num_new[s]
        assert (self.ref_counts[before > 0] > 0).all()  # a copy never frees the original
        return copies

    def fork(self, src: int, dst: int) -> None:
        """Empty ``dst`` shares ``src``'s tokens, as ``unchecked_fork_many``."""
        n = pages_for_tokens(int(self.seq_lens[src]), self.page_size)
        pages = self.block_tables[src, :n]
        self.ref_counts[pages[pages != NULL_PAGE]] += 1
        self.block_tables[dst, :n] = pages
        self.block_tables[dst, n:] = NULL_PAGE
        self.num_seq_pages[dst] = n
        self.seq_lens[dst] = self.seq_lens[src]

    # -------------------------------------------------------------- check

    def check(self, state: PageState) -> None:
        """Raises RuntimeError naming the first field where the device's
        page state (read back) differs from this twin."""
        dev = {
            "block_tables": np.asarray(state.block_tables),
            "seq_lens": np.asarray(state.seq_lens),
            "num_seq_pages": np.asarray(state.num_seq_pages),
            "ref_counts": np.asarray(state.ref_counts),
        }
        for name, value in dev.items():
            mine = getattr(self, name)
            if not np.array_equal(value, mine):
                where = np.argwhere(value != mine)[:4].tolist()
                raise RuntimeError(f"page state and host twin differ in {name} at {where}")
        cap = state.free_queue.shape[0]
        head, n = int(state.free_head), int(state.num_free_pages)
        queue = np.asarray(state.free_queue)[(head + np.arange(n)) % cap].tolist()
        if self._released:
            raise RuntimeError("host twin has unflushed releases; compare after flush()")
        if queue != list(self._queue):
            raise RuntimeError(f"free queues differ: device {queue[:8]}..., host {list(self._queue)[:8]}...")
