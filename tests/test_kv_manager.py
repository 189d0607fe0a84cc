"""The KV manager's behaviour as the engine sees it, with exact page ids:
tail-first freeing keeps cached chains reachable, a preempted group finds
its own pages, two requests admitted in one step share their common prefix,
and the engine forgets the ids of finished requests.

Pages are 4 tokens (``PAGE``); page 0 is the null page, so a fresh pool
hands out 1, 2, 3, ... in that order.
"""

import jax.numpy as jnp
import numpy as np

from paged_jax.engine.core import Request
from paged_jax.paging import page_state as ps
from paged_jax.paging.block_pool import BlockPool
from tests.engine_helpers import PAGE, VOCAB, check_accounting, make_engine, serve

assert PAGE == 4


def _queue(state) -> list[int]:
    cap = state.free_queue.shape[0]
    head, n = int(state.free_head), int(state.num_free_pages)
    return np.asarray(state.free_queue)[(head + np.arange(n)) % cap].tolist()


def test_pages_freed_together_join_the_queue_tail_first():
    """Slot 0 holds [1, 2, 3], slot 1 its fork [1, 2, 3] grown by page 6
    (4 and 5 belong to slot 2). Freed in one call: each slot's pages tail
    first, slots in order, a shared page where its last holder puts it:
    slot 0 gives 3 2 1, slot 1 gives 6 3 2 1, slot 2 gives 5 4, so the
    queue gains 6 3 2 1 5 4 after the never-used pages 7..11."""
    state = ps.init_page_state(num_pages=12, max_seqs=3, max_pages_per_seq=4, page_size=PAGE)
    pool = BlockPool(num_pages=12, max_seqs=3, max_pages_per_seq=4, page_size=PAGE)
    state, _ = ps.allocate(state, 0, 12)
    state = ps.fork(state, 0, 1)
    state, _ = ps.allocate(state, 2, 8)
    state, *_ = ps.extend(state, jnp.array([0, 4, 0], jnp.int32))
    pool.share(0, pool.take_free(3))
    pool.fork(0, 1)
    pool.share(2, pool.take_free(2))
    pool.extend(np.array([0, 4, 0]))
    assert np.asarray(state.block_tables).tolist() == [[1, 2, 3, 0], [1, 2, 3, 6], [4, 5, 0, 0]]
    state = ps.free(state, jnp.array([True, True, True]))
    for slot in (2, 0, 1):  # the host's release order does not matter: the call frees in slot order
        pool.release(slot)
    assert pool.free_pages() == [7, 8, 9, 10, 11, 6, 3, 2, 1, 5, 4]
    pool.flush()
    assert _queue(state) == [7, 8, 9, 10, 11, 6, 3, 2, 1, 5, 4]
    pool.check(state)


def test_evicting_a_chains_tail_keeps_its_head_reachable():
    """A 4-page pool. A's prompt fills pages 1 2 3 (cached) and its last
    tokens page 4; freed tail first the queue is 4 3 2 1. B needs two
    pages and takes 4 and 3, evicting only A's last cached page; A's prompt
    again then still hits pages 1 and 2 (8 tokens). Freed head first (the
    old order) B would have taken 1 and 2 and the repeat would hit nothing."""
    engine = make_engine(num_pages=5, max_seq_len=16, check=True)
    prompt = np.random.default_rng(0).integers(0, VOCAB, size=13).tolist()
    (a,) = engine.run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=3)])
    pool = engine.kv_manager.pool
    assert pool.free_pages() == [4, 3, 2, 1]
    assert sorted(engine.kv_manager.prefix_cache.pages) == [1, 2, 3]
    engine.add_request(Request(request_id="b", prompt_ids=[7, 8, 9, 10, 11], max_new_tokens=2))
    engine.step()
    (b_seq,) = engine.running
    assert pool.pages(b_seq.slot) == [4, 3]
    engine.run()
    assert sorted(engine.kv_manager.prefix_cache.pages) == [1, 2, 4]  # B's first page is cached too
    (again,) = engine.run([Request(request_id="a2", prompt_ids=prompt, max_new_tokens=3)])
    assert again.num_cached_tokens == 8
    assert again.output_ids == a.output_ids
    check_accounting(engine)


def test_a_preempted_group_finds_its_own_pages_when_readmitted():
    """12 usable pages. A (4-token prompt, 30 new) and B (9-token prompt,
    20 new) start together: A's prompt fills page 1, B's fills 2 and 3 and
    its ninth token goes to page 4. A grows until B, the newest, is
    preempted; B's pages are freed tail first, A's growth takes B's newest
    pages, and B readmitted hits its prompt pages 2 and 3 again."""
    rng = np.random.default_rng(3)
    reqs = [Request(request_id="a", prompt_ids=rng.integers(0, VOCAB, size=4).tolist(), max_new_tokens=30),
            Request(request_id="b", prompt_ids=rng.integers(0, VOCAB, size=9).tolist(), max_new_tokens=20)]
    engine = make_engine(num_pages=13, max_seq_len=40, check=True)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    pool = engine.kv_manager.pool
    tables = {s.request.request_id: pool.pages(s.slot) for s in engine.running}
    assert tables == {"a": [1], "b": [2, 3, 4]}
    readmitted = []
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        b = [s for s in engine.running if s.request.request_id == "b"]
        if b and b[0].group.num_preemptions and not readmitted:
            readmitted = pool.pages(b[0].slot)
    assert outs["b"].num_preemptions >= 1
    assert readmitted[:2] == [2, 3]
    assert engine.stats.recompute_hit_tokens >= 8
    solo, _ = serve(reqs, num_pages=200)
    assert {k: o.output_ids for k, o in outs.items()} == {k: o.output_ids for k, o in solo.items()}


def test_two_requests_admitted_in_one_step_share_their_common_prefix():
    """A and B (13-token prompts) share an 8-token prefix and are admitted
    in the same step: A's prompt fills pages 1 2 3 (taken at admission and
    cached at once), B takes 1 and 2 as a hit and page 4 for its third
    page, and both last tokens take new pages (5, 6) in the call. B
    computes only its own 5 tokens, in the same call as A. Outputs equal
    caching off."""
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, VOCAB, size=8).tolist()
    reqs = [Request(request_id=i, prompt_ids=prefix + rng.integers(0, VOCAB, size=5).tolist(), max_new_tokens=10)
            for i in range(2)]
    engine = make_engine(check=True)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    pool = engine.kv_manager.pool
    tables = [pool.pages(s.slot) for s in engine.running]
    assert tables == [[1, 2, 3, 5], [1, 2, 4, 6]]
    assert pool.ref_counts[1] == pool.ref_counts[2] == 2
    assert engine.stats.prefix_hit_tokens == 8
    outs = {o.request_id: o for o in engine.run()}
    assert engine.stats.calls[0].tokens == 13 + 5  # the first call computes the prefix once
    assert outs[1].num_cached_tokens == 8 and outs[0].num_cached_tokens == 0
    off, off_engine = serve(reqs, num_pages=200, prefix_caching=False)
    assert engine.stats.prefill_tokens == off_engine.stats.prefill_tokens - 8
    for r in reqs:
        assert outs[r.request_id].output_ids == off[r.request_id].output_ids
    check_accounting(engine)


def test_a_long_lived_engine_keeps_only_live_request_ids():
    """Ids must be unique among unfinished requests only: a finished id can
    be used again, and nothing per request outlives it."""
    engine = make_engine(check=False)
    rng = np.random.default_rng(5)
    for round_ in range(12):
        reqs = [Request(request_id=i, prompt_ids=rng.integers(0, VOCAB, size=3).tolist(), max_new_tokens=2)
                for i in range(4)]
        outs = engine.run(reqs)
        assert sorted(o.request_id for o in outs) == [0, 1, 2, 3]
        assert engine._live == {}
    engine.add_request(Request(request_id=0, prompt_ids=[1, 2], max_new_tokens=2))
    try:
        engine.add_request(Request(request_id=0, prompt_ids=[1, 2], max_new_tokens=2))
    except ValueError as e:
        assert "already added and has not finished" in str(e)
    else:
        raise AssertionError("a duplicate live id was accepted")
    engine.run()
    sizes = {name: len(v) for obj in (engine, engine.scheduler, engine.kv_manager)
             for name, v in vars(obj).items() if isinstance(v, (dict, set, list))}
    assert all(n <= engine.config.max_seqs for n in sizes.values()), sizes
