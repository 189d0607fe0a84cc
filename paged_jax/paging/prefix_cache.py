"""Automatic prefix caching: full pages keyed by a hash chain of their tokens.

A request whose first tokens equal another's (a shared system prompt, a
few-shot preamble, a conversation's earlier turns, a recomputed preempted
sequence) can take the pages that already hold their K/V and skip their
prefill (PagedAttention, Kwon et al., SOSP 2023, section 4.4 "shared
prefix"; the automatic form is vLLM's and SGLang's).

Keys. Page ``j`` of a sequence is keyed by
``sha256(key[j-1] | extra | tokens[j * L : (j + 1) * L])``: its parent's key,
an *extra key* for anything that makes equal tokens unequal (the request's
``cache_salt``; an adapter id would go here), and its own tokens. Only full
pages are keyed; a partial page is never shared through the cache.

Collisions cannot make a wrong hit. A hit is accepted only after checking
what the key stands for: the cached page's own tokens and extra key equal
the request's, and its recorded parent is the page the lookup matched one
step before. By induction the matched chain holds exactly the request's
tokens under the same extra key, whatever the hash does; the hash only
finds candidates. (A SHA-256 collision has never been exhibited; the check
makes correctness not depend on that.)

Layer groups. A hybrid model (:mod:`paged_jax.paging.kv_groups`) has a block
table per layer group, so one token range sits in a different page in
each group, and each group keeps its own pages in the cache: an entry is
keyed by ``(group, key)``. A hit has one length ``h`` (pages) for every
group, and what each group must hold for it differs
(:meth:`PrefixCache.longest_hit`, vLLM v1's
``HybridKVCacheCoordinator.find_longest_cache_hit``):

- a full-attention group needs pages ``0 .. h - 1``, the verified chain
  above;
- a sliding-window group of ``W`` tokens needs only the pages the next
  query (position ``h * L``) still sees, columns
  ``window_first_kept(h * L) .. h - 1``
  (:func:`paged_jax.paging.sliding_window.window_first_kept`); the columns before
  are null in the shared table, as the window would have dropped them.
  Such a group caches a page whether or not its parent page is still
  cached, and a hit checks each page's tokens, extra key and its parent's
  *key*: the tokens before the window are checked through the hash chain
  alone (the pages that held them may be gone), the one place a hit rests
  on SHA-256.

``h`` is the largest length every group can serve: each group answers
with the longest hit it can give up to the current ``h`` (a full group
its chain cut there, a sliding group the last length whose window pages
are all cached), ``h`` becomes the shortest answer, and the groups are
asked again until all agree. A full group's chain stays valid when cut
shorter; a sliding group's window run does not (a shorter hit needs
earlier pages), hence the loop.

Lifetime. A page stays in the cache while its content is valid: while a
sequence holds it, and after its last holder frees it, until the free queue
hands it out for new use (least recently freed first:
:class:`paged_jax.paging.block_pool.BlockPool` calls :meth:`PrefixCache.evict`).
A hit on a freed page takes it back out of the free queue. The map and the
chain live on the host because they are dictionaries keyed by bytes; the
page state on device stays a fixed-shape pytree changed by pure functions,
and only sees the hits as page ids (:func:`paged_jax.paging.page_state.unchecked_share`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Hashable, Sequence

import numpy as np

from paged_jax.checks import check_bool, check_int
from paged_jax.paging.page_state import NULL_PAGE
from paged_jax.paging.sliding_window import window_first_kept

ROOT_KEY = b"paged-jax prefix cache v1"  # the first page's parent key


def extra_key_bytes(extra: Hashable) -> bytes:
    """The bytes of an extra key in a page's hash (``repr``, length-prefixed
    so that no two extra keys and token runs can be confused)."""
    text = repr(extra).encode()
    return len(text).to_bytes(8, "little") + text


def chain_keys(tokens: Sequence[int], page_size: int, extra: Hashable, keys: list[bytes]) -> list[bytes]:
    """Extends ``keys`` (the keys of a sequence's first ``len(keys)`` pages)
    with the keys of its further full pages. Returns ``keys``.

    Args:
      tokens: the sequence's token ids.
      page_size: tokens per page.
      extra: the extra key (e.g. ``(cache_salt,)``); equal tokens under
        different extra keys get different keys.
      keys: modified in place.
    """
    salt = extra_key_bytes(extra)
    for j in range(len(keys), len(tokens) // page_size):
        parent = keys[j - 1] if j else ROOT_KEY
        run = np.asarray(tokens[j * page_size : (j + 1) * page_size], dtype="<i8").tobytes()
        keys.append(hashlib.sha256(parent + salt + run).digest())
    return keys


def holds_page(entry, tokens: Sequence[int], extra: Hashable, j: int, page_size: int, *,
               keys: Sequence[bytes] | None = None) -> bool:
    """Whether a cached page's record (anything with ``tokens``, ``extra``
    and ``parent_key``: this cache's entries, the host tier's pages) holds
    page ``j`` of ``tokens`` under ``extra``: its tokens and extra key equal,
    and, given ``keys``, its parent's key the key of page ``j - 1`` (the
    chain's root for the first page)."""
    L = page_size
    if entry.extra != extra or entry.tokens != tuple(tokens[j * L : (j + 1) * L]):
        return False
    return keys is None or entry.parent_key == (keys[j - 1] if j else ROOT_KEY)


@dataclasses.dataclass(frozen=True)
class _Entry:
    group: int
    key: bytes
    parent: int  # page id of the previous page in the chain (same group), -1 for the first or none cached
    parent_key: bytes  # the previous page's key (ROOT_KEY for the first)
    tokens: tuple[int, ...]
    extra: Hashable


class PrefixCache:
    """(group, key) -> page map over full pages whose K/V are valid.

    Args:
      page_size: tokens per page.

    Raises:
      ValueError: ``page_size`` not an int >= 1. (Every method refuses a
      ``group`` or ``max_pages`` below 0, a ``window`` below 1 and an
      ``insert`` at a page without a key, by name.)
    """

    def __init__(self, page_size: int):
        self.page_size = check_int("page_size", page_size)
        self._by_key: dict[tuple[int, bytes], int] = {}
        self._by_page: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._by_page)

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    @property
    def pages(self) -> list[int]:
        """Every cached page id."""
        return list(self._by_page)

    def entry(self, page: int):
        """What the cache records for ``page`` (its ``group``, ``key``,
        ``parent_key``, ``tokens`` and ``extra``), or None if it is not
        cached; read before the page is evicted, to keep it in another tier
        (:mod:`paged_jax.tiers.offload`)."""
        return self._by_page.get(page)

    def _verified(self, group: int, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, j: int,
                  parent: int | None) -> int | None:
        """The cached page holding page ``j`` of ``tokens`` in ``group``, its
        tokens and extra key checked, and its parent: the page ``parent``
        when given (a chain), else the parent's key. None if there is none."""
        page = self._by_key.get((group, keys[j]))
        if page is None:
            return None
        e = self._by_page[page]
        if parent is not None:
            ok = holds_page(e, tokens, extra, j, self.page_size) and e.parent == parent
        else:
            ok = holds_page(e, tokens, extra, j, self.page_size, keys=keys)
        return page if ok else None

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, max_pages: int, *,
               group: int = 0) -> list[int]:
        """The longest run of cached pages holding ``tokens``' first pages
        (a full-attention group's hit).

        Args:
          tokens: the request's token ids.
          keys: their page keys (:func:`chain_keys`), one per full page.
          extra: the request's extra key.
          max_pages: most pages to return (the engine passes
            ``(len(tokens) - 1) // page_size`` so the last token is always
            computed and there are logits to sample from).
          group: the layer group whose pages to look up.

        Returns:
          page ids for pages ``0, 1, ...`` of the request, each verified
          (tokens, extra key and parent), possibly empty.
        """
        group, max_pages = check_int("group", group, 0), check_int("max_pages", max_pages, 0)
        pages: list[int] = []
        parent = -1
        for j in range(min(max_pages, len(keys))):
            page = self._verified(group, tokens, keys, extra, j, parent)
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def lookup_window(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, max_pages: int, *,
                      group: int, window: int) -> list[int]:
        """A sliding-window group's longest hit of at most ``max_pages``
        pages: the largest ``h`` whose window pages (columns
        ``window_first_kept(h * page_size) .. h - 1``) are all cached
        (module docstring).

        Args:
          tokens, keys, extra, max_pages: as :meth:`lookup`.
          group: the layer group.
          window: its sliding window, tokens (>= 1).

        Returns:
          the group's block table for the hit: ``h`` entries, ``NULL_PAGE``
          before the window, verified page ids from there on; possibly
          empty.
        """
        group, max_pages = check_int("group", group, 0), check_int("max_pages", max_pages, 0)
        window, L = check_int("window", window), self.page_size
        found = [self._verified(group, tokens, keys, extra, j, None) for j in range(min(max_pages, len(keys)))]
        # the first column each hit length h = 1, 2, ... needs, all at once
        kept = window_first_kept(np.arange(1, len(found) + 1) * L, sliding_window=window, page_size=L).tolist()
        best, first, run = 0, 0, 0
        for h, k in enumerate(kept, start=1):
            run = run + 1 if found[h - 1] is not None else 0  # cached pages ending at column h - 1
            if run >= h - k:
                best, first = h, k
        return [NULL_PAGE] * first + found[first:best]

    def longest_hit(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, max_pages: int,
                    windows: Sequence[int | None]) -> list[list[int]]:
        """The longest hit every layer group can serve (module docstring,
        "Layer groups"; vLLM v1's ``find_longest_cache_hit``).

        Args:
          tokens, keys, extra, max_pages: as :meth:`lookup`.
          windows: per group, its sliding window in tokens, or None (full
            attention).

        Returns:
          per group, its block table for the hit: the same length ``h`` in
          every group (0: no hit), ``NULL_PAGE`` where a window needs no
          page.
        """
        h = min(check_int("max_pages", max_pages, 0), len(keys))
        if not windows:
            raise ValueError("windows must name at least one layer group, got an empty sequence")
        hits: list[list[int] | None] = [None] * len(windows)
        while True:
            for g, window in enumerate(windows):
                if hits[g] is not None and len(hits[g]) >= h and (window is None or len(hits[g]) == h):
                    hits[g] = hits[g][:h]  # a chain cut shorter still holds; a window run only at its own length
                elif window is None:
                    hits[g] = self.lookup(tokens, keys, extra, h, group=g)
                else:
                    hits[g] = self.lookup_window(tokens, keys, extra, h, group=g, window=window)
                h = min(h, len(hits[g]))
            if all(len(hit) == h for hit in hits):
                return hits

    def insert(self, page: int, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, j: int, *,
               group: int = 0, windowed: bool = False) -> bool:
        """Records that ``page`` holds page ``j`` of ``tokens`` in layer
        group ``group`` (its K/V written or being written by a call already
        dispatched).

        Nothing is recorded when the key is already cached in the group
        (another page holds the same tokens: the first stays) or, for a
        full-attention group (``windowed`` False), when page ``j - 1``'s
        key is not cached there (the page could never be reached; a
        sliding-window group's hit needs no earlier page). Returns whether
        it was recorded.
        """
        check_int("page", page)  # page 0 is the null page
        group, windowed = check_int("group", group, 0), check_bool("windowed", windowed)
        j = check_int("j", j, 0, len(keys))
        key = (group, keys[j])
        if key in self._by_key or page in self._by_page:
            return False
        parent = self._by_key.get((group, keys[j - 1]), -1) if j else -1
        if j and parent < 0 and not windowed:
            return False
        L = self.page_size
        self._by_key[key] = page
        self._by_page[page] = _Entry(group=group, key=keys[j], parent=parent,
                                     parent_key=keys[j - 1] if j else ROOT_KEY,
                                     tokens=tuple(tokens[j * L : (j + 1) * L]), extra=extra)
        return True

    def clear(self) -> None:
        """Forgets every page (their K/V no longer match what the model
        would compute, e.g. after new weights)."""
        self._by_key.clear()
        self._by_page.clear()

    def evict(self, page: int) -> None:
        """Forgets ``page`` (it is about to be overwritten); no-op if it is
        not cached."""
        e = self._by_page.pop(page, None)
        if e is not None:
            del self._by_key[(e.group, e.key)]
