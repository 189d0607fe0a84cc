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

Lifetime. A page stays in the cache while its content is valid: while a
sequence holds it, and after its last holder frees it, until the free queue
hands it out for new use (least recently freed first:
:class:`paged_jax.block_pool.BlockPool` calls :meth:`PrefixCache.evict`).
A hit on a freed page takes it back out of the free queue. The map and the
chain live on the host because they are dictionaries keyed by bytes; the
page state on device stays a fixed-shape pytree changed by pure functions,
and only sees the hits as page ids (:func:`paged_jax.page_state.unchecked_share`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Hashable, Sequence

import numpy as np

_ROOT = b"paged-jax prefix cache v1"


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
        parent = keys[j - 1] if j else _ROOT
        run = np.asarray(tokens[j * page_size : (j + 1) * page_size], dtype="<i8").tobytes()
        keys.append(hashlib.sha256(parent + salt + run).digest())
    return keys


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: bytes
    parent: int  # page id of the previous page in the chain, -1 for the first
    tokens: tuple[int, ...]
    extra: Hashable


class PrefixCache:
    """Key -> page map over full pages whose K/V are valid.

    Args:
      page_size: tokens per page.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._by_key: dict[bytes, int] = {}
        self._by_page: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._by_page)

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    @property
    def pages(self) -> list[int]:
        """Every cached page id."""
        return list(self._by_page)

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, max_pages: int) -> list[int]:
        """The longest run of cached pages holding ``tokens``' first pages.

        Args:
          tokens: the request's token ids.
          keys: their page keys (:func:`chain_keys`), one per full page.
          extra: the request's extra key.
          max_pages: most pages to return (the engine passes
            ``(len(tokens) - 1) // page_size`` so the last token is always
            computed and there are logits to sample from).

        Returns:
          page ids for pages ``0, 1, ...`` of the request, each verified
          (tokens, extra key and parent), possibly empty.
        """
        pages: list[int] = []
        parent = -1
        L = self.page_size
        for j in range(min(max_pages, len(keys))):
            page = self._by_key.get(keys[j])
            if page is None:
                break
            e = self._by_page[page]
            if e.parent != parent or e.extra != extra or e.tokens != tuple(tokens[j * L : (j + 1) * L]):
                break
            pages.append(page)
            parent = page
        return pages

    def insert(self, page: int, tokens: Sequence[int], keys: Sequence[bytes], extra: Hashable, j: int) -> bool:
        """Records that ``page`` holds page ``j`` of ``tokens`` (its K/V
        written or being written by a call already dispatched).

        Nothing is recorded when the key is already cached (another page
        holds the same tokens: the first stays) or when page ``j - 1``'s key
        is not cached (the page could never be reached). Returns whether it
        was recorded.
        """
        key = keys[j]
        if key in self._by_key or page in self._by_page:
            return False
        parent = -1
        if j:
            parent = self._by_key.get(keys[j - 1], -1)
            if parent < 0:
                return False
        L = self.page_size
        self._by_key[key] = page
        self._by_page[page] = _Entry(key=key, parent=parent, tokens=tuple(tokens[j * L : (j + 1) * L]), extra=extra)
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
            del self._by_key[e.key]
