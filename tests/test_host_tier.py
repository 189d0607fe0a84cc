"""The host tier's store (paged_jax.tiers.host): pages leave the pool and
come back bit for bit (float, int8, fp8, latent), least recently used out by
exact bytes and keys, a chain found only where tokens, salt and parent agree,
and a tier too small for a page degrades to holding nothing.

The engine's spill and load through it: tests/test_kv_tiers.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.paging.kv_cache import KVPool, init_latent_pool
from paged_jax.paging.prefix_cache import ROOT_KEY, chain_keys
from paged_jax.paging.swap import gather_pages, scatter_pages
from paged_jax.tiers.host import HostPage, HostTier, page_copies, stack_pages
from pallas_kernels.common import QUANTIZED_KV_DTYPES, is_quantized

L = 4  # tokens per page


def _pool(dtype, num_pages=12, seed=0) -> KVPool:
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(2, 3, num_pages, L, 8)).astype(np.float32)  # [layers, K, P, L, H]
    if is_quantized(dtype):
        return KVPool(k=jnp.asarray(k * 10, dtype), v=jnp.asarray(-k * 10, dtype),
                      k_scale=jnp.asarray(k[..., 0]), v_scale=jnp.asarray(-k[..., 1]))
    return KVPool(k=jnp.asarray(k, dtype), v=jnp.asarray(-k, dtype))


def _pages(tokens, extra, kv_pages, group=0):
    """HostPages for ``tokens``' full pages, the j-th holding ``kv_pages[j]``."""
    keys = chain_keys(tokens, L, extra, [])
    return keys, [HostPage(group=group, key=keys[j], parent_key=keys[j - 1] if j else ROOT_KEY,
                           tokens=tuple(tokens[j * L:(j + 1) * L]), extra=extra, kv=kv)
                  for j, kv in enumerate(kv_pages)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, *QUANTIZED_KV_DTYPES, "latent"],
                         ids=lambda d: d if isinstance(d, str) else jnp.dtype(d).name)
def test_pages_leave_and_return_bit_for_bit(dtype):
    if dtype == "latent":  # MLA's latent pool: K pages only
        pool = init_latent_pool(num_layers=2, num_pages=12, page_size=L, latent_dim=8)
        pool = pool.replace(k=jnp.asarray(np.random.default_rng(1).normal(size=pool.k.shape), pool.k.dtype))
    else:
        pool = _pool(dtype)
    before = [np.asarray(x) for x in jax.tree.leaves(pool)]
    copies = page_copies(gather_pages(pool, [3, 5, 7]), 3)
    assert all(isinstance(x, np.ndarray) and x.shape[2] == 1 for c in copies for x in jax.tree.leaves(c))
    tokens = list(range(100, 100 + 3 * L))
    _, pages = _pages(tokens, None, copies)
    tier = HostTier(capacity_bytes=10**6, page_size=L)
    for p in pages:
        assert tier.put(p) == []
    assert tier.used_bytes == sum(p.nbytes for p in pages) == 3 * sum(x[:, :, :1].nbytes for x in before)
    back = scatter_pages(pool, [10, 2, 8], stack_pages(pages))  # 3 -> 10, 5 -> 2, 7 -> 8
    for old, new in zip(before, jax.tree.leaves(back)):
        new = np.asarray(new)
        for dst, src in ((10, 3), (2, 5), (8, 7)):
            assert new[:, :, dst].tobytes() == old[:, :, src].tobytes()
        for untouched in (1, 3, 4, 5, 6, 7, 9, 11):  # page 0, the null page, takes the padding
            assert new[:, :, untouched].tobytes() == old[:, :, untouched].tobytes()


def test_copies_own_their_memory():
    copied = gather_pages(_pool(jnp.float32), [1, 2])
    a, b = page_copies(copied, 2)
    assert a.k.base is None and b.k.base is None  # not views of the gathered batch
    assert page_copies(copied, 0) == []
    with pytest.raises(ValueError, match="count"):
        page_copies(copied, 3)


def test_lookup_continues_a_chain_only_where_tokens_salt_and_parent_agree():
    kv = page_copies(gather_pages(_pool(jnp.float32), [1]), 1)[0]
    tokens = list(range(7 * L))
    keys, pages = _pages(tokens, ("a",), [kv] * 6)
    tier = HostTier(capacity_bytes=10**6, page_size=L)
    for p in pages[2:5]:  # pages 2, 3, 4 held; 0, 1 (on device, say) and 5 not
        tier.put(p)
    assert [p.key for p in tier.lookup(tokens, keys, ("a",), 2, 7)] == keys[2:5]
    assert tier.lookup(tokens, keys, ("a",), 0, 7) == []  # no page 0: a run starts where the device's ends
    assert len(tier.lookup(tokens, keys, ("a",), 2, 4)) == 2  # stops before max_pages
    assert len(tier.lookup(tokens, keys, ("a",), 3, 7)) == 2
    # Another salt: other keys, and a planted key under the wrong salt is refused.
    other = chain_keys(tokens, L, ("b",), [])
    assert tier.lookup(tokens, other, ("b",), 2, 7) == []
    assert tier.lookup(tokens, keys, ("b",), 2, 7) == []
    # Other tokens under the same keys (a forged collision) are refused, and so is a wrong parent.
    forged = list(tokens)
    forged[3 * L] += 1
    assert len(tier.lookup(forged, keys, ("a",), 2, 7)) == 1
    stray = HostPage(group=0, key=keys[5], parent_key=b"x" * 32, tokens=tuple(tokens[5 * L:6 * L]), extra=("a",),
                     kv=kv)
    tier.put(stray)
    assert len(tier.lookup(tokens, keys, ("a",), 2, 7)) == 3
    assert tier.lookup(tokens, keys, ("a",), 2, 7, group=1) == []  # another layer group's pages are its own


def test_least_recently_used_leaves_first_by_exact_bytes():
    kv = page_copies(gather_pages(_pool(jnp.float32), [1]), 1)[0]
    size = sum(x.nbytes for x in jax.tree.leaves(kv))
    tokens = list(range(6 * L))
    keys, pages = _pages(tokens, None, [kv] * 5)
    tier = HostTier(capacity_bytes=3 * size, page_size=L)
    for p in pages[:3]:
        assert tier.put(p) == []
    tier.touch(0, [keys[0]])  # page 0 used again: page 1 is now the oldest
    assert tier.keys == [(0, keys[1]), (0, keys[2]), (0, keys[0])]
    assert [p.key for p in tier.put(pages[3])] == [keys[1]]
    assert [p.key for p in tier.put(pages[4])] == [keys[2]]
    assert tier.keys == [(0, keys[0]), (0, keys[3]), (0, keys[4])]
    assert tier.used_bytes == 3 * size and tier.evicted_pages == 2
    assert tier.put(pages[0]) == [pages[0]]  # already held: the first copy stays, nothing evicted
    assert tier.clear() == 3 and len(tier) == 0 and tier.used_bytes == 0


def test_a_tier_too_small_holds_nothing_and_loses_nothing_it_held():
    kv = page_copies(gather_pages(_pool(jnp.float32), [1]), 1)[0]
    tokens = list(range(2 * L))
    _, pages = _pages(tokens, None, [kv] * 2)
    empty = HostTier(capacity_bytes=0, page_size=L)
    assert empty.put(pages[0]) == [pages[0]] and len(empty) == 0
    small = HostTier(capacity_bytes=pages[0].nbytes - 1, page_size=L)
    assert small.put(pages[0]) == [pages[0]] and small.used_bytes == 0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(capacity_bytes=-1, page_size=L), "capacity_bytes"),
    (dict(capacity_bytes=1.5, page_size=L), "capacity_bytes"),
    (dict(capacity_bytes=10, page_size=0), "page_size"),
])
def test_bad_tier_config_is_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        HostTier(**kwargs)


def test_bad_pages_and_lookups_are_named_and_change_nothing():
    kv = page_copies(gather_pages(_pool(jnp.float32), [1]), 1)[0]
    tokens = list(range(2 * L))
    keys, pages = _pages(tokens, None, [kv] * 2)
    tier = HostTier(capacity_bytes=10**6, page_size=L)
    tier.put(pages[0])
    short = HostPage(group=0, key=keys[1], parent_key=keys[0], tokens=(1, 2), extra=None, kv=kv)
    with pytest.raises(ValueError, match=r"page.tokens has 2 tokens, expected page_size=4"):
        tier.put(short)
    with pytest.raises(ValueError, match="page.group"):
        tier.put(HostPage(group=-1, key=keys[1], parent_key=keys[0], tokens=pages[1].tokens, extra=None, kv=kv))
    for kwargs, needle in ((dict(start=-1, max_pages=2), "start"), (dict(start=0, max_pages=-1), "max_pages"),
                           (dict(start=0, max_pages=2, group=-1), "group")):
        with pytest.raises(ValueError, match=needle):
            tier.lookup(tokens, keys, None, **kwargs)
    with pytest.raises(ValueError, match="pages is empty"):
        stack_pages([])
    assert tier.keys == [(0, keys[0])] and tier.used_bytes == pages[0].nbytes
