"""The prefix cache's host tier in the engine (paged_jax.tiers.offload): pages
the pool evicts are spilled to host memory, a later hit that runs into them
loads them back before the request's first call, and outputs are those of an
engine without the tier (float, int8 and fp8 pages), bit for bit where a page
comes back. Salts stay apart, a tier too small degrades to none, a reset
forgets every tier, and bad settings are refused by name.

The store alone (keys, LRU by bytes, page copies): tests/test_host_tier.py.
"""

import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig
from models.llm import LLM
from models.presets import PRESETS
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import KVPool, init_kv_pool
from paged_jax.paging.prefix_cache import ROOT_KEY, PrefixCache, chain_keys
from paged_jax.paging.swap import gather_pages
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.tiers.disk import DiskTier, page_layout
from paged_jax.tiers.host import HostPage, HostTier, page_copies
from paged_jax.tiers.offload import Offload, TierStats
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
    assert host.hit_tokens == again.num_host_cached_tokens
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


@pytest.mark.parametrize("overlap, sampling, mode", [
    (True, None, "recompute"), (False, None, "recompute"),
    (True, SamplingParams(n=2, temperature=0.8, seed=3), "swap"),
    pytest.param(True, SamplingParams(beam_width=2), "recompute", marks=pytest.mark.slow)],
    ids=["greedy", "greedy-sync", "parallel-swap", "beams"])
def test_outputs_equal_with_the_tier_on_and_off_under_pressure(overlap, sampling, mode):
    """Repeated prompts in a pool that cannot keep them, preemption
    included (by recompute, or swap for parallel samples): outputs with
    the tier equal those without, and the tier served some of the hits."""
    rng = np.random.default_rng(7)
    bases = _prompts(8, 5, length=30)
    reqs = [Request(request_id=i, prompt_ids=bases[i % 5] + rng.integers(0, VOCAB, size=3).tolist(),
                    max_new_tokens=int(rng.integers(5, 25)), sampling=sampling or SamplingParams())
            for i in range(20)]
    outs = {}
    for host in (0, 200 * PAGE_BYTES):
        engine = make_engine(num_pages=30 if sampling is None else 32, max_seqs=4 if sampling is None else 6,
                             overlap=overlap, host_cache_bytes=host,
                             preemption_mode=mode)
        outs[host] = {o.request_id: [c.output_ids for c in o.outputs] for o in engine.run(reqs)}
        check_accounting(engine)
    assert outs[0] == outs[200 * PAGE_BYTES]
    assert engine.stats.host.hit_tokens > 0 and engine.stats.host.spilled_pages > 0 and engine.stats.preemptions > 0
    assert (engine.stats.swap_outs > 0) == (mode == "swap")


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
    assert st.refused_pages > 0 and st.spilled_pages == st.hit_tokens == 0 and len(none.kv_manager.offload.host) == 0
    small = make_engine(num_pages=24, host_cache_bytes=3 * PAGE_BYTES)
    _, again = _churn(small, prompt, others)
    assert again.output_ids == base.output_ids
    tier = small.kv_manager.offload.host
    assert len(tier) == 3 and tier.used_bytes == 3 * PAGE_BYTES and small.stats.host.evicted_pages > 0


def test_reset_prefix_cache_forgets_the_host_tier_too():
    prompt, *others = _prompts(2, 4)
    engine = make_engine(num_pages=24, host_cache_bytes=1000 * PAGE_BYTES)
    _churn(engine, prompt, others)
    assert len(engine.kv_manager.offload.host) > 0
    engine.reset_prefix_cache()
    assert len(engine.kv_manager.offload.host) == 0 and engine.kv_manager.offload.pending_pages == 0
    (out,) = engine.run([Request(request_id="after", prompt_ids=prompt, max_new_tokens=3)])
    assert out.num_cached_tokens == 0


def test_a_non_finite_page_is_never_stored(tmp_path):
    """A page whose K/V hold NaN (a poisoned call's) is refused by every
    tier when its copy reaches the host, and counted; a finite one is
    stored in both."""
    pool = init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=4, page_size=PAGE, head_dim=8, dtype=jnp.float32)
    pool = KVPool(k=pool.k.at[:, :, 2].set(jnp.nan), v=pool.v)
    cache, host_stats, disk_stats = PrefixCache(PAGE), TierStats(), TierStats()
    offload = Offload(HostTier(1 << 20, PAGE), DiskTier(tmp_path, 1 << 20, PAGE, "ab" * 32), host_stats, disk_stats)
    tokens = list(range(2 * PAGE))
    keys = chain_keys(tokens, PAGE, (), [])
    cache.insert(1, tokens, keys, (), 0)
    cache.insert(2, tokens, keys, (), 1)
    for page in (1, 2):
        offload.note_evicted(page, cache.entry(page))
    assert offload.pending_pages == 2
    offload.dispatch(pool)
    run = offload.lookup(tokens + [0], keys, (), 0, 2)
    assert [p.key for p in run.host] == [keys[0]] and run.disk == []  # the disk run starts after the host's
    assert [p.key for p in offload.disk.lookup(tokens, keys, (), 0, 2)] == [keys[0]]
    for st in (host_stats, disk_stats):
        assert st.spilled_pages == 1 and st.refused_pages == 1
    assert offload.pending_pages == 0 and run.host[0].parent_key == ROOT_KEY


class _FixedStepTime:
    def seconds(self, work):
        return 0.01


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"host_cache_bytes must be an int >= 0, got host_cache_bytes=-1"):
        EngineConfig(host_cache_bytes=-1)
    with pytest.raises(ValueError, match=r"host_cache_bytes=8 needs enable_prefix_caching=True"):
        EngineConfig(host_cache_bytes=8, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"host_cache_bytes=8: the KV tiers serve models whose layers all attend"):
        Engine(ToyModel(toy_params(), window=8), toy_pool(40),
               EngineConfig(max_seqs=2, max_seq_len=40, max_num_batched_tokens=16, host_cache_bytes=8),
               vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"host_cache_bytes=8, disk_cache_dir=None: the simulated accelerator has no"):
        SimulatedEngine(_FixedStepTime(), EngineConfig(host_cache_bytes=8), num_pages=300, page_size=16, vocab_size=100)


# ------------------------------------------------------------------ disk


def _disk_engine(folder, num_pages=24, disk_bytes=1 << 20, **kw):
    return make_engine(num_pages=num_pages, disk_cache_dir=str(folder), disk_cache_bytes=disk_bytes, **kw)


def test_a_second_engine_on_the_same_folder_hits_what_the_first_computed(tmp_path):
    """The disk tier outlives its engine: a new engine of the same model on
    the folder serves the whole prompt from it, bit for bit (the same
    tokens); a model of other weights hits nothing and names the folder's
    other fingerprint."""
    prompt = _prompts(2, 1)[0]
    first = _disk_engine(tmp_path)
    (a,) = first.run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=20)])
    assert first.stats.disk.spilled_pages == (40 + 20 - 1) // PAGE == len(first.kv_manager.offload.disk)
    second = _disk_engine(tmp_path)
    (b,) = second.run([Request(request_id="b", prompt_ids=prompt, max_new_tokens=20)])
    assert b.output_ids == a.output_ids and b.num_cached_tokens == b.num_disk_cached_tokens == 36
    assert second.stats.disk.loaded_pages == 9 and second.stats.disk.hit_tokens == 36
    other = Engine(ToyModel(toy_params(seed=1)), toy_pool(24),
                   EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64, disk_cache_dir=str(tmp_path),
                                disk_cache_bytes=1 << 20), vocab_size=VOCAB)
    (c,) = other.run([Request(request_id="c", prompt_ids=prompt, max_new_tokens=2)])
    assert c.num_cached_tokens == 0 and other.kv_manager.offload.disk.foreign_fingerprints == [
        first.kv_manager.offload.disk.fingerprint[:32]]


def test_bad_files_mid_run_are_refused_and_recomputed(tmp_path):
    prompt = _prompts(2, 1)[0]
    (a,) = _disk_engine(tmp_path).run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=20)])
    keys = chain_keys(prompt, PAGE, (None,), [])
    second = _disk_engine(tmp_path)
    disk = second.kv_manager.offload.disk
    path = disk.path(0, keys[3])
    path.write_bytes(path.read_bytes()[:-7])  # torn after the engine opened the folder
    disk.path(0, keys[6]).unlink()  # deleted
    (b,) = second.run([Request(request_id="b", prompt_ids=prompt, max_new_tokens=20)])
    assert b.output_ids == a.output_ids and b.num_disk_cached_tokens == 3 * PAGE  # pages 0-2, then the torn one
    assert second.stats.disk.refused_files == 1 and disk.refused == {"truncated": 1}
    assert disk.read(0, keys[3]) is not None  # deleted, recomputed and stored whole again


def test_one_hit_spans_device_host_and_disk(tmp_path):
    """A small pool keeps a chain's head, a small host tier the middle it
    spilled last, the disk every page: one hit takes all three."""
    prompt, other = _prompts(2, 2)
    engine = _disk_engine(tmp_path, host_cache_bytes=3 * PAGE_BYTES)
    # The prompt's 15 pages are freed tail first; the other request's 20 take the 8 never used, then 12 of
    # them from the tail: pages 0-2 stay on device, the host keeps the last 3 it took (3-5), the disk all.
    first, again = _churn(engine, prompt, [other])
    assert again.output_ids == first.output_ids and again.num_cached_tokens == 36
    device = again.num_cached_tokens - again.num_host_cached_tokens - again.num_disk_cached_tokens
    assert (device, again.num_host_cached_tokens, again.num_disk_cached_tokens) == (12, 12, 12)


def test_the_disk_tier_takes_nothing_from_the_host_tier(tmp_path):
    """With both tiers on, a page evicted and cached again under another
    key in one round keeps both copies: the host tier serves what it serves
    alone (a new user's report: the disk tier's copy of the new key replaced
    the host's copy of the old one)."""
    prompt, *others = _prompts(2, 4)
    _, alone = _churn(make_engine(num_pages=24, host_cache_bytes=1000 * PAGE_BYTES), prompt, others)
    both = _disk_engine(tmp_path, host_cache_bytes=1000 * PAGE_BYTES)
    _, again = _churn(both, prompt, others)
    assert again.output_ids == alone.output_ids and again.num_cached_tokens == alone.num_cached_tokens == 36
    assert again.num_host_cached_tokens == alone.num_host_cached_tokens > 0 and again.num_disk_cached_tokens == 0
    assert both.stats.host.spilled_pages == len(both.kv_manager.offload.host) > 0


def test_a_full_or_failing_disk_degrades_to_no_tier(tmp_path, monkeypatch):
    prompt, *others = _prompts(2, 4)
    _, base = _churn(make_engine(num_pages=24), prompt, others)
    full = _disk_engine(tmp_path / "full", disk_bytes=100)  # smaller than one page file
    _, again = _churn(full, prompt, others)
    assert again.output_ids == base.output_ids and again.num_disk_cached_tokens == 0
    assert full.stats.disk.refused_pages > 0 and full.stats.disk.spilled_pages == 0

    def fail(self, page):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskTier, "put", fail)
    failing = _disk_engine(tmp_path / "failing")
    _, again = _churn(failing, prompt, others)
    assert again.output_ids == base.output_ids and failing.stats.disk.refused_pages > 0


def test_reset_and_new_weights_leave_no_stale_page_on_disk(tmp_path):
    prompt = _prompts(2, 1)[0]
    engine = _disk_engine(tmp_path)
    engine.run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=4)])
    disk = engine.kv_manager.offload.disk
    assert len(disk) > 0
    engine.reset_prefix_cache()
    assert len(disk) == 0 and not list(disk.root.rglob("*.kv"))
    engine.run([Request(request_id="b", prompt_ids=prompt, max_new_tokens=4)])
    old = engine.kv_manager.offload.disk.fingerprint
    engine.update_weights(toy_params(seed=2))
    assert engine.kv_manager.offload.disk.fingerprint != old
    (c,) = engine.run([Request(request_id="c", prompt_ids=prompt, max_new_tokens=4)])
    assert c.num_cached_tokens == 0


def test_disk_settings_are_refused_by_name(tmp_path):
    for kwargs, words in [(dict(disk_cache_dir=str(tmp_path)), "needs disk_cache_bytes > 0"),
                          (dict(disk_cache_bytes=5), "disk_cache_bytes=5 without disk_cache_dir"),
                          (dict(disk_cache_dir=str(tmp_path), disk_cache_bytes=5, enable_prefix_caching=False),
                           "needs enable_prefix_caching=True"),
                          (dict(disk_cache_dir=7, disk_cache_bytes=5), "disk_cache_dir must be a folder path"),
                          (dict(disk_cache_dir=__file__ + "/sub", disk_cache_bytes=5),
                           "cannot be written: '.*test_kv_tiers.py' is not a writable folder"),
                          (dict(disk_cache_dir=__file__, disk_cache_bytes=5), "is a file, expected a folder"),
                          (dict(disk_cache_dir="  ", disk_cache_bytes=5), "is not a folder path"),
                          (dict(disk_cache_dir="a\0b", disk_cache_bytes=5), "is not a folder path")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(**kwargs)
    # "~" is the home folder, as on a command line, not a folder named "~" under the working directory.
    home = EngineConfig(disk_cache_dir="~/paged-jax-kv-test", disk_cache_bytes=5).disk_cache_dir
    assert home == str(Path.home() / "paged-jax-kv-test")


def test_what_a_breaker_found_is_refused_and_the_engine_goes_on(tmp_path):
    """A folder or a pipe under a page's name, a file of the right checksum
    but another layout, and an update_weights whose new folder cannot be
    made: each refused by name or reason, the engine unchanged and serving
    (a breaking helper's reports)."""
    prompt = _prompts(2, 1)[0]
    (a,) = _disk_engine(tmp_path).run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=8)])
    keys = chain_keys(prompt, PAGE, (None,), [])
    second = _disk_engine(tmp_path)
    disk = second.kv_manager.offload.disk
    disk.path(0, keys[1]).unlink()
    disk.path(0, keys[1]).mkdir()  # a folder under a page's name
    os.mkfifo(disk.path(0, keys[5]).with_suffix(".tmp"))  # (no page's name: ignored)
    (b,) = second.run([Request(request_id="b", prompt_ids=prompt, max_new_tokens=8)])
    assert b.output_ids == a.output_ids and b.num_disk_cached_tokens == PAGE and disk.refused == {"not a file": 1}
    (c,) = second.run([Request(request_id="c", prompt_ids=prompt[:20], max_new_tokens=2)])  # still serving
    # Same weights and pool, another model configuration: another fingerprint, no hit.
    other = Engine(ToyModel(toy_params(), window=None), toy_pool(24),
                   EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64, disk_cache_dir=str(tmp_path),
                                disk_cache_bytes=1 << 20), vocab_size=VOCAB)
    other.model.config = "another configuration"
    assert other._fingerprint(other.kv) != disk.fingerprint
    # update_weights whose folder is taken by a file: refused by name, nothing changed.
    new = toy_params(seed=5)
    blocker = tmp_path / second._disk_tier(second.kv, second._fingerprint(second.kv, new)).fingerprint[:32]
    shutil.rmtree(blocker)
    blocker.write_text("x")
    old_params, old_fp = second.params, disk.fingerprint
    with pytest.raises(ValueError, match="disk_cache_dir=.* cannot hold the disk tier"):
        second.update_weights(new)
    assert second.params is old_params and second.kv_manager.offload.disk.fingerprint == old_fp
    (d,) = second.run([Request(request_id="d", prompt_ids=prompt, max_new_tokens=8)])
    assert d.output_ids == a.output_ids and d.num_cached_tokens == 36


def test_a_disk_file_of_another_layout_is_refused(tmp_path):
    pool = toy_pool(4)
    wide = init_kv_pool(num_layers=1, num_kv_heads=2, num_pages=4, page_size=PAGE, head_dim=8)
    tokens = list(range(2 * PAGE))
    keys = chain_keys(tokens, PAGE, (None,), [])
    writer = DiskTier(tmp_path, 1 << 20, PAGE, "ab" * 32)  # no layout: writes what it is given
    writer.put(HostPage(group=0, key=keys[0], parent_key=ROOT_KEY, tokens=tuple(tokens[:PAGE]), extra=(None,),
                        kv=page_copies(gather_pages(wide, [1]), 1)[0]))
    reader = DiskTier(tmp_path, 1 << 20, PAGE, "ab" * 32, layout=page_layout(pool))
    assert reader.lookup(tokens, keys, (None,), 0, 1) == [] and reader.refused == {"header": 1}


def test_a_hit_keeps_a_chains_head_longest(tmp_path):
    """touch marks a run's first page most recently used: a bound that
    drops pages takes the tail, so what is left is still a hit."""
    tier = HostTier(1 << 20, PAGE)
    tier.touch(0, [])
    tokens = list(range(4 * PAGE))
    keys = chain_keys(tokens, PAGE, (None,), [])
    kv = page_copies(gather_pages(toy_pool(4), [1]), 1)[0]
    pages = [HostPage(group=0, key=keys[j], parent_key=keys[j - 1] if j else ROOT_KEY,
                      tokens=tuple(tokens[j * PAGE:(j + 1) * PAGE]), extra=(None,), kv=kv) for j in range(3)]
    for p in pages:
        tier.put(p)
    tier.touch(0, keys[:3])
    assert tier.keys == [(0, keys[2]), (0, keys[1]), (0, keys[0])]  # least recently used first: the tail
    disk = DiskTier(tmp_path, 1 << 20, PAGE, "cd" * 32)
    for p in pages:
        disk.put(p)
    disk.touch(0, keys[:3])
    assert list(disk._files) == [(0, keys[2]), (0, keys[1]), (0, keys[0])]
