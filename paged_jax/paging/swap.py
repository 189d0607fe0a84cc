"""Swap space: preempted sequences' K/V pages kept in host memory.

Preemption by swapping (PagedAttention, Kwon et al., SOSP 2023, section
4.5): instead of dropping a preempted sequence group's K/V and recomputing
it later, the engine copies the group's pages to host memory, frees them,
and when the group is resumed copies the contents back into fresh pages.
A page shared by several sequences of the group is copied once, and shared
again after the swap-in. The round trip is a copy: the K/V come back
bit-identical.

The copies are device programs ordered with the engine's steps, so they run
after the call that wrote the pages and before any call that reuses them:
:func:`gather_pages` is dispatched before the call that frees the pages,
:func:`scatter_pages` before the call that first reads the new ones. Page
counts are padded to powers of two with the null page (its content never
reaches an output), so a handful of programs serve every size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import is_int
from paged_jax.paging.kv_cache import KVPool
from paged_jax.paging.page_state import NULL_PAGE


def _padded(pages: list[int]) -> np.ndarray:
    n = 1
    while n < len(pages):
        n *= 2
    out = np.full(n, NULL_PAGE, np.int32)
    out[: len(pages)] = pages
    return out


@jax.jit
def _gather(kv: KVPool, pages: jax.Array) -> KVPool:
    return jax.tree.map(lambda x: x[:, :, pages], kv)  # every leaf's third axis is the page


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(kv: KVPool, pages: jax.Array, copied: KVPool) -> KVPool:
    return jax.tree.map(lambda x, c: x.at[:, :, pages].set(c.astype(x.dtype)), kv, copied)


def gather_pages(kv: KVPool, pages: list[int], host=None) -> KVPool:
    """Copies pages out of the pool, to ``host`` (a device; default the
    first CPU device).

    Args:
      kv: the pool; K and V are ``[layers, K, P, L, H]`` (a quantized
        pool's scales ``[layers, K, P, L]`` travel with them).
      pages: page ids to copy, in the order they come back.

    Returns:
      A :class:`KVPool` on ``host`` of ``n >= len(pages)`` pages (a power
      of two; entries past ``len(pages)`` copy the null page): K and V
      ``[layers, K, n, L, H]``, and the scales of a quantized pool.
    """
    _check_pages("pages", pages, kv.num_pages)
    if not pages:
        raise ValueError("pages is empty: nothing to copy")
    copied = _gather(kv, jnp.asarray(_padded(pages)))
    host = host or jax.devices("cpu")[0]
    return jax.device_put(copied, host)


def scatter_pages(kv: KVPool, pages: list[int], copied: KVPool, source: list[int] | None = None) -> KVPool:
    """Writes copied contents (from :func:`gather_pages`) into ``pages`` of
    the pool; the pool is donated and the new one returned.

    Args:
      kv: the pool.
      pages: page ids to write.
      copied: the copied pages (:func:`gather_pages`), with the pool's
        dtype and scales.
      source: for each of ``pages``, which copied page goes there (default
        ``0, 1, ...``).

    Raises:
      ValueError: ``pages`` naming a page outside the pool (or none),
        ``source`` naming a page that was not copied, or copied pages of
        another pool's layout (float vs quantized, another dtype, or
        other shapes than the pool's but for the page axis).
    """
    _check_pages("pages", pages, kv.num_pages)
    if not pages:
        raise ValueError("pages is empty: nothing to write")
    n = copied.k.shape[2]
    source = list(range(len(pages))) if source is None else list(source)
    if len(source) != len(pages) or (source and not 0 <= min(source) <= max(source) < n):
        raise ValueError(f"source must give one of the {n} copied pages for each of {len(pages)} pages, got {source}")
    if copied.quantized != kv.quantized:
        kind = lambda pool: pool.k.dtype.name if pool.quantized else "float"  # noqa: E731
        raise ValueError(f"copied pages are {kind(copied)} but the pool is {kind(kv)}")
    for name, c, x in zip(("k", "v", "k_scale", "v_scale"), jax.tree.leaves(copied), jax.tree.leaves(kv)):
        if c.shape[:2] + c.shape[3:] != x.shape[:2] + x.shape[3:] or c.dtype != x.dtype:
            raise ValueError(f"copied {name} {c.dtype}{list(c.shape)} does not fit the pool's {x.dtype}"
                             f"{list(x.shape)} (they may differ only in the page axis, 2)")
    target = _padded(pages)
    src = np.zeros(len(target), np.int32)
    src[: len(source)] = source
    if len(target) != n or source != list(range(len(pages))):
        copied = jax.tree.map(lambda x: x[:, :, src], copied)  # on the host, before the copy in
    # Onto the pool's device, committed only if the pool is: a committed pool coming back from an
    # uncommitted one would be a new argument signature for every program that takes it (a recompile).
    if kv.k.committed:  # each leaf its own sharding: a sharded pool's scales have a spec of rank 4, K and V of 5
        copied = jax.tree.map(lambda c, x: jax.device_put(c, x.sharding), copied, kv)
    else:  # from host memory (NumPy): uncommitted, on the default device, where the pool is
        copied = jax.tree.map(lambda x: jax.device_put(np.asarray(x)), copied)
    return _scatter(kv, jnp.asarray(target), copied)


def _check_pages(name: str, pages, num_pages: int) -> None:
    """Raises ValueError unless ``pages`` is a list of int page ids in
    ``[0, num_pages)``."""
    bad = [p for p in pages if not is_int(p, 0, num_pages)]
    if bad:
        raise ValueError(f"{name} must be page ids in [0, num_pages={num_pages}), got {bad}")


@dataclasses.dataclass
class SwappedGroup:
    """A preempted group's pages in host memory.

    Attributes:
      pages: the copied pages (:func:`gather_pages`), ``n >= num_pages``.
      num_pages: distinct pages copied.
      tables: per sequence of the group (by its index in the group),
        indices into the copied pages, in logical order.
      num_tokens: per sequence, tokens whose K/V the pages hold.
    """

    pages: KVPool
    num_pages: int
    tables: dict[int, list[int]]
    num_tokens: dict[int, int]


class SwapSpace:
    """Host memory for swapped-out pages, ``capacity`` pages at most.

    Args:
      capacity: pages it can hold (>= 0).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._groups: dict[int, SwappedGroup] = {}

    def __contains__(self, key) -> bool:
        return key in self._groups

    def get(self, key) -> SwappedGroup | None:
        return self._groups.get(key)

    def fits(self, num_pages: int) -> bool:
        return self.used + num_pages <= self.capacity

    def put(self, key, group: SwappedGroup) -> None:
        if not self.fits(group.num_pages):
            raise ValueError(f"swap space full: {self.used} + {group.num_pages} pages > capacity {self.capacity}")
        self._groups[key] = group
        self.used += group.num_pages

    def pop(self, key) -> SwappedGroup:
        group = self._groups.pop(key)
        self.used -= group.num_pages
        return group
