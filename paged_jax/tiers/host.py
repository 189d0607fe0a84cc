"""The host tier of the prefix cache: cached pages kept in host memory after
the device pool evicts them.

A full page in the prefix cache (:mod:`paged_jax.paging.prefix_cache`) keeps
its K/V only while the device pool does not hand the page out again; the
first eviction loses them. The host tier is where such a page goes instead:
a bounded store in host memory, least recently used first out by bytes
(vLLM's CPU ``OffloadingManager``, LMCache's local CPU backend), keyed as
the device cache is, ``(layer group, chain key)``, so a prefix hit can run
past the device pool's pages into the host's and bring those back.

Each :class:`HostPage` carries what the device cache's entry does (its
tokens, the extra key, its parent's chain key) and the page's K/V in the
pool's layout with a page axis of one (:func:`page_copies`). A lookup
(:meth:`HostTier.lookup`) continues a chain from a given page and accepts a
page only if its tokens and extra key equal the request's and its parent's
key is the key of the request's previous page: the previous page itself is
verified token by token (on device or here), so the tokens before it are
checked through the hash chain alone, the one place a host hit rests on
SHA-256 (as a sliding-window group's device hit does).

Everything here is host-side bookkeeping and NumPy; which pages leave and
return, and when the copies run, is :mod:`paged_jax.tiers.offload`'s.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_int
from paged_jax.paging.kv_cache import KVPool
from paged_jax.paging.prefix_cache import holds_page


@dataclasses.dataclass(frozen=True)
class HostPage:
    """One cached page in host memory.

    Attributes:
      group: its layer group.
      key: its chain key (:func:`paged_jax.paging.prefix_cache.chain_keys`).
      parent_key: the previous page's chain key (the chain's root for the
        first page).
      tokens: the token ids it holds, ``page_size`` of them.
      extra: the extra key it was computed under (the ``cache_salt``).
      kv: its K/V: a :class:`paged_jax.paging.kv_cache.KVPool` of NumPy
        arrays with a page axis of one (K and V ``[layers, K, 1, L, H]``,
        a quantized pool's scales ``[layers, K, 1, L]``).
    """

    group: int
    key: bytes
    parent_key: bytes
    tokens: tuple[int, ...]
    extra: Hashable
    kv: KVPool

    @property
    def nbytes(self) -> int:
        """Bytes its K/V take (scales included)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.kv))


def page_copies(copied: KVPool, count: int) -> list[KVPool]:
    """Splits pages copied out of the pool into one host copy each.

    Args:
      copied: pages from :func:`paged_jax.paging.swap.gather_pages` (page
        axis 2, ``n >= count`` pages), on any device.
      count: how many of its first pages to split off.

    Returns:
      ``count`` KVPools of NumPy arrays, page axis of one, each its own
      memory (no view keeps the whole copy alive).

    Raises:
      ValueError: ``count`` below 0 or above the copied pages.
    """
    count = check_int("count", count, 0, copied.num_pages + 1)
    host = jax.tree.map(np.asarray, copied)
    return [jax.tree.map(lambda x: np.array(x[:, :, i : i + 1], copy=True), host) for i in range(count)]


def all_finite(kv: KVPool) -> bool:
    """Whether every K/V value (and scale) of ``kv`` is finite: NumPy
    leaves checked on the host, device leaves on their device."""
    def finite(x) -> bool:
        if isinstance(x, np.ndarray):
            return bool(np.isfinite(x.astype(np.float32)).all())
        return bool(jnp.isfinite(x).all())

    return all(finite(x) for x in jax.tree.leaves(kv) if jnp.issubdtype(x.dtype, jnp.inexact))


def stack_pages(pages: Sequence[HostPage]) -> KVPool:
    """The K/V of ``pages`` as one copy, page axis 2 in their order, for
    :func:`paged_jax.paging.swap.scatter_pages`.

    Raises:
      ValueError: no pages, or pages of different layouts.
    """
    if not pages:
        raise ValueError("pages is empty: nothing to stack")
    first = jax.tree.structure(pages[0].kv)
    for p in pages:
        if jax.tree.structure(p.kv) != first:
            raise ValueError(f"pages hold different K/V layouts: {first} and {jax.tree.structure(p.kv)}")
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=2), *(p.kv for p in pages))


class HostTier:
    """A bounded store of cached pages in host memory, least recently used
    evicted first (module docstring).

    Args:
      capacity_bytes: bytes of K/V it holds at most (>= 0; 0 holds
        nothing, every :meth:`put` refused).
      page_size: tokens per page.

    Raises:
      ValueError: ``capacity_bytes`` not an int >= 0, ``page_size`` not an
        int >= 1.
    """

    def __init__(self, capacity_bytes: int, page_size: int):
        self.capacity_bytes = check_int("capacity_bytes", capacity_bytes, 0)
        self.page_size = check_int("page_size", page_size)
        self.used_bytes = 0
        self.evicted_pages = 0  # pages dropped to make room, since creation
        self._pages: collections.OrderedDict[tuple[int, bytes], HostPage] = collections.OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, group_key: tuple[int, bytes]) -> bool:
        return group_key in self._pages

    @property
    def keys(self) -> list[tuple[int, bytes]]:
        """``(group, key)`` of every page, least recently used first."""
        return list(self._pages)

    def put(self, page: HostPage) -> list[HostPage]:
        """Stores ``page`` as the most recently used, evicting the least
        recently used pages until it fits.

        A page whose key its group already holds replaces nothing (the
        first copy stays, as in the device cache) and is returned; so is a
        page larger than the whole tier, which stores nothing and evicts
        nothing (the tier degrades to holding less, never to an error).

        Returns:
          the pages that left or never entered: evicted ones, least
          recently used first, or ``[page]`` when it was refused.

        Raises:
          ValueError: ``page.group`` below 0, or ``page.tokens`` not
          ``page_size`` tokens (the tier unchanged).
        """
        key = (check_int("page.group", page.group, 0), page.key)
        if len(page.tokens) != self.page_size:
            raise ValueError(f"page.tokens has {len(page.tokens)} tokens, expected page_size={self.page_size}")
        size = page.nbytes
        if key in self._pages or size > self.capacity_bytes:
            return [page]
        out = []
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self._pages.popitem(last=False)
            self.used_bytes -= old.nbytes
            self.evicted_pages += 1
            out.append(old)
        self._pages[key] = page
        self.used_bytes += size
        return out

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, start: int, max_pages: int, *,
               group: int = 0) -> list[HostPage]:
        """The longest run of pages ``start, start + 1, ...`` of ``tokens``
        the tier holds for ``group``, each verified (module docstring). The
        run's order of use is not changed (:meth:`touch` does that).

        Args:
          tokens: the request's token ids.
          keys: their page keys, one per full page.
          extra: the request's extra key.
          start: the first page to look for (the device cache's hit length).
          max_pages: the page index the run must stop before (the engine's
            ``(len(tokens) - 1) // page_size``).
          group: the layer group.

        Returns:
          the pages, possibly none.

        Raises:
          ValueError: ``start``, ``max_pages`` or ``group`` below 0.
        """
        group, start = check_int("group", group, 0), check_int("start", start, 0)
        max_pages = check_int("max_pages", max_pages, 0)
        run: list[HostPage] = []
        for j in range(start, min(max_pages, len(keys))):
            page = self._pages.get((group, keys[j]))
            if page is None or not holds_page(page, tokens, extra, j, self.page_size, keys=keys):
                break
            run.append(page)
        return run

    def touch(self, group: int, keys: Sequence[bytes]) -> None:
        """Marks the pages of ``keys`` (a chain's, in order) in ``group``
        most recently used, the first key the most (a chain's tail leaves
        before its head, without which it can never be hit); keys not held
        are skipped."""
        group = check_int("group", group, 0)
        for key in reversed(keys):
            if (group, key) in self._pages:
                self._pages.move_to_end((group, key))

    def discard(self, group: int, key: bytes) -> bool:
        """Drops ``(group, key)``'s page if held (pages found bad after they
        were stored); returns whether it was."""
        page = self._pages.pop((group, key), None)
        if page is not None:
            self.used_bytes -= page.nbytes
        return page is not None

    def clear(self) -> int:
        """Forgets every page (new weights make them stale). Returns how
        many there were."""
        n = len(self._pages)
        self._pages.clear()
        self.used_bytes = 0
        return n
