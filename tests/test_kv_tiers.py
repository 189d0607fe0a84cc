"""The prefix cache's host tier in the engine (paged_jax.tiers.offload): pages
the pool evicts are spilled to host memory, a later hit that runs into them
loads them back before the request's first call, and outputs are those of an
engine without the tier (float, int8 and fp8 pages), bit for bit where a page
comes back. Salts stay apart, a tier too small degrades to none, a reset
forgets every tier, and bad settings are refused by name.

The store alone (keys, LRU by bytes, page copies): tests/test_host_tier.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig
from models.llm import LLM
from models.presets import PRESETS
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.paging.kv_cache import KVPool, init_kv_pool
from paged_jax.paging.prefix_cache import ROOT_KEY, PrefixCache, chain_keys
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.tiers.host import HostTier
from paged_jax.tiers.offload import HostOffload, TierStats
from tests.engine_helpers import PAGE, VOCAB, ToyModel, check_accounting, make_engine, toy_params, toy_pool

PAGE_BYTES = 2 * toy_pool(2).k[:, :, :1].nbytes  # K and V of one page of the toy pool (f32)


def _prompts(seed, n, length=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=length).tolist() for _ in range(n)]


def _churn(engine, prompt, others, *, salt=None):
    """Runs ``prompt``, then ``others`` (which evict its pages from a small
    pool), then ``prompt`` again; returns both outputs of ``prompt``."""
    (first,) = engine.run([Request(request_id="first", prompt_ids=prompt, max_new_tokens=20, cache_salt=salt)])
    engine.run([Request(request_id=("other", i), prompt_ids=p, max_new_tokens=40) for i, p in enumerate(others)])
    engine.loaded_before_again = engine.stats.host.loaded_pages
    (again,) = engine.run([Request(request_id="again", prompt_ids=prompt, max_new_tokens=20, cache_salt=salt)])
    return first, again


def test_an_evicted_prefix_comes_back_from_the_host_tier():
    """The eviction test of tests/test_prefix_cache.py with a host tier: the
    repeat hits its whole prompt (device and host together), outputs equal,
    and every page spilled or loaded is counted with its bytes."""
    prompt, *others = _prompts(2, 4)
    off_first, off_again = _churn(make_engine(num_pages=24), prompt, others)
    assert off_again.num_cached_tokens < 36  # without the tier the pool lost most of the prefix
    engine = make_engine(num_pages=24, host_cache_bytes=1000 * PAGE_BYTES)
    first, again = _churn(engine, prompt, others)
    assert first.output_ids == again.output_ids == off_first.output_ids
    assert again.num_cached_tokens == 36  # (40 - 1) // 4 whole pages: the last token is always computed
    assert again.num_host_cached_tokens == 36 - off_again.num_cached_tokens > 0
    host = engine.stats.host
    assert host.hit_tokens == again.num_host_cached_tokens and host.hit_pages == host.loaded_pages
    assert host.loaded_pages - engine.loaded_before_again == again.num_host_cached_tokens // PAGE
    assert host.spilled_pages > 0 and host.spilled_bytes == host.spilled_pages * PAGE_BYTES
    assert host.loaded_bytes == host.loaded_pages * PAGE_BYTES and host.refused_pages == host.evicted_pages == 0
    assert engine.stats.prefix_hit_tokens == 36
    acc = check_accounting(engine)
    assert acc["used"] == 0


def test_pages_come_back_bit_for_bit():
    """A prefix's pages read out of the pool before the churn equal the
    pages it is served from after the host tier loaded them back."""
    prompt, *others = _prompts(3, 4)
    engine = make_engine(num_pages=24, host_cache_bytes=1000 * PAGE_BYTES)
    engine.run([Request(request_id=0, prompt_ids=prompt, max_new_tokens=2)])
    kvm = engine.kv_manager
    keys = chain_keys(prompt, PAGE, (None,), [])  # a request's extra key: (cache_salt,)
    before = kvm.prefix_cache.lookup(prompt, keys, (None,), 9)
    assert len(before) == 9
    saved = [np.asarray(jax.device_get(x))[:, :, before] for x in (engine.kv.k, engine.kv.v)]
    engine.run([Request(request_id=("o", i), prompt_ids=p, max_new_tokens=40) for i, p in enumerate(others)])
    assert len(kvm.prefix_cache.lookup(prompt, keys, (None,), 9)) < 9
    (again,) = engine.run([Request(request_id=1, prompt_ids=prompt, max_new_tokens=2)])
    assert again.num_host_cached_tokens > 0
    after = kvm.prefix_cache.lookup(prompt, keys, (None,), 9)
    assert len(after) == 9
    for old, new in zip(saved, (engine.kv.k, engine.kv.v)):
        np.testing.assert_array_equal(np.asarray(jax.device_get(new))[:, :, after], old)


@pytest.mark.parametrize("overlap", [True, False])
def test_outputs_equal_with_the_tier_on_and_off_under_pressure(overlap):
    """Repeated prompts in a pool that cannot keep them, recompute
    preemption included: greedy outputs with the tier equal those without,
    and the tier served some of the hits."""
    rng = np.random.default_rng(7)
    bases = _prompts(8, 5, length=30)
    reqs = [Request(request_id=i, prompt_ids=bases[i % 5] + rng.integers(0, VOCAB, size=3).tolist(),
                    max_new_tokens=int(rng.integers(5, 25))) for i in range(20)]
    outs = {}
    for host in (0, 200 * PAGE_BYTES):
        engine = make_engine(num_pages=30, max_seqs=4, overlap=overlap, host_cache_bytes=host)
        outs[host] = {o.request_id: o.output_ids for o in engine.run(reqs)}
        check_accounting(engine)
    assert outs[0] == outs[200 * PAGE_BYTES]
    assert engine.stats.host.hit_tokens > 0 and engine.stats.host.spilled_pages > 0


@pytest.fixture()
def tiny(monkeypatch):
    monkeypatch.setitem(PRESETS, "tiny", LlamaConfig(vocab_size=64, model_dim=32, mlp_dim=64, num_layers=2,
                                                     num_q_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=64))


@pytest.mark.parametrize("kv_dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_quantized_pages_and_their_scales_round_trip_through_the_tier(tiny, kv_dtype):
    """int8 and fp8 pages (their per-token scales with them) come back from
    the host tier: the repeat's tokens equal the first run's and a run
    without the tier."""
    prompts = _prompts(4, 4, length=34)
    prompts = [[t % 64 for t in p] for p in prompts]
    runs = []
    for host in (0, 1 << 20):
        llm = LLM("tiny", dtype=jnp.float32, kv_dtype=kv_dtype, kv_tokens=64, page_size=4, max_seqs=2,
                  host_cache_bytes=host)
        outs = [llm.generate([p], max_tokens=8)[0] for p in (prompts[0], *prompts[1:], prompts[0])]
        runs.append(outs)
    off, on = runs
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    assert on[-1].num_host_cached_tokens > 0 and on[-1].num_cached_tokens == 32
    assert off[-1].num_cached_tokens < 32


def test_a_salt_never_hits_another_salts_pages_in_the_host_tier():
    prompt, *others = _prompts(5, 4)
    engine = make_engine(num_pages=24, host_cache_bytes=1000 * PAGE_BYTES)
    _churn(engine, prompt, others, salt="alice")
    (bob,) = engine.run([Request(request_id="bob", prompt_ids=prompt, max_new_tokens=3, cache_salt="bob")])
    assert bob.num_cached_tokens == 0 and bob.num_host_cached_tokens == 0
    engine.run([Request(request_id=("x", i), prompt_ids=p, max_new_tokens=40) for i, p in enumerate(others)])
    (alice,) = engine.run([Request(request_id="alice", prompt_ids=prompt, max_new_tokens=3, cache_salt="alice")])
    assert alice.num_cached_tokens == 36 and alice.num_host_cached_tokens > 0


def test_a_tier_too_small_degrades_to_none_and_a_small_one_evicts():
    prompt, *others = _prompts(2, 4)
    _, base = _churn(make_engine(num_pages=24), prompt, others)
    none = make_engine(num_pages=24, host_cache_bytes=PAGE_BYTES - 1)  # not one page
    _, again = _churn(none, prompt, others)
    assert again.output_ids == base.output_ids and again.num_cached_tokens == base.num_cached_tokens
    st = none.stats.host
    assert st.refused_pages > 0 and st.spilled_pages == st.hit_tokens == 0 and len(none.kv_manager.offload.tier) == 0
    small = make_engine(num_pages=24, host_cache_bytes=3 * PAGE_BYTES)
    _, again = _churn(small, prompt, others)
    assert again.output_ids == base.output_ids
    tier = small.kv_manager.offload.tier
    assert len(tier) == 3 and tier.used_bytes == 3 * PAGE_BYTES and small.stats.host.evicted_pages > 0


def test_reset_prefix_cache_forgets_the_host_tier_too():
    prompt, *others = _prompts(2, 4)
    engine = make_engine(num_pages=24, host_cache_bytes=1000 * PAGE_BYTES)
    _churn(engine, prompt, others)
    assert len(engine.kv_manager.offload.tier) > 0
    engine.reset_prefix_cache()
    assert len(engine.kv_manager.offload.tier) == 0 and engine.kv_manager.offload.pending_pages == 0
    (out,) = engine.run([Request(request_id="after", prompt_ids=prompt, max_new_tokens=3)])
    assert out.num_cached_tokens == 0


def test_a_non_finite_page_is_never_stored():
    """A page whose K/V hold NaN (a poisoned call's) is refused when its
    copy reaches the host, and counted."""
    pool = init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=4, page_size=PAGE, head_dim=8, dtype=jnp.float32)
    pool = KVPool(k=pool.k.at[:, :, 2].set(jnp.nan), v=pool.v)
    cache, stats = PrefixCache(PAGE), TierStats()
    offload = HostOffload(HostTier(1 << 20, PAGE), stats)
    tokens = list(range(2 * PAGE))
    keys = chain_keys(tokens, PAGE, (), [])
    cache.insert(1, tokens, keys, (), 0)
    cache.insert(2, tokens, keys, (), 1)
    for page in (1, 2):
        offload.note_evicted(page, cache.entry(page))
    assert offload.pending_pages == 2
    offload.dispatch(pool)
    assert offload.lookup(tokens + [0], keys, (), 0, 2) == offload.tier.lookup(tokens, keys, (), 0, 2)
    assert [p.key for p in offload.tier.lookup(tokens, keys, (), 0, 2)] == [keys[0]]
    assert stats.spilled_pages == 1 and stats.refused_pages == 1 and offload.pending_pages == 0
    assert offload.tier.lookup(tokens, keys, (), 0, 2)[0].parent_key == ROOT_KEY


class _FixedStepTime:
    def seconds(self, work):
        return 0.01


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"host_cache_bytes must be an int >= 0, got host_cache_bytes=-1"):
        EngineConfig(host_cache_bytes=-1)
    with pytest.raises(ValueError, match=r"host_cache_bytes=8 needs enable_prefix_caching=True"):
        EngineConfig(host_cache_bytes=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"host_cache_bytes=8: the host tier serves models whose layers all attend"):
        Engine(ToyModel(toy_params(), window=8), toy_pool(40),
               EngineConfig(max_seqs=2, max_seq_len=40, max_num_batched_tokens=16, host_cache_bytes=8),
               vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"config.host_cache_bytes=8: the simulated accelerator has no K/V"):
        SimulatedEngine(_FixedStepTime(), EngineConfig(host_cache_bytes=8), num_pages=300, page_size=16, vocab_size=100)
