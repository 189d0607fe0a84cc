"""The KV-cache manager: who holds which page, what the prefix cache keeps,
what is swapped out, and what each scheduling decision costs in pages.

The scheduler (:mod:`paged_jax.engine.scheduler`) owns the queues and the policy
and asks this module for costs (pages to admit a group, pages to grow a
sequence by ``n`` tokens, whether a grown sequence's last page is full);
it never reads block tables or reference counts. This module owns:

- the device page state and KV pool (:mod:`paged_jax.paging.page_state`,
  :class:`paged_jax.paging.kv_cache.KVPool`), which one jitted call per iteration
  changes (:func:`paged_jax.engine.step.device_step`);
- the host's exact twin of the page state
  (:class:`paged_jax.paging.block_pool.BlockPool`, "Why a twin");
- the plan of the round being scheduled: free pages once it is done, pages
  per slot, slots to free, pages each admitted slot takes in the next call,
  pages each growing slot holds at least (its reservation);
- the prefix cache (:mod:`paged_jax.paging.prefix_cache`) and the swap space
  (:mod:`paged_jax.paging.swap`).

Same-step prefix sharing. An admitted sequence whose prompt chunk fills
whole pages in the next call takes those pages at admission (off the free
queue's head, as a swap-in does) and offers them to the prefix cache at
once, so a request admitted after it in the same round takes them as a hit:
each layer writes the call's K/V into the pages before it attends
(``models.llama``), so the second request reads what the first writes in
the same call, and the shared prefix is computed once (vLLM v1 caches
blocks when it allocates them). In the page state the first sequence then
holds those pages ahead of its length: the call shares them with it
(:func:`paged_jax.paging.page_state.unchecked_share`, their tokens counted) and
grows it only by the rest of its chunk.

Sliding windows. When every layer of the model attends only the last
``W`` tokens (``sliding_window``), a running sequence's pages that no
query can see again leave its block table at the start of each round
(:mod:`paged_jax.paging.sliding_window`; the next call drops them on device
before anything grows, so this round's growth may take them). Costs count
table positions as before; the dropped pages simply join the free count.
A swapped-out sequence copies only its live pages and gets its null
entries back at swap-in; a fork shares the nulls; the prefix cache never
keys a dropped page.

Layer groups. A model that mixes sliding and full layers (Gemma 2 / 3,
gpt-oss) has a block table per layer group (:mod:`paged_jax.paging.kv_groups`
says why one pool with per-group tables, vLLM v1's hybrid layout): the
page state has ``G * S`` rows, row ``group * S + slot``, and every
operation on a slot is the same operation on its ``G`` rows (free, share,
grow, fork), so the rows of a slot always hold the same tokens and the
same table positions. Each sliding group's rows drop the pages before its
own window at the round's start; the full groups' rows never drop. Costs
are sums over the rows: growing a sequence by ``n`` tokens takes each
group's new pages (a sliding group's growth offset by what it dropped at
the round's start), and admitting one counts, per sliding group, only the
pages its window holds once its known tokens are computed (the pages its
chunked prefill holds for a while beyond them are checked round by round,
like any growth, with preemption when the pool is short). Swapping copies
each group's live pages; a fork (parallel samples, beams) forks all ``G``
rows. Prefix caching keeps each group's pages under its own keys, and a
hit has one length in every group: a full group's pages up to it, a
sliding group's only those its window still sees, null before them
(:meth:`paged_jax.paging.prefix_cache.PrefixCache.longest_hit`). What ``G > 1``
does not do: same-step prefix sharing (a request hits only pages a call
already dispatched computes) and reservation policies other than
``"paged"`` (refused by name).

Tiers. With a host tier (``host_cache_bytes``,
:mod:`paged_jax.tiers.offload`), a cached page the pool hands out for new
content is copied to host memory first: the pages a round evicts are
recorded as they leave (:meth:`KVCacheManager._evict`) and copied in one
gather before the round's call, or before a scatter into the pool, is
dispatched (:meth:`KVCacheManager._spill`). With a disk tier, every page
the prefix cache takes is copied there once the call that computes it is
dispatched (:meth:`KVCacheManager.store_cached`). An admission's device hit
is continued into the host tier, then the disk tier; those pages are new
pages in its cost (as prefilled ones would be), loaded into fresh pages at
admission, cached on device again, and handed to the row with its device
hit in the next call, computed. A KV connector
(:mod:`paged_jax.tiers.connector`) is the last tier: a producer is offered
every page once computed, as the disk tier is; a consumer's lookup
continues the run into another engine's pages. One layer group of full
attention only (refused by name otherwise).

Reservations. Under a reservation policy other than ``"paged"``
(:mod:`paged_jax.engine.config`) a sequence holds pages for
:func:`paged_jax.engine.config.reserved_tokens` tokens from its admission on: every
cost here counts them, and the call that first grows it takes them
(``min_pages``, per slot, in :class:`CallPages`). A sequence swapped out
copies only the pages holding its tokens and takes its reservation again
when it is swapped in. The paper's Orca shares nothing (section 6.3: each
sample or beam holds a reservation of its own, prompt included), so the
free pages the scheduler sees count every sequence's pages as its own
(:meth:`KVCacheManager.orca_copies`): on device a fork still shares its
parent's pages (the same programs run under every policy), but the
scheduler counts a copy of each page for each extra holder, and a
request's samples and beams still to come hold their reservations from
the request's admission on. With a contiguous allocator
(``EngineConfig.allocator``, :mod:`paged_jax.paging.contiguous`) each of
those reservations is also one run in the allocator, placed at the group's
admission (an admission whose runs do not fit waits, though the pages
would) and given back with its row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_int
from paged_jax.engine.config import reserved_tokens
from paged_jax.engine.sequence import Sequence, SequenceGroup
from paged_jax.engine.stats import EngineStats
from paged_jax.paging import page_state as ps
from paged_jax.paging.block_pool import BlockPool
from paged_jax.paging.contiguous import ALLOCATORS, HeldRuns, make_allocator
from paged_jax.paging.kv_cache import KVPool
from paged_jax.paging.kv_groups import KVGroups, single_group
from paged_jax.paging.prefix_cache import PrefixCache, chain_keys
from paged_jax.paging.sliding_window import drop_pages_before, window_first_kept
from paged_jax.paging.swap import SwappedGroup, SwapSpace, gather_pages, scatter_pages
from paged_jax.tiers.connector import KVConnector
from paged_jax.tiers.disk import DiskTier
from paged_jax.tiers.host import HostTier
from paged_jax.tiers.offload import Offload, TierRun


@dataclasses.dataclass(frozen=True)
class Admission:
    """What admitting a waiting group costs, and what it takes.

    Attributes:
      cost: pages it takes off the free queue, its sequences' growth to
        their known tokens included (and, from swap, a copy-on-write copy
        each at most).
      hits: per member, per layer group, the cached pages that hold its
        first tokens (``NULL_PAGE`` where a sliding window needs none;
        empty lists when swapped).
      swapped: its pages in the swap space, or None.
      members: the group's live sequences it admits.
      computed: per member, the tokens whose K/V it has once admitted.
      tiers: per member, the host and disk tiers' pages that continue its
        device hit (loaded into fresh pages at admission, counted in
        ``cost``); empty runs without tiers.
    """

    cost: int
    hits: list[list[int]]
    swapped: SwappedGroup | None
    members: list[Sequence]
    computed: list[int]
    tiers: list[TierRun] = dataclasses.field(default_factory=list)

    @property
    def first_chunk(self) -> int:
        """Tokens its first sequence still has to compute."""
        return self.members[0].num_tokens - self.computed[0]


@dataclasses.dataclass(frozen=True)
class CallPages:
    """The page-state part of the next call's inputs (numpy; ``S``
    sequence slots, ``G * S`` page-state rows, row ``group * S + slot``;
    ``M`` = most pages per sequence).

    Attributes:
      free_mask: bool[G * S] rows to free first.
      num_hit: i32[G * S] pages an empty row takes (prefix hit, swap-in or
        same-step pages).
      hit_pages: i32[G * S, M] their ids.
      hit_tokens: i32[G * S] tokens the row then holds.
      ahead: i32[S] of those tokens, how many the call itself computes
        (same-step pages): the slot grows by its chunk less these.
      min_pages: i32[G * S] pages a row the call grows holds afterwards at
        least (its reservation; 0 when paging on demand).
      first_kept: i32[G * S] block-table columns each row drops below first
        (a sliding window's, :mod:`paged_jax.paging.sliding_window`; 0 none).
    """

    free_mask: np.ndarray
    num_hit: np.ndarray
    hit_pages: np.ndarray
    hit_tokens: np.ndarray
    ahead: np.ndarray
    min_pages: np.ndarray
    first_kept: np.ndarray


class KVCacheManager:
    """Pages for the engine's sequences (see the module docstring).

    Args:
      kv_pool: the KV pool; its ``num_pages`` and ``page_size`` define the
        page state. Owned from now on (each call donates it).
      max_seqs: page-state rows.
      max_seq_len: most tokens per sequence.
      reservation: the reservation policy (``EngineConfig.reservation``):
        every sequence holds pages for
        :func:`paged_jax.engine.config.reserved_tokens` tokens from admission on.
      enable_prefix_caching: keep full pages keyed by their tokens.
      swap_space_pages: pages the swap space holds.
      stats: counters it adds to.
      sliding_window: tokens every layer of the model attends (its pages
        out of that window are dropped while sequences run), or None when
        some layer attends everything; ignored when ``groups`` is given.
      groups: the layer groups, one block table each (module docstring;
        :func:`paged_jax.engine.step.engine_kv_groups`); default one group of
        the pool's layers attending ``sliding_window``.
      max_num_batched_tokens: tokens one call computes at most (a first
        chunk's bound, for admission costs with several groups); default
        ``max_seq_len``.
      allocator: under a reservation policy, "buddy" or "first_fit" places
        each reservation as one contiguous run too
        (:mod:`paged_jax.paging.contiguous`); None or "pages": none.
      host_cache_bytes: bytes of K/V the prefix cache's host tier holds
        (:mod:`paged_jax.tiers.offload`: pages the pool evicts are kept
        there, a hit that runs on into them loads them back); 0: none.
      disk: the prefix cache's disk tier (every cached page stored there
        once computed, :mod:`paged_jax.tiers.disk`), or None.
      connector: a KV connector to another engine
        (:mod:`paged_jax.tiers.connector`: a producer is offered every
        cached page once computed, a consumer's lookup continues a hit
        past the other tiers), or None.

    Raises:
      ValueError: ``groups`` whose ``group_size`` is not the pool's layer
        count; several groups with a ``reservation`` other than "paged"; a
        ``host_cache_bytes`` below 0; a host or disk tier without prefix
        caching or with a sliding window.
    """

    def __init__(self, kv_pool: KVPool, *, max_seqs: int, max_seq_len: int, reservation: str,
                 enable_prefix_caching: bool, swap_space_pages: int, stats: EngineStats,
                 sliding_window: int | None = None, groups: KVGroups | None = None,
                 max_num_batched_tokens: int | None = None, allocator: str | None = None,
                 host_cache_bytes: int = 0, disk: DiskTier | None = None, connector: KVConnector | None = None):
        self.kv = kv_pool
        self.max_num_batched_tokens = max_seq_len if max_num_batched_tokens is None else check_int(
            "max_num_batched_tokens", max_num_batched_tokens)
        if groups is None:
            groups = single_group(kv_pool.num_layers, None if sliding_window is None else
                                  check_int("sliding_window", sliding_window))
        if groups.group_size != kv_pool.num_layers:
            raise ValueError(f"groups.group_size={groups.group_size} must equal the pool's {kv_pool.num_layers} layers")
        if groups.num_groups > 1 and reservation != "paged":
            raise ValueError(f"reservation={reservation!r} with {groups.num_groups} layer groups: reservation "
                             "policies serve models with one kind of layer only; use 'paged'")
        self.groups = groups
        self.sliding_window = groups.uniform_window  # the window every layer attends, if one group
        self.num_slots = max_seqs
        rows = groups.num_groups * max_seqs  # page-state rows: group * max_seqs + slot
        self.page_size = L = kv_pool.page_size
        self.max_seq_len = max_seq_len
        self.max_pages_per_seq = ps.pages_for_tokens(max_seq_len, L)
        self.reservation = reservation
        self.state = ps.init_page_state(num_pages=kv_pool.num_pages, max_seqs=rows,
                                        max_pages_per_seq=self.max_pages_per_seq, page_size=L)
        self.prefix_cache = PrefixCache(L) if enable_prefix_caching else None
        self.offload = None  # the tiers' traffic (module docstring, "Tiers")
        if check_int("host_cache_bytes", host_cache_bytes, 0) or disk is not None or connector is not None:
            what = (f"host_cache_bytes={host_cache_bytes}" if host_cache_bytes else
                    f"the disk tier in {disk.root}" if disk is not None else f"a KV {connector.role}")
            if self.prefix_cache is None:
                raise ValueError(f"{what} needs prefix caching (the tiers keep the prefix cache's pages); turn "
                                 "enable_prefix_caching on")
            if groups.num_groups > 1 or groups.windows[0] is not None:
                raise ValueError(f"{what}: the KV tiers serve models whose layers all attend every token; this one "
                                 f"has sliding windows {list(groups.windows)}")
            self.offload = Offload(HostTier(host_cache_bytes, L) if host_cache_bytes else None, disk, stats.host,
                                   stats.disk, connector, stats.remote)
        self.pool = BlockPool(num_pages=kv_pool.num_pages, max_seqs=rows, max_pages_per_seq=self.max_pages_per_seq,
                              page_size=L, on_evict=self._evict if self.prefix_cache is not None else None)
        self.swap = SwapSpace(swap_space_pages)
        self.stats = stats
        self.num_free = kv_pool.num_pages - 1  # free pages once this round's plan is done
        self._held = np.zeros(rows, np.int64)  # pages (table positions) per row once this round's plan is done
        self._to_free = np.zeros(rows, bool)  # freed by the next call
        self._min_pages = np.zeros(rows, np.int32)  # pages each row the next call grows holds at least
        self._first_kept = np.zeros(rows, np.int32)  # columns each row drops below in the next call
        self._hits: dict[int, tuple[list[int], int, int]] = {}  # row -> (pages, tokens, tokens ahead), next call
        self._reserving: dict[SequenceGroup, int] = {}  # reservation policies: admitted group -> pages per sequence
        # Pages a KV connector sent, while they are cached under the key they came with: page -> chain key.
        self._from_remote: dict[int, bytes] = {}
        self.runs = (HeldRuns(make_allocator(allocator, kv_pool.num_pages - 1))
                     if reservation != "paged" and allocator in ALLOCATORS else None)

    def rows(self, seq: Sequence) -> list[int]:
        """``seq``'s page-state rows, one per layer group."""
        return self.groups.rows(seq.slot, self.num_slots)

    def _evict(self, page: int) -> None:
        """``page`` leaves the free queue for new content: the prefix cache
        forgets it, and the host tier, if any, is to keep a copy."""
        if self.offload is not None:
            entry = self.prefix_cache.entry(page)
            if entry is not None:
                self.offload.note_evicted(page, entry)
        self.prefix_cache.evict(page)

    def _spill(self) -> None:
        """Dispatches the copy of the pages evicted since the last one to
        the tiers; called before anything that overwrites them is
        dispatched (a call, a scatter into the pool)."""
        if self.offload is not None:
            self.offload.dispatch(self.kv)

    def _cached(self, page: int) -> None:
        """The prefix cache took ``page``: the disk tier and a KV producer,
        if any, are to store it once computed (:meth:`store_cached`)."""
        if self.offload is not None:
            self.offload.note_cached(page, self.prefix_cache.entry(page))

    def store_cached(self) -> None:
        """Dispatches the copy of the pages cached this round to the disk
        tier and a KV producer's store; called right after the call that computes them is
        dispatched."""
        if self.offload is not None:
            self.offload.dispatch(self.kv, computed=True)

    def clear_cache(self) -> int:
        """Forgets every cached page in every tier (their K/V are stale;
        the disk tier's files of this model deleted). Returns the device
        pages forgotten."""
        if self.offload is not None:
            self.offload.clear()
        if self.prefix_cache is None:
            return 0
        n = len(self.prefix_cache)
        self.prefix_cache.clear()
        return n

    # -------------------------------------------------------------- costs

    def reserved_pages(self, seq: Sequence) -> int:
        """Pages ``seq`` holds from admission on, however short it is (0
        when paging on demand)."""
        tokens = reserved_tokens(self.reservation, seq.num_prompt, seq.request.max_new_tokens, self.max_seq_len)
        return ps.pages_for_tokens(tokens, self.page_size)

    def pages_for(self, seq: Sequence, num_tokens: int) -> int:
        """Pages ``seq`` holds once it has ``num_tokens`` tokens (its
        reservation included)."""
        return max(ps.pages_for_tokens(num_tokens, self.page_size), self.reserved_pages(seq))

    def grow_cost(self, seq: Sequence, n: int) -> int:
        """Pages running ``seq`` takes to compute ``n`` more tokens, summed
        over its layer groups (a copy-on-write copy counted when its next
        token lands in a shared page)."""
        return sum(self._row_growth(seq, row, n, cow=True) for row in self.rows(seq))

    def _row_growth(self, seq: Sequence, row: int, n: int, *, cow: bool) -> int:
        """Pages ``row`` (of ``seq``) takes to hold ``n`` more tokens than
        it holds once this round's plan is done (under a reservation policy
        a copy-on-write copy is counted already, :meth:`orca_copies`)."""
        copy = cow and self.reservation == "paged" and self.pool.cow_needed(row)
        return self.pages_for(seq, seq.num_computed + n) - int(self._held[row]) + copy

    def fills_page(self, seq: Sequence, n: int) -> bool:
        """After ``n`` more tokens, ``seq``'s pages are full (its next token
        needs a new page)."""
        return seq.num_computed + n >= self._held[seq.slot] * self.page_size

    def admission(self, group: SequenceGroup, members: list[Sequence]) -> Admission:
        """What admitting ``members`` (a waiting group's live sequences)
        costs now."""
        swapped = self.swap.get(group)
        G = self.groups.num_groups
        if swapped is not None:  # each member's table: its G groups' tables one after the other
            rows = [swapped.tables[s.index] for s in members]
            if self.reservation != "paged":  # each member its own copy, grown to its reservation (no copy to come)
                cost = sum(G * self.pages_for(s, s.num_tokens) for s in members) + self._children_pages(group, members)
            else:
                cost = len(set().union(*rows) - {-1}) + sum(G * (self.pages_for(s, s.num_tokens) + 1) - len(r)
                                                             for s, r in zip(members, rows))
            return Admission(cost=cost, hits=[[[]] * G for _ in members], swapped=swapped, members=members,
                             computed=[swapped.num_tokens[s.index] for s in members])
        hits = [self._lookup(s) for s in members]
        tiers = [self._tier_lookup(s, len(h[0])) for s, h in zip(members, hits)]
        # A tier hit's pages are new pages in the pool: counted by _known_pages past the device hit.
        if self.reservation != "paged":  # Orca shares nothing: a hit saves compute, not pages
            cost = sum(self._known_pages(s) for s in members) + self._children_pages(group, members)
        else:
            new_pages = sum(self._known_pages(s, len(h[0])) for s, h in zip(members, hits))
            taken = set().union(*(pages for h in hits for pages in h)) - {ps.NULL_PAGE}
            cost = new_pages + sum(1 for p in taken if self.pool.ref_counts[p] == 0)
        return Admission(cost=cost, hits=hits, swapped=None, members=members,
                         computed=[(len(h[0]) + len(x)) * self.page_size for h, x in zip(hits, tiers)], tiers=tiers)

    def runs_fit(self, group: SequenceGroup, members: list[Sequence]) -> bool:
        """Whether admitting ``members`` could place its runs now (always,
        without a contiguous allocator)."""
        return self.runs is None or self.runs.fits(self._run_sizes(group, members))

    def _run_sizes(self, group: SequenceGroup, members: list[Sequence]) -> list[int]:
        """Pages of each run admitting ``members`` places: each member's, then
        each sample's or beam's to come."""
        return ([self.pages_for(s, s.num_tokens) for s in members]
                + [self.reserved_pages(members[0])] * group.spare_slots)

    def external_fragmentation(self) -> tuple[int, int]:
        """(pages free in the contiguous allocator, pages of its longest free
        run); (0, 0) without one."""
        if self.runs is None:
            return 0, 0
        return self.runs.allocator.num_free, self.runs.allocator.largest_free()

    def _children_pages(self, group: SequenceGroup, members: list[Sequence]) -> int:
        """Under a reservation policy, the pages a group's samples and beams
        still to come reserve at its admission (Orca holds each sequence's
        reservation from the start); 0 when paging."""
        if self.reservation == "paged":
            return 0
        return group.spare_slots * self.reserved_pages(members[0])

    def orca_copies(self) -> int:
        """Pages the scheduler counts as taken beyond those the pool holds,
        under a reservation policy (0 when paging): a copy of every page
        for each holder past its first (the paper's Orca shares no page:
        forks and prefix hits hold copies), and the rest of the
        reservations of the running groups' samples and beams still to
        come (their child rows: an empty one's whole reservation, a
        parallel sample this call forks its reservation less the parent's
        pages it holds).

        Returns:
          pages (>= 0).
        """
        if self.reservation == "paged":
            return 0
        copies = int(np.maximum(self.pool.ref_counts[1:] - 1, 0).sum())
        to_come = 0
        for group, pages in list(self._reserving.items()):
            if not any(s.running for s in group.live):
                del self._reserving[group]
                continue
            to_come += sum(max(pages - int(self.pool.num_seq_pages[r]), 0) for r in group.child_slots)
        return copies + to_come

    def _known_pages(self, seq: Sequence, hit: int = 0) -> int:
        """New pages admitting ``seq`` costs after a prefix hit of ``hit``
        pages, summed over its groups: a full group's pages for its known
        tokens past the hit; with several groups, a sliding group's the
        more of the new pages its window still sees once they are computed
        and the new pages of its first chunk (at most
        ``max_num_batched_tokens`` tokens past the hit, taken whole before
        the next round drops any), so the first call's growth always
        fits."""
        n = len(seq.tokens)
        total = self.pages_for(seq, n) - hit
        if self.groups.num_groups == 1:
            return total
        L = self.page_size
        first_chunk = ps.pages_for_tokens(min(n, hit * L + self.max_num_batched_tokens), L) - hit
        kept = [0 if w is None else max(int(window_first_kept(n, sliding_window=w, page_size=L)) - hit, 0)
                for w in self.groups.windows]
        return sum(total if w is None else max(first_chunk, total - k) for w, k in zip(self.groups.windows, kept))

    def _lookup(self, seq: Sequence) -> list[list[int]]:
        """Per layer group, the cached pages holding ``seq``'s first tokens
        (:meth:`paged_jax.paging.prefix_cache.PrefixCache.longest_hit`), never
        all of them: its last token is always computed, so there are
        logits to sample. Empty for a request asking for prompt
        log-probs."""
        # Prompt log-probs need logits at every prompt position, so such a request computes its whole prompt: a
        # hit would leave the tokens it covers unscored. vLLM v1 skips the lookup for it too
        # (vllm/v1/core/kv_cache_manager.py, KVCacheManager.get_computed_blocks: "We skip finding the prefix cache
        # hit when ... the request requires prompt logprobs"). Its own pages are still offered to the cache.
        if self.prefix_cache is None or seq.request.sampling.prompt_logprobs is not None:
            return [[] for _ in self.groups.windows]
        chain_keys(seq.tokens, self.page_size, seq.extra_key, seq.keys)
        return self.prefix_cache.longest_hit(seq.tokens, seq.keys, seq.extra_key,
                                             (len(seq.tokens) - 1) // self.page_size, self.groups.windows)

    def _tier_lookup(self, seq: Sequence, start: int) -> TierRun:
        """The host and disk tiers' pages continuing ``seq``'s device hit
        of ``start`` pages (none without tiers, or for a request whose
        lookup :meth:`_lookup` skips)."""
        if self.offload is None or seq.request.sampling.prompt_logprobs is not None:
            return TierRun()
        return self.offload.lookup(seq.tokens, seq.keys, seq.extra_key, start,
                                   (len(seq.tokens) - 1) // self.page_size)

    # ------------------------------------------------------------ actions

    def slide(self, running: list[Sequence]) -> None:
        """Drops the pages ``running`` sequences' windows no longer see
        (nothing without a ``sliding_window``); they count as free from now
        on, and the next call drops them on device first."""
        if not running:
            return
        computed = np.array([seq.num_computed for seq in running], np.int64)
        for g, window in enumerate(self.groups.windows):
            if window is None:  # a full group keeps every page
                continue
            firsts = window_first_kept(computed, sliding_window=window, page_size=self.page_size)
            for seq, first in zip(running, firsts.tolist()):
                row = g * self.num_slots + seq.slot
                dropped, freed = self.pool.drop_before(row, first) if first else (0, 0)
                if dropped:  # only a row with new entries to drop costs the device call any work
                    self._first_kept[row] = first
                self.num_free += freed
                self.stats.window_dropped_pages += freed

    def reserve(self, seq: Sequence, n: int) -> None:
        """Plans ``n`` more tokens for running ``seq`` in the next call."""
        reserved = self.reserved_pages(seq)
        for row in self.rows(seq):
            need = self._row_growth(seq, row, n, cow=True)
            self.num_free -= need
            self._held[row] += need
            self._min_pages[row] = reserved

    def admit(self, group: SequenceGroup, adm: Admission, chunks: list[int]) -> None:
        """Gives the admitted members (now holding slots) their pages: back
        from the swap space, or their prefix hits and the pages their first
        chunk fills (same-step sharing); then plans ``chunks[i]`` tokens for
        member ``i``."""
        members = adm.members
        if self.runs is not None:
            self.runs.place(group, self._run_sizes(group, members))
        if self.reservation != "paged":  # the samples and beams to come hold their reservations from now on
            self._reserving[group] = self.reserved_pages(members[0])
            self.num_free -= self._children_pages(group, members)
        if adm.swapped is not None:
                self.num_free -= adm.cost - self._children_pages(group, members) - len(
                    set().union(*(adm.swapped.tables[s.index] for s in members)) - {-1}) - sum(
                    self.groups.num_groups * (self.pages_for(s, s.num_tokens) + 1) - len(adm.swapped.tables[s.index])
                    for s in members)
        if adm.swapped is not None:
            self.swap.pop(group)
            self._swap_in(members, adm.swapped)
        else:
            # Every member's hits leave the free queue before any page is
            # taken off its head for new content, so none is handed out.
            tiers = adm.tiers or [TierRun() for _ in members]
            for seq, hits, run in zip(members, adm.hits, tiers):
                self._admit_hits(seq, hits, run)
            for seq, run in zip(members, tiers):
                if len(run):
                    self._load_tiers(seq, run)
            if self.prefix_cache is not None and self.groups.num_groups == 1:
                for seq, n in zip(members, chunks):
                    self._take_filled_pages(seq, n)
        for seq, n in zip(members, chunks):
            reserved = self.reserved_pages(seq)
            for row in self.rows(seq):
                self._held[row] = self.pool.num_seq_pages[row]
                need = self._row_growth(seq, row, n, cow=n > 0)
                self.num_free -= need
                self._held[row] += need
                self._min_pages[row] = reserved

    def _admit_hits(self, seq: Sequence, hits: list[list[int]], run: TierRun | None = None) -> None:
        """Gives ``seq``'s rows their prefix hits (one table per group, the
        same length in each); ``run``'s pages more come from the tiers
        (:meth:`_load_tiers`), counted here."""
        st, L = self.stats, self.page_size
        hit_tokens = len(hits[0]) * L
        run = TierRun() if run is None else run
        host_tokens, disk_tokens, remote_tokens = len(run.host) * L, len(run.disk) * L, len(run.remote) * L
        tier_tokens = host_tokens + disk_tokens + remote_tokens
        if seq.group.num_cached_tokens is None:  # first admission
            seq.group.num_cached_tokens = hit_tokens + tier_tokens
            seq.group.num_host_cached_tokens = host_tokens
            seq.group.num_disk_cached_tokens = disk_tokens
            seq.group.num_remote_cached_tokens = remote_tokens
            st.prompt_tokens += seq.num_prompt
            st.prefix_hit_tokens += hit_tokens + tier_tokens
            st.host.hit_tokens += host_tokens
            st.disk.hit_tokens += disk_tokens
            st.remote.hit_tokens += remote_tokens
        else:
            st.recompute_hit_tokens += hit_tokens + tier_tokens
            st.recomputed_tokens += len(seq.tokens) - hit_tokens - tier_tokens
        seq.num_computed = hit_tokens + tier_tokens
        if not hit_tokens:
            return
        if self.offload is not None:
            self.offload.touch(seq.keys[: len(hits[0])])
        for row, pages in zip(self.rows(seq), hits):
            live = [p for p in pages if p != ps.NULL_PAGE]
            st.prefix_hit_pages += len(live)
            st.pages_saved += sum(1 for p in live if self.pool.ref_counts[p] > 0)
            taken = self.pool.share(row, pages, hit_tokens)
            self.num_free -= taken if self.reservation == "paged" else len(live)  # Orca holds a copy of a shared hit
            self._hits[row] = (pages, hit_tokens, 0)
        self._note_remote(seq, hits[0])

    def _load_tiers(self, seq: Sequence, run: TierRun) -> None:
        """Loads ``run``'s pages from the tiers into fresh pages after
        ``seq``'s device hit (one layer group), caches them on device again,
        and gives them to its row for the next call, computed."""
        L = self.page_size
        fresh = self.pool.take_free(len(run))
        self.num_free -= len(fresh)
        self._spill()  # the pages the take evicted leave before the load overwrites them
        self.kv = self.offload.load(self.kv, fresh, run)
        hits, _, _ = self._hits.get(seq.slot, ([], 0, 0))
        self.pool.append_full_pages(seq.slot, fresh)
        table = hits + fresh
        self._hits[seq.slot] = (table, len(table) * L, 0)
        local = len(run.host) + len(run.disk)
        for j, page in enumerate(fresh, start=len(hits)):
            if self.prefix_cache.insert(page, seq.tokens, seq.keys, seq.extra_key, j):
                self._cached(page)
            if j - len(hits) >= local:
                self._from_remote[page] = seq.keys[j]
        self._note_remote(seq, fresh[local:])
        seq.num_keyed = len(table)

    def _take_filled_pages(self, seq: Sequence, n: int) -> None:
        """Same-step sharing: the pages ``seq``'s first chunk of ``n``
        tokens fills are taken now and cached at once (see the module
        docstring)."""
        L = self.page_size
        hits, _, _ = self._hits.get(seq.slot, ([], 0, 0))
        fresh = self.pool.take_free(max(min(seq.num_computed + n, len(seq.tokens)) // L - len(hits), 0))
        if not fresh:
            return
        self.num_free -= len(fresh)
        self.pool.append_full_pages(seq.slot, fresh)
        pages = hits + fresh
        self._hits[seq.slot] = (pages, len(pages) * L, len(fresh) * L)
        chain_keys(seq.tokens, L, seq.extra_key, seq.keys)
        for j, page in enumerate(fresh, start=len(hits)):
            if self.prefix_cache.insert(page, seq.tokens, seq.keys, seq.extra_key, j,
                                        windowed=self.sliding_window is not None):
                self._cached(page)
        seq.num_keyed = len(pages)

    def _swap_in(self, members: list[Sequence], swapped: SwappedGroup) -> None:
        """Copies a swapped group's pages into fresh pages (taken off the
        free queue now, so the next call's growth does not take them) and
        gives each member its pages back, shared as before."""
        needed = sorted(set().union(*(swapped.tables[s.index] for s in members)) - {-1})  # a finished member's drop out
        fresh = self.pool.take_free(len(needed))
        # Paged, members share pages as before; Orca counts each member's own copy.
        self.num_free -= len(needed) if self.reservation == "paged" else sum(
            len(set(swapped.tables[s.index]) - {-1}) for s in members)
        new_page = {-1: ps.NULL_PAGE, **dict(zip(needed, fresh))}
        if fresh:
            self._spill()  # the pages the take evicted leave before the copy in overwrites them
            self.kv = scatter_pages(self.kv, fresh, swapped.pages, source=needed)
        for seq in members:
            tables = swapped.tables[seq.index]
            n = len(tables) // self.groups.num_groups  # each group's table, one after the other
            seq.num_computed = swapped.num_tokens[seq.index]
            for g, row in enumerate(self.rows(seq)):
                table = [new_page[i] for i in tables[g * n : (g + 1) * n]]
                self.pool.share(row, table, seq.num_computed)
                self._hits[row] = (table, seq.num_computed, 0)
        self.stats.swapped_in_pages += len(needed)

    def swap_out(self, group: SequenceGroup, members: list[Sequence]) -> bool:
        """Copies the pages holding ``members``' computed tokens to the swap
        space (a page they share, once). Returns False, copying nothing,
        when the swap space cannot take them."""
        unique: dict[int, int] = {}  # page id -> index among the copied pages
        tables, num_tokens = {}, {}
        for seq in members:
            holder = seq.fork_pre or seq  # a beam not forked yet holds its parent's pages
            n = ps.pages_for_tokens(seq.num_computed, self.page_size)
            # Its groups' tables one after the other (n entries each); a page a window dropped stays dropped:
            # nothing to copy (-1 in the swapped table).
            pages = [p for row in self.rows(holder) for p in self.pool.pages(row)[:n]]
            tables[seq.index] = [unique.setdefault(p, len(unique)) if p != ps.NULL_PAGE else -1 for p in pages]
            num_tokens[seq.index] = seq.num_computed
        if not unique or not self.swap.fits(len(unique)):
            return False
        # Dispatched now, so it runs after the calls that wrote these pages
        # and before the next call, which frees them.
        copied = gather_pages(self.kv, list(unique))
        self.swap.put(group, SwappedGroup(pages=copied, num_pages=len(unique), tables=tables, num_tokens=num_tokens))
        self.stats.swap_outs += 1
        self.stats.swapped_out_pages += len(unique)
        return True

    def copy_swapped(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """A new beam of a swapped-out group: it takes its parent's pages at
        swap-in."""
        swapped = self.swap.get(group)
        if swapped is not None:
            swapped.tables[child.index] = list(swapped.tables[parent.index])
            swapped.num_tokens[child.index] = swapped.num_tokens[parent.index]

    def drop_swapped(self, group: SequenceGroup) -> None:
        if group in self.swap:
            self.swap.pop(group)

    def release(self, seq: Sequence, *, keep_run: bool = False) -> None:
        """``seq``'s pages lose a reference (freed on device by the next
        call, or by :meth:`flush_frees`); a page another sequence shares
        stays held. Its run goes back to the allocator, unless
        ``keep_run`` (a pruned beam's row stays with its group)."""
        if self.runs is not None and not keep_run:
            self.runs.free(seq.group)
        for row in self.rows(seq):
            if row in self._hits:  # given pages this round, but no call has taken them yet
                raise RuntimeError(f"internal: slot {seq.slot} released before the call that shares its pages")
            # Orca counted a copy of every page the row holds: all of them come back, shared or not.
            copies = 0 if self.reservation == "paged" else sum(1 for p in self.pool.pages(row) if p != ps.NULL_PAGE)
            freed = self.pool.release(row)  # not scheduled in this round: no planned growth
            self.num_free += freed if self.reservation == "paged" else copies
            self._held[row] = 0
            self._to_free[row] = True

    def return_child_rows(self, group: SequenceGroup) -> None:
        """``group``'s rows for samples and beams to come are given back
        (:meth:`paged_jax.engine.scheduler.Scheduler.return_child_slots`): under a
        reservation policy their reservations count as free again now, not
        only at the next call (an idle engine has none)."""
        if self.runs is not None:
            self.runs.free(group, len(group.child_slots))
        pages = self._reserving.get(group)
        if pages is None:
            return
        for row in group.child_slots:
            self.num_free += max(pages - int(self.pool.num_seq_pages[row]), 0)
            self._held[row] = self.pool.num_seq_pages[row]

    def keep_for_beams(self, group: SequenceGroup, row: int) -> None:
        """Empty ``row`` went back to ``group`` for the beams to come
        (:meth:`paged_jax.engine.scheduler.Scheduler.prune`): under a reservation
        policy it keeps a reservation, as :meth:`orca_copies` counts it
        from the next call on (and the beam it takes does not count it
        again)."""
        if group in self._reserving:
            self.num_free -= self._reserving[group]
            self._held[row] = self._reserving[group]

    def offer(self, seq: Sequence) -> None:
        """Offers ``seq``'s newly full pages to the prefix cache, each layer
        group's under its own keys: pages whose K/V a dispatched call
        computes and whose tokens the host knows (a token in flight is not
        known yet; its page is offered later)."""
        if self.prefix_cache is None:
            return
        full = min(seq.num_computed, len(seq.tokens)) // self.page_size
        if full <= seq.num_keyed:
            return
        chain_keys(seq.tokens, self.page_size, seq.extra_key, seq.keys)
        for g, (row, window) in enumerate(zip(self.rows(seq), self.groups.windows)):
            table = self.pool.block_tables[row]
            for j in range(seq.num_keyed, full):
                if table[j] != ps.NULL_PAGE and self.prefix_cache.insert(  # not dropped by a window already
                        int(table[j]), seq.tokens, seq.keys, seq.extra_key, j, group=g, windowed=window is not None):
                    self._cached(int(table[j]))
        seq.num_keyed = full

    def pages_written(self, seq: Sequence, first: int, n: int) -> list[int]:
        """The pages positions ``first .. first + n - 1`` of ``seq`` are
        written to, every layer group's, as the plan of the call being
        dispatched holds them."""
        L = self.page_size
        cols = range(first // L, (first + n - 1) // L + 1)
        return [int(self.pool.block_tables[row][j]) for row in self.rows(seq) for j in cols]

    def _note_remote(self, seq: Sequence, pages) -> None:
        """Records in ``seq``'s group which of ``pages`` (hit or loaded for
        it) a KV connector sent: pages another process computed, never
        trusted as the engine's own (:meth:`distrust`)."""
        if not self._from_remote:
            return
        for page in pages:
            key = self._from_remote.get(page)
            if key is None:
                continue
            entry = self.prefix_cache.entry(page)
            if entry is not None and entry.key == key:
                seq.group.remote_pages[page] = key
            else:  # no longer the page that came: forgotten, or reused
                del self._from_remote[page]

    def distrust(self, members: list[Sequence], pages: dict[int, bytes]) -> None:
        """A call computed non-finite values for ``members`` (a group's running
        sequences), which read ``pages`` from a KV connector: those pages,
        and every cached page the members computed after the first of them
        (their K/V attended the bad ones), leave the prefix cache and every
        tier (:meth:`paged_jax.tiers.offload.Offload.distrust`: the connector
        is not asked for those keys again). Call it before the members'
        pages are released."""
        tainted: dict[int, bytes] = {}
        for seq in members:
            for row in self.rows(seq):
                table = self.pool.pages(row)
                first = next((j for j, p in enumerate(table) if p in pages), None)
                for page in [] if first is None else table[first:]:
                    entry = self.prefix_cache.entry(page)
                    if entry is not None:
                        tainted[page] = entry.key
        for page, key in pages.items():
            if self._from_remote.get(page) == key:
                del self._from_remote[page]
        self.forget_cached(list(tainted))
        self.offload.distrust(list(tainted), list(dict.fromkeys([*pages.values(), *tainted.values()])))

    def forget_cached(self, pages: list[int]) -> None:
        """Takes ``pages`` out of the prefix cache (their K/V are not what
        their tokens give: non-finite); pages not cached are skipped."""
        if self.prefix_cache is not None:
            for page in pages:
                self.prefix_cache.evict(page)

    def rollback(self, rewinds: list[tuple[Sequence, int]]) -> None:
        """Speculative decoding's rollback: each ``(seq, num_tokens)`` in
        ``rewinds`` keeps its first ``num_tokens`` tokens (every layer
        group's rows), the rejected proposals past them are forgotten, and
        its pages past them go back to the free queue at once, tail first,
        on device (one call of its own,
        :func:`paged_jax.paging.page_state.unchecked_truncate`) and in the
        twin alike. A sequence keeps its reservation's pages under a
        reservation policy. No page past them was ever offered to the
        prefix cache (:meth:`offer` keys only accepted tokens)."""
        rewinds = [(seq, n) for seq, n in rewinds if n < self.pool.seq_lens[seq.slot]]  # all accepted: nothing
        if not rewinds:
            return
        rows = self._held.shape[0]
        new_lens = np.full(rows, -1, np.int32)  # -1: untouched
        floors = np.zeros(rows, np.int32)
        for seq, n in rewinds:
            for row in self.rows(seq):
                new_lens[row], floors[row] = n, self.reserved_pages(seq)
        touched = np.flatnonzero(new_lens >= 0).tolist()
        self.num_free += self.pool.truncate({r: int(new_lens[r]) for r in touched},
                                            {r: int(floors[r]) for r in touched})
        self._held[touched] = self.pool.num_seq_pages[touched]
        self.state = _rollback(self.state, jnp.asarray(new_lens), jnp.asarray(floors))

    # -------------------------------------------------------------- calls

    def call_pages(self) -> CallPages:
        """The next call's page-state inputs."""
        R, M = len(self._to_free), self.max_pages_per_seq
        num_hit, hit_tokens, ahead = np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(self.num_slots, np.int32)
        hit_pages = np.zeros((R, M), np.int32)
        for row, (pages, tokens, computed_ahead) in self._hits.items():
            num_hit[row], hit_tokens[row] = len(pages), tokens
            hit_pages[row, : len(pages)] = pages
            if row < self.num_slots:  # a slot's rows hold the same tokens ahead (same-step pages: one group only)
                ahead[row] = computed_ahead
        return CallPages(free_mask=self._to_free.copy(), num_hit=num_hit, hit_pages=hit_pages, hit_tokens=hit_tokens,
                         first_kept=self._first_kept.copy(),
                         ahead=ahead, min_pages=self._min_pages.copy())

    def plan_call(self, fork_pre: np.ndarray, num_new: np.ndarray, fork_src: np.ndarray) -> int:
        """Takes the twin through what the next call does on device after
        its frees and shares: forks ``fork_pre`` (i32[S] source slot or
        -1), grows by ``num_new`` (i32[S]) to at least the planned
        reservations (:attr:`CallPages.min_pages`), forks ``fork_src``.
        Returns the free pages the device must report after it. A slot's
        growth and forks apply to each of its rows (one per layer group),
        as :func:`paged_jax.engine.step.device_step` applies them."""
        S = self.num_slots
        for dst in np.flatnonzero(fork_pre >= 0):
            for g in range(self.groups.num_groups):
                self.pool.fork(g * S + int(fork_pre[dst]), g * S + int(dst))
        if self.pool.extend(np.tile(num_new, self.groups.num_groups), self._min_pages) is None:  # the plan is exact
            raise RuntimeError(f"the scheduler planned growth the pool cannot give ({self.pool.num_free} free pages)")
        for dst in np.flatnonzero(fork_src >= 0):
            for g in range(self.groups.num_groups):
                self.pool.fork(g * S + int(fork_src[dst]), g * S + int(dst))
        self._hits.clear()
        self._to_free[:] = False
        self._min_pages[:] = 0
        self._first_kept[:] = 0
        # The plan counted a copy for every shared page; now exact (less Orca's copies, which stay counted).
        self.num_free = self.pool.num_free - self.orca_copies()
        self._held[:] = self.pool.num_seq_pages
        for group, pages in self._reserving.items():  # child rows' reservations are counted: their growth is not
            self._held[group.child_slots] = np.maximum(self._held[group.child_slots], pages)
        self._spill()  # the pages this round evicted, copied before the call overwrites them
        return self.pool.num_free

    def flush_frees(self) -> None:
        """Frees now, on device, what the next call would have freed (the
        engine has no next call), and stores the tiers' copies still on
        their way (so a later process, or a KV consumer, finds every page
        computed)."""
        if self.offload is not None:
            self.offload.settle()
        if self._first_kept.any():  # dropped before freed, as in a call
            self.state = drop_pages_before(self.state, self._first_kept)
            self._first_kept[:] = 0
        if self._to_free.any():
            self.state = ps.free(self.state, jnp.asarray(self._to_free))
            self._to_free[:] = False
        self.pool.flush()

    def accounting(self) -> dict[str, int]:
        """Pages by state, after the pending frees: ``free`` (no content
        worth keeping), ``cached`` (no holder, kept for the prefix cache),
        ``used`` (held by a sequence; a page shared by k sequences counts
        once) and ``total`` (usable pages, the null page excluded). Free +
        cached + used = total always."""
        refs = self.pool.ref_counts
        used = int(np.count_nonzero(refs[1:]))
        cached = sum(1 for p in self.prefix_cache.pages if refs[p] == 0) if self.prefix_cache is not None else 0
        return {"free": self.pool.num_free - cached, "cached": cached, "used": used, "total": len(refs) - 1}

    def usage(self) -> tuple[int, int]:
        """(pages held summed over slots, distinct pages in use) now. Under
        a reservation policy every holder counts its own copy (Orca shares
        nothing, :meth:`orca_copies`), so the two are equal."""
        cols = np.arange(self.max_pages_per_seq)[None, :] < self.pool.num_seq_pages[:, None]
        held = int(np.count_nonzero(cols & (self.pool.block_tables != ps.NULL_PAGE)))  # dropped pages not held
        return held, held if self.reservation != "paged" else int(np.count_nonzero(self.pool.ref_counts))


@jax.jit
def _rollback(state: ps.PageState, new_lens: jax.Array, min_pages: jax.Array) -> ps.PageState:
    """:func:`paged_jax.paging.page_state.unchecked_truncate` of the rows with
    ``new_lens >= 0``; every other row untouched (its length and pages as
    they are on device: a row released since the last call is freed by the
    next one, not here)."""
    untouched = new_lens < 0
    lens = jnp.where(untouched, state.seq_lens, new_lens)
    return ps.unchecked_truncate(state, lens, jnp.where(untouched, state.num_seq_pages, min_pages))[0]
