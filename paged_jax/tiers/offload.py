"""The engine's traffic with the host tier: cached pages spilled when the
device pool evicts them, and loaded back when a prefix hit runs on into
them.

Spill at eviction (write-back). A page leaves the device prefix cache when
the pool hands it out for new content (``BlockPool.on_evict``). Its K/V are
still in the pool at that moment: the call that overwrites them has not
been dispatched. :meth:`HostOffload.note_evicted` only records the page;
:meth:`HostOffload.dispatch` then copies every page recorded since the last
copy in one gather (:func:`paged_jax.paging.swap.gather_pages`), and the KV
manager calls it before anything is dispatched that could overwrite them:
at the end of a round's plan (before its call) and before a scatter into
the pool (a swap-in, a host load). JAX runs work on one pool in the order it
was dispatched, so the gather reads the pages as they were. The gathered
batch is split into host pages (:func:`paged_jax.tiers.host.page_copies`)
at the next dispatch or lookup, by which time the gather has run: the copy
overlaps the call after it, and the host never waits on the running batch.
vLLM's CPU offloading is write-through instead (every full block stored as
it fills, ``vllm/v1/kv_offload``): it copies every page once, whether or not
the pool would have kept it; write-back copies only what the pool lets go,
at the price of a copy on the eviction's round.

A page whose key the tier already holds (it was loaded from there, or
spilled before and computed again) is not copied again: the tier's copy is
only marked recently used. A copy holding a non-finite value (a call that
wrote NaN or inf, whose request the engine refuses when it reads the call:
:meth:`paged_jax.engine.core.Engine._refuse_poison`) is dropped, never
stored.

Load at admission. :meth:`HostOffload.lookup` continues a device hit into the
tier (:meth:`paged_jax.tiers.host.HostTier.lookup`: tokens, salt and the
parent's key checked). The KV manager takes fresh pages for the run, counted
in the admission's page cost as any prefill's new pages are, and
:meth:`HostOffload.load` scatters the host copies into them before the
request's first call; the copy is dispatched asynchronously, so on an
accelerator the transfer overlaps the call still running. The host copy
stays in the tier (a second eviction costs no copy).

Everything is counted in a :class:`TierStats`.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.paging.kv_cache import KVPool
from paged_jax.paging.swap import gather_pages, scatter_pages
from paged_jax.tiers.host import HostPage, HostTier, page_copies, stack_pages


@dataclasses.dataclass
class TierStats:
    """What one tier served and moved, over an engine's life.

    Attributes:
      hit_tokens: prompt tokens of requests at their first admission that
        this tier served (a part of ``EngineStats.prefix_hit_tokens``).
      hit_pages: pages loaded back from it for a hit (first admissions and
        readmissions after a preemption alike).
      spilled_pages, spilled_bytes: pages (and their K/V bytes, scales
        included) copied into it.
      loaded_pages, loaded_bytes: pages (and bytes) copied back into the
        device pool.
      refused_pages: evicted pages it did not take: larger than the whole
        tier, or holding a non-finite value.
      evicted_pages: pages it dropped, least recently used first, to make
        room.
    """

    hit_tokens: int = 0
    hit_pages: int = 0
    spilled_pages: int = 0
    spilled_bytes: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    refused_pages: int = 0
    evicted_pages: int = 0


def _finite(kv: KVPool) -> bool:
    """Whether every K/V value (and scale) of a host page is finite."""
    return all(np.isfinite(x.astype(np.float32)).all() for x in jax.tree.leaves(kv)
               if jnp.issubdtype(x.dtype, jnp.inexact))


class HostOffload:
    """Spills to and loads from one :class:`paged_jax.tiers.host.HostTier`
    (module docstring). One layer group (group 0): the KV manager uses it
    for models whose layers all attend every token.

    Args:
      tier: the host store.
      stats: the counters it adds to.
    """

    def __init__(self, tier: HostTier, stats: TierStats):
        self.tier = tier
        self.stats = stats
        self._pending: list[tuple[int, object]] = []  # (page id, its prefix-cache entry), evicted, not copied yet
        self._in_transit: list[tuple[KVPool, list[object]]] = []  # gathered, not split into host pages yet

    @property
    def pending_pages(self) -> int:
        """Evicted pages not yet in the tier (recorded or being copied)."""
        return len(self._pending) + sum(len(entries) for _, entries in self._in_transit)

    def note_evicted(self, page: int, entry) -> None:
        """Records that the device pool is handing out ``page``, which the
        prefix cache held as ``entry`` (its ``group``, ``key``,
        ``parent_key``, ``tokens``, ``extra``); its K/V must be copied by
        :meth:`dispatch` before anything overwrites them."""
        if (entry.group, entry.key) in self.tier:
            self.tier.touch(entry.group, [entry.key])  # already there: the pool's copy needs no second one
        else:
            self._pending.append((page, entry))

    def dispatch(self, kv: KVPool) -> None:
        """Dispatches one copy of every recorded page out of ``kv`` (call it
        before anything that overwrites them is dispatched); the copies
        dispatched before are stored in the tier first."""
        self.settle()
        if self._pending:
            pages, entries = zip(*self._pending)
            self._pending.clear()
            self._in_transit.append((gather_pages(kv, list(pages)), list(entries)))

    def settle(self) -> None:
        """Stores the dispatched copies in the tier as host pages (this
        waits for their gathers, not for any call after them)."""
        st = self.stats
        for copied, entries in self._in_transit:
            for entry, kv in zip(entries, page_copies(copied, len(entries))):
                page = HostPage(group=entry.group, key=entry.key, parent_key=entry.parent_key, tokens=entry.tokens,
                                extra=entry.extra, kv=kv)
                if not _finite(kv):
                    st.refused_pages += 1
                    continue
                out = self.tier.put(page)
                if len(out) == 1 and out[0] is page:  # too big for the whole tier, or a key it holds already
                    st.refused_pages += (page.group, page.key) not in self.tier
                    continue
                st.spilled_pages += 1
                st.spilled_bytes += page.nbytes
                st.evicted_pages += len(out)
        self._in_transit.clear()

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, start: int,
               max_pages: int) -> list[HostPage]:
        """The pages continuing a device hit of ``start`` pages
        (:meth:`paged_jax.tiers.host.HostTier.lookup`, group 0). Nothing is
        moved or marked used until :meth:`load`."""
        self.settle()
        return self.tier.lookup(tokens, keys, extra, start, max_pages)

    def touch(self, keys: Sequence[bytes]) -> None:
        """A device hit on ``keys``: the tier's copies of them, if any, are
        marked recently used (vLLM's ``OffloadingManager.touch``), so the
        head of a chain the device serves is not the first the tier drops."""
        self.tier.touch(0, keys)

    def load(self, kv: KVPool, pages: list[int], host_pages: Sequence[HostPage]) -> KVPool:
        """Copies ``host_pages`` into pool pages ``pages`` (fresh ones,
        taken off the free queue; :meth:`dispatch` called after taking
        them) and marks them recently used.

        Returns:
          the new pool (``kv`` is donated).

        Raises:
          ValueError: ``pages`` and ``host_pages`` of different lengths or
            empty.
        """
        if len(pages) != len(host_pages) or not pages:
            raise ValueError(f"pages ({len(pages)}) and host_pages ({len(host_pages)}) must be as many, at least one")
        kv = scatter_pages(kv, list(pages), stack_pages(host_pages))
        self.tier.touch(0, [p.key for p in host_pages])
        self.stats.hit_pages += len(pages)
        self.stats.loaded_pages += len(pages)
        self.stats.loaded_bytes += sum(p.nbytes for p in host_pages)
        return kv

    def clear(self) -> int:
        """Forgets every page, stored or on its way (new weights make them
        stale). Returns how many the tier held."""
        self._pending.clear()
        self._in_transit.clear()
        return self.tier.clear()


GIB = 1 << 30
"""Bytes in a GiB (``--host-cache-gib``)."""


def add_tier_flags(parser) -> None:
    """Adds ``--host-cache-gib`` (the host tier's size in GiB, default 0:
    none) to an ``argparse.ArgumentParser`` (the server's and the
    benchmarks'); read it back with :func:`host_cache_bytes_from_args`."""
    group = parser.add_argument_group("KV tiers")
    group.add_argument("--host-cache-gib", type=float, default=0.0, metavar="GIB",
                       help="keep the prefix cache's evicted pages in this much host memory and load them back on "
                            "a hit (default 0: none; needs prefix caching)")


def host_cache_bytes_from_args(parser, args) -> int:
    """``--host-cache-gib`` in bytes (rounded down); a negative or
    non-finite value exits through ``parser.error`` naming the flag."""
    gib = args.host_cache_gib
    if not np.isfinite(gib) or gib < 0:
        parser.error(f"--host-cache-gib must be a finite number >= 0, got {gib}")
    return int(gib * GIB)
