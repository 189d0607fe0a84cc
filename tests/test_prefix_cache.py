"""Prefix caching: hits skip prefill without changing a token, salts isolate,
collisions cannot hit, and every page comes back (free or cached).

The engine runs with ``check_page_state=True``: after every call the
device's page state is read back and compared with the host's twin.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.engine.core import Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.page_state import NULL_PAGE
from paged_jax.paging.prefix_cache import PrefixCache, chain_keys
from paged_jax.paging.sliding_window import window_first_kept
from tests.engine_helpers import PAGE, VOCAB, check_accounting, make_engine, serve, toy_requests


def test_keys_chain_and_lookup_verifies_tokens_parent_and_salt():
    cache = PrefixCache(PAGE)
    a = list(range(10))  # two full pages and a partial one
    keys = chain_keys(a, PAGE, ("s",), [])
    assert len(keys) == 2 and keys[0] != keys[1]
    assert chain_keys(a + [99] * 2, PAGE, ("s",), list(keys)) [:2] == keys  # a chain only grows
    assert cache.insert(7, a, keys, ("s",), 0) and cache.insert(3, a, keys, ("s",), 1)
    assert cache.lookup(a, keys, ("s",), 2) == [7, 3]
    assert cache.lookup(a, keys, ("s",), 1) == [7]  # capped
    assert cache.lookup(a, chain_keys(a, PAGE, ("t",), []), ("t",), 2) == []  # another salt: other keys
    # A forged collision: B's tokens looked up under A's keys must not hit.
    b = [1] + a[1:]
    assert cache.lookup(b, keys, ("s",), 2) == []
    c = a[:4] + [42] + a[5:]  # first page equal, second differs
    assert cache.lookup(c, keys, ("s",), 2) == [7]
    assert cache.lookup(a, keys, ("t",), 2) == []  # right keys, wrong extra key
    # A child is reached only through the parent recorded with it.
    cache.evict(7)
    assert cache.lookup(a, keys, ("s",), 2) == []
    assert cache.insert(9, a, keys, ("s",), 0)
    assert cache.lookup(a, keys, ("s",), 2) == [9]  # page 3's parent was 7, not 9
    assert not cache.insert(5, a, keys, ("s",), 0)  # the key is taken: the first page stays
    assert len(cache) == 2


def test_layer_groups_keep_their_own_pages_under_one_key():
    cache = PrefixCache(PAGE)
    a = list(range(3 * PAGE))
    keys = chain_keys(a, PAGE, (), [])
    assert cache.insert(5, a, keys, (), 0, group=0) and cache.insert(6, a, keys, (), 0, group=1)
    assert cache.lookup(a, keys, (), 1, group=0) == [5] and cache.lookup(a, keys, (), 1, group=1) == [6]
    assert cache.lookup(a, keys, (), 1, group=2) == []
    assert not cache.insert(7, a, keys, (), 0, group=1)  # the group's key is taken
    cache.evict(6)
    assert cache.lookup(a, keys, (), 1, group=1) == [] and cache.lookup(a, keys, (), 1, group=0) == [5]
    for call, match in ((lambda: cache.longest_hit(a, keys, (), -2, [None, 8]), "max_pages must be an int >= 0"),
                        (lambda: cache.longest_hit(a, keys, (), 2, []), "windows must name at least one"),
                        (lambda: cache.lookup(a, keys, (), 1, group=-1), "group must be an int >= 0"),
                        (lambda: cache.lookup_window(a, keys, (), 1, group=0, window=0), "window must be an int >= 1"),
                        (lambda: cache.insert(9, a, keys, (), 3), r"j must be an int in \[0, 3\), got j=3"),
                        (lambda: cache.insert(0, a, keys, (), 1), "page must be an int >= 1"),
                        (lambda: PrefixCache(0), "page_size must be an int >= 1")):
        with pytest.raises(ValueError, match=match):  # refused by name (a negative max_pages once looped for ever)
            call()
    assert len(cache) == 1


def test_a_sliding_group_hits_its_window_pages_alone():
    """Window 8, pages of 4: a hit of h pages needs columns
    window_first_kept(4h) .. h - 1 only; earlier ones are null."""
    cache = PrefixCache(PAGE)
    a = list(range(5 * PAGE + 1))
    keys = chain_keys(a, PAGE, (), [])
    for j, page in ((2, 12), (3, 13)):  # pages 0 and 1 never cached (dropped and evicted)
        assert cache.insert(page, a, keys, (), j, group=1, windowed=True)
    assert not cache.insert(20, a, keys, (), 3, group=0)  # a full group's page needs its parent
    # h = 4: the query at 16 sees (8, 16]: columns 2 and 3 (window_first_kept(16, 8, 4) = 2)
    assert cache.lookup_window(a, keys, (), 5, group=1, window=8) == [NULL_PAGE, NULL_PAGE, 12, 13]
    assert cache.lookup_window(a, keys, (), 3, group=1, window=8) == []  # h = 3 needs columns 1, 2
    assert cache.lookup_window(a, keys, (), 5, group=1, window=16) == []  # a wider window needs more
    # Page 3's parent key is checked: under a forged collision (page 3's key
    # the same, page 2's not) window 4's hit, page 3 alone, does not hit.
    forged = list(keys)
    forged[2] = b"x" * 32
    assert cache.lookup_window(a, forged, (), 5, group=1, window=4) == []
    assert cache.lookup_window(a, keys, (), 5, group=1, window=4) == [NULL_PAGE] * 3 + [13]


def brute_force_hit(cached, windows, max_pages):
    """The longest h every group serves, by trying every h."""
    def serves(g, h):
        first = 0 if windows[g] is None else int(window_first_kept(h * PAGE, sliding_window=windows[g],
                                                                  page_size=PAGE))
        return all(j in cached[g] for j in range(first, h))
    return max(h for h in range(max_pages + 1) if all(serves(g, h) for g in range(len(windows))))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_longest_hit_is_the_longest_every_group_serves(data):
    windows = data.draw(st.lists(st.sampled_from([None, 1, 4, 6, 8, 13]), min_size=1, max_size=4))
    num_pages = data.draw(st.integers(0, 9))
    tokens = list(range(num_pages * PAGE + 1))
    keys = chain_keys(tokens, PAGE, (), [])
    cache, cached, page = PrefixCache(PAGE), [set() for _ in windows], 1
    for g, window in enumerate(windows):
        for j in sorted(data.draw(st.sets(st.integers(0, max(num_pages - 1, 0)), max_size=num_pages))):
            if cache.insert(page, tokens, keys, (), j, group=g, windowed=window is not None):
                cached[g].add(j)
            page += 1
    max_pages = data.draw(st.integers(0, num_pages))
    hits = cache.longest_hit(tokens, keys, (), max_pages, windows)
    h = brute_force_hit(cached, windows, max_pages)
    assert [len(t) for t in hits] == [h] * len(windows)
    for g, table in enumerate(hits):  # null before the window, the group's own page for each column from there
        first = 0 if windows[g] is None else int(window_first_kept(h * PAGE, sliding_window=windows[g],
                                                                  page_size=PAGE))
        assert table[:first] == [NULL_PAGE] * first
        assert table[first:] == [cache._by_key[(g, keys[j])] for j in range(first, h)]


def test_hits_leave_greedy_outputs_unchanged_over_two_rounds():
    """Two rounds of the same prompts (the second all hits) give the outputs
    of an engine without caching, and the second round skips every full
    prompt page but the one holding the last token."""
    reqs = toy_requests(10, seed=11)
    off, e_off = serve(reqs, num_pages=200, prefix_caching=False)
    engine = make_engine()
    first = {o.request_id: o for o in engine.run(reqs)}
    again = [Request(request_id=("again", r.request_id), prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens)
             for r in reqs]
    second = {o.request_id[1]: o for o in engine.run(again)}
    for r in reqs:
        assert first[r.request_id].output_ids == off[r.request_id].output_ids
        assert second[r.request_id].output_ids == off[r.request_id].output_ids
        assert first[r.request_id].num_cached_tokens == 0
        assert second[r.request_id].num_cached_tokens == (len(r.prompt_ids) - 1) // PAGE * PAGE
    st = engine.stats
    assert st.prefix_hit_tokens == sum((len(r.prompt_ids) - 1) // PAGE * PAGE for r in reqs) > 0
    assert st.prompt_tokens == 2 * sum(len(r.prompt_ids) for r in reqs)
    assert e_off.stats.prefix_hit_tokens == 0 and e_off.kv_manager.prefix_cache is None
    assert st.prefill_tokens == e_off.stats.prefill_tokens * 2 - st.prefix_hit_tokens
    acc = check_accounting(engine)
    assert acc["used"] == 0 and acc["cached"] > 0


def test_one_prompt_five_times_first_misses_rest_hit():
    prompt = np.random.default_rng(5).integers(0, VOCAB, size=23).tolist()  # 5 full pages + 3 tokens
    reference = None
    engine = make_engine()
    for i in range(5):
        (out,) = engine.run([Request(request_id=i, prompt_ids=prompt, max_new_tokens=12)])
        reference = reference or out.output_ids
        assert out.output_ids == reference
        # The first misses; later ones hit the prompt's 5 pages and the
        # pages of the output the first one generated (the same tokens).
        assert out.num_cached_tokens == (0 if i == 0 else 20)
        check_accounting(engine)
    (off,) = serve([Request(request_id=0, prompt_ids=prompt, max_new_tokens=12)], num_pages=200,
                   prefix_caching=False)[0].values()
    assert off.output_ids == reference
    assert engine.stats.prefix_hit_rate == pytest.approx(4 * 20 / (5 * 23))


def test_concurrent_requests_share_pages_and_copy_nothing():
    """Requests sharing a 16-token system prompt, admitted in one call after
    the first has computed it, hold the same 4 pages (counted once in
    ``used``)."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, size=16).tolist()
    reqs = [Request(request_id=i, prompt_ids=system + rng.integers(0, VOCAB, size=5).tolist(), max_new_tokens=30,
                    ignore_eos=True) for i in range(4)]
    engine = make_engine()
    engine.add_request(reqs[0])
    engine.step()
    engine.step()  # the first request's pages are computed and offered
    for r in reqs[1:]:
        engine.add_request(r)
    engine.step()
    tables = [engine.kv_manager.pool.pages(s.slot) for s in engine.running]
    assert len(tables) == 4
    assert all(t[:4] == tables[0][:4] for t in tables)
    assert engine.kv_manager.pool.ref_counts[tables[0][0]] == 4
    acc = check_accounting(engine)
    assert acc["used"] == 4 + sum(len(t) - 4 for t in tables)
    assert engine.stats.pages_saved == 12
    outs = {o.request_id: o for o in engine.run()}
    solo = serve(reqs, num_pages=200, prefix_caching=False)[0]
    for r in reqs:
        assert outs[r.request_id].output_ids == solo[r.request_id].output_ids


def test_different_salts_never_share_a_page():
    prompt = np.random.default_rng(1).integers(0, VOCAB, size=30).tolist()
    engine = make_engine()
    engine.run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=3, cache_salt="alice")])
    (b,) = engine.run([Request(request_id="b", prompt_ids=prompt, max_new_tokens=3, cache_salt="bob")])
    (c,) = engine.run([Request(request_id="c", prompt_ids=prompt, max_new_tokens=3, cache_salt="alice")])
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 28
    # Running together: disjoint pages.
    for salt in ("carol", "dave"):
        engine.add_request(Request(request_id=salt, prompt_ids=prompt, max_new_tokens=20, cache_salt=salt))
    engine.step()
    engine.step()
    pages = [set(engine.kv_manager.pool.pages(s.slot)) for s in engine.running]
    assert len(pages) == 2 and not pages[0] & pages[1]
    engine.run()


def test_cached_pages_are_evicted_least_recently_freed_first_under_pressure():
    """With a pool barely larger than one request, a cached prefix is
    evicted by the requests that follow, and a later repeat of it misses
    but still gives the same tokens."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, size=40).tolist()
    engine = make_engine(num_pages=24)  # 23 usable pages, 80 tokens per sequence at most
    (first,) = engine.run([Request(request_id=0, prompt_ids=prompt, max_new_tokens=20)])
    others = [Request(request_id=i, prompt_ids=rng.integers(0, VOCAB, size=40).tolist(), max_new_tokens=40)
              for i in range(1, 4)]
    engine.run(others)
    (again,) = engine.run([Request(request_id=9, prompt_ids=prompt, max_new_tokens=20)])
    assert again.output_ids == first.output_ids
    assert again.num_cached_tokens < 36
    acc = check_accounting(engine)
    assert acc["used"] == 0


@pytest.mark.slow  # test_kv_manager pins a preempted group's own page ids; this is the sampled soak
def test_preempted_sequences_recompute_from_the_cache():
    """Under a small pool, preempted sequences find the pages they freed
    still cached when readmitted; outputs equal the unpressured run."""
    reqs = toy_requests(12, sampling=lambda i: SamplingParams(temperature=0.8, seed=i))
    big, _ = serve(reqs, num_pages=400)
    small, engine = serve(reqs, num_pages=25)
    assert engine.stats.preemptions > 0 and engine.stats.recompute_hit_tokens > 0
    for i in big:
        assert small[i].output_ids == big[i].output_ids


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])  # sync: a slow extra
def test_abort_soak_leaks_nothing_and_keeps_other_outputs(overlap):
    """A few hundred requests (many sharing prefixes) with random aborts of
    waiting and running ones: the rest give the outputs of a run without
    aborts, and afterwards every page is free or cached."""
    rng = np.random.default_rng(3)
    stems = [rng.integers(0, VOCAB, size=12).tolist() for _ in range(5)]
    reqs = [
        Request(request_id=i, prompt_ids=stems[i % 5] + rng.integers(0, VOCAB, size=int(rng.integers(1, 20))).tolist(),
                max_new_tokens=int(rng.integers(1, 25)))
        for i in range(240)
    ]
    engine = make_engine(num_pages=40, overlap=overlap)
    for r in reqs:
        engine.add_request(r)
    outs, aborted = {}, set()
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        live = list(engine._live)
        if live and rng.random() < 0.3:
            rid = live[int(rng.integers(len(live)))]
            o = engine.abort(rid)
            assert o.finish_reason == "abort"
            aborted.add(rid)
        check_accounting(engine)
    assert aborted and len(outs) + len(aborted) == len(reqs)
    with pytest.raises(ValueError, match="already finished or aborted"):
        engine.abort(next(iter(aborted)))
    with pytest.raises(ValueError, match="never added"):
        engine.abort("nobody")
    acc = check_accounting(engine)
    assert acc["used"] == 0 and acc["cached"] > 0
    engine.kv_manager.pool.check(engine.state)
    plain = serve([r for r in reqs if r.request_id in outs], num_pages=400, prefix_caching=False, check=False)[0]
    for rid, o in outs.items():
        assert o.output_ids == plain[rid].output_ids, rid
