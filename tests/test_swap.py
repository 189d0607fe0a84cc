"""Swap: page copies to host memory and back are bit-identical, refuse what
does not fit, and preemption by swap (PagedAttention section 4.5) gives the
outputs of an unpressured run, falling back to recompute when the swap
space is too small.

Beams and parallel-sampling groups under swap have their tests beside their
features (tests/test_beam_search.py, tests/test_parallel_sampling.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.core import EngineConfig
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import KVPool, copy_pages
from paged_jax.paging.swap import SwappedGroup, SwapSpace, gather_pages, scatter_pages
from pallas_kernels.common import QUANTIZED_KV_DTYPES, is_quantized
from tests.engine_helpers import check_accounting, make_engine, serve, toy_requests

# ---------------------------------------------------------------- page copies


@pytest.mark.parametrize("dtype", [jnp.float32, *QUANTIZED_KV_DTYPES], ids=lambda d: jnp.dtype(d).name)
def test_swap_round_trip_is_bit_identical(dtype):
    rng = np.random.default_rng(6)
    k = rng.normal(size=(2, 3, 12, 4, 8)).astype(np.float32)  # [layers, K, P, L, H]
    quantized = is_quantized(dtype)
    if quantized:  # quantized pages (int8, fp8) and their per-token scales travel together
        pool = KVPool(k=jnp.asarray(k * 10, dtype), v=jnp.asarray(-k * 10, dtype),
                      k_scale=jnp.asarray(k[..., 0]), v_scale=jnp.asarray(-k[..., 1]))
    else:
        pool = KVPool(k=jnp.asarray(k), v=jnp.asarray(-k))
    before = [np.asarray(x) for x in jax.tree.leaves(pool)]
    copied = gather_pages(pool, [3, 5, 7])
    assert copied.k.shape[2] == 4 and next(iter(copied.k.devices())).platform == "cpu"  # padded to a power of 2
    assert copied.quantized == quantized
    pool = scatter_pages(pool, [10, 2, 8], copied, source=[2, 0, 1])  # page 7 -> 10, 3 -> 2, 5 -> 8
    for old, new in zip(before, jax.tree.leaves(pool)):
        new = np.asarray(new)
        for dst, src in ((10, 7), (2, 3), (8, 5)):
            assert new[:, :, dst].tobytes() == old[:, :, src].tobytes()
        for untouched in (1, 3, 4, 5, 6, 7, 9, 11):
            assert new[:, :, untouched].tobytes() == old[:, :, untouched].tobytes()
    with pytest.raises(ValueError, match="source must give"):
        scatter_pages(pool, [1, 2], copied, source=[0, 9])
    if quantized:
        other = KVPool(k=jnp.zeros((2, 3, 12, 4, 8)), v=jnp.zeros((2, 3, 12, 4, 8)))
        with pytest.raises(ValueError, match=f"copied pages are {jnp.dtype(dtype).name} but the pool is float"):
            scatter_pages(other, [1], copied, source=[0])
        # Another quantized dtype: same layout, other bytes.
        alien = jnp.float8_e5m2 if dtype != jnp.float8_e5m2 else jnp.int8
        other = KVPool(k=pool.k.astype(alien), v=pool.v.astype(alien), k_scale=pool.k_scale, v_scale=pool.v_scale)
        with pytest.raises(ValueError, match=f"copied k {jnp.dtype(dtype).name}.* does not fit the pool's "
                                             f"{jnp.dtype(alien).name}"):
            scatter_pages(other, [1], copied, source=[0])


def test_swap_copies_refuse_bad_pages_and_shapes():
    pool = KVPool(k=jnp.zeros((2, 1, 4, 4, 8)), v=jnp.zeros((2, 1, 4, 4, 8)))
    copied = gather_pages(pool, [1, 2])
    for bad in ([9], [-2], [1.5]):
        with pytest.raises(ValueError, match=r"pages must be page ids in \[0, num_pages=4\)"):
            gather_pages(pool, bad)
        with pytest.raises(ValueError, match=r"pages must be page ids in \[0, num_pages=4\)"):
            scatter_pages(pool, bad, copied, source=[0])
    with pytest.raises(ValueError, match="pages is empty"):
        scatter_pages(pool, [], copied, source=[])
    one_layer = gather_pages(KVPool(k=jnp.zeros((1, 1, 4, 4, 8)), v=jnp.zeros((1, 1, 4, 4, 8))), [1])
    with pytest.raises(ValueError, match=r"copied k float32\[1, 1, 1, 4, 8\] does not fit the pool's"):
        scatter_pages(pool, [2], one_layer, source=[0])
    with pytest.raises(ValueError, match=r"dst must be page ids in \[0, num_pages=4\) or -1, got \[9\]"):
        copy_pages(pool, jnp.asarray([1]), jnp.asarray([9]))
    with pytest.raises(ValueError, match="src and dst must be i32"):
        copy_pages(pool, jnp.asarray([1, 2]), jnp.asarray([3]))
    with pytest.raises(ValueError, match="src must be integer page ids, got dtype bool"):
        copy_pages(pool, jnp.asarray([True]), jnp.asarray([2]))
    with pytest.raises(ValueError, match="an int8 kv pool needs k_scale"):
        copy_pages(KVPool(k=pool.k.astype(jnp.int8), v=pool.v.astype(jnp.int8)), jnp.asarray([1]), jnp.asarray([2]))
    fp8 = pool.k.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="a float8_e4m3fn kv pool needs k_scale and v_scale"):
        copy_pages(KVPool(k=fp8, v=fp8), jnp.asarray([1]), jnp.asarray([2]))


# ---------------------------------------------------------------- swap space


def test_swap_space_counts_pages_and_refuses_past_capacity():
    def group(num_pages):
        return SwappedGroup(pages=None, num_pages=num_pages, tables={0: list(range(num_pages))},
                            num_tokens={0: 4 * num_pages})

    space = SwapSpace(6)
    space.put("a", group(4))
    assert "a" in space and space.used == 4 and space.get("a").num_pages == 4
    assert space.fits(2) and not space.fits(3)
    with pytest.raises(ValueError, match=r"swap space full: 4 \+ 3 pages > capacity 6"):
        space.put("b", group(3))
    assert "b" not in space and space.get("b") is None and space.used == 4
    space.put("b", group(2))
    assert space.used == 6
    assert space.pop("a").num_pages == 4
    assert "a" not in space and space.used == 2


@pytest.mark.parametrize("kwargs, needle", [
    (dict(preemption_mode="drop"), r"preemption_mode must be one of \('recompute', 'swap'\)"),
    (dict(swap_space_pages=-1), "swap_space_pages"),
])
def test_bad_swap_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)


# ------------------------------------------------------- preemption by swap

def sampled_requests():
    return toy_requests(12, sampling=lambda i: SamplingParams(temperature=0.8, top_p=0.9, seed=i))


@functools.cache
def _unpressured():
    """The large pool's outputs, shared by every swap variant."""
    return serve(sampled_requests(), num_pages=400)[0]


@pytest.mark.parametrize("swap_pages, prefix_caching", [
    (None, True),  # default capacity: as many pages as the pool
    pytest.param(None, False, marks=pytest.mark.slow),  # without prefix caching: a slow extra
    (6, True),  # too small for long sequences: they are recomputed
    pytest.param(0, True, marks=pytest.mark.slow),  # no swap space: recompute, as test_engine's preemption test
])
def test_swap_preemption_does_not_change_outputs(swap_pages, prefix_caching):
    """Sequences preempted by swap resume from their copied pages and give
    the outputs of a pool large enough for all; sequences the swap space
    cannot take are recomputed."""
    reqs = sampled_requests()
    big = _unpressured()
    # 80 tokens per sequence at most = 20 pages; 24 usable pages force preemption.
    small, engine = serve(reqs, num_pages=25, preemption_mode="swap", swap_space_pages=swap_pages,
                          prefix_caching=prefix_caching)
    st = engine.stats
    assert st.preemptions > 0
    if swap_pages == 0:
        assert st.swap_outs == 0 and st.swapped_in_pages == 0
    else:
        assert st.swap_outs > 0 and st.swapped_in_pages == st.swapped_out_pages > 0
    if swap_pages == 6:
        assert st.swap_outs < st.preemptions
    for i in big:
        assert small[i].output_ids == big[i].output_ids, i
    assert engine.kv_manager.swap.used == 0 and check_accounting(engine)["used"] == 0
    assert engine.num_free_pages == 24 and int(engine.state.num_free_pages) == 24
    assert (np.asarray(engine.state.ref_counts) == 0).all()


@pytest.mark.parametrize("n, num_pages", [pytest.param(1, 21, marks=pytest.mark.slow), (4, 45)])  # 10 pages a
# sequence at most, 40 a group of 4; the group is the harder case, one sequence a slow extra
def test_abort_a_swapped_request_empties_its_swap_space(n, num_pages):
    """Aborting a request while it is swapped out gives its pages in host
    memory back (a group of n samples is swapped, and given back, whole)."""
    reqs = toy_requests(8, seed=7, prompt_len=(2, 20), max_new=(5, 20),
                        sampling=lambda i: SamplingParams(temperature=0.8, seed=100 + i, n=n))
    engine = make_engine(num_pages, max_seqs=16, preemption_mode="swap")
    for r in reqs:
        engine.add_request(r)
    while not engine.kv_manager.swap.used:
        assert engine.has_unfinished(), "no request was swapped out"
        engine.step()
    victim = next(g for g in engine._live.values() if g in engine.kv_manager.swap)
    used, pages = engine.kv_manager.swap.used, engine.kv_manager.swap.get(victim).num_pages
    engine.abort(victim.request.request_id)
    assert victim not in engine.kv_manager.swap and engine.kv_manager.swap.used == used - pages
    engine.run()
    assert engine.kv_manager.swap.used == 0 and check_accounting(engine)["used"] == 0



def test_swap_in_keeps_the_pools_argument_signature():
    """A pool coming back from the swap space is committed to its device
    only if it was before: a committed pool where the step was compiled for
    an uncommitted one is a new signature, and every program the engine
    runs would compile again after the first swap-in."""
    pool = KVPool(k=jnp.zeros((1, 1, 4, 2, 2)), v=jnp.zeros((1, 1, 4, 2, 2)))
    assert not pool.k.committed
    back = scatter_pages(pool, [2], gather_pages(pool, [1]))
    assert not back.k.committed and not back.v.committed
    committed = jax.device_put(KVPool(k=jnp.zeros((1, 1, 4, 2, 2)), v=jnp.zeros((1, 1, 4, 2, 2))), jax.devices()[0])
    assert scatter_pages(committed, [2], gather_pages(committed, [1])).k.committed
    _, engine = serve(sampled_requests(), num_pages=25, preemption_mode="swap")
    assert engine.stats.swapped_in_pages > 0 and not engine.kv.k.committed
