"""Parallel sampling: one request, n continuations forked from its prompt's
pages after prefill, copy-on-write when they diverge, gang preemption (by
recompute or swap; swap's own tests are in tests/test_swap.py).
"""

import functools

import numpy as np
import pytest

from paged_jax.engine.core import Request
from paged_jax.engine.sampling import SamplingParams
from tests.engine_helpers import VOCAB, check_accounting, greedy_reference, make_engine, toy_params, toy_requests


def group_requests(num, n, seed=0, temperature=0.8):
    """``num`` requests of ``n`` samples each, at most 39 tokens a sequence."""
    return toy_requests(num, seed=seed, prompt_len=(2, 20), max_new=(5, 20),
                        sampling=lambda i: SamplingParams(temperature=temperature, seed=100 + i, n=n))


def gang_invariant(engine):
    """Every group is wholly running or wholly waiting."""
    running = {id(s) for s in engine.running}
    for group in engine._live.values():
        where = {id(s) in running for s in group.live}
        assert len(where) <= 1, group.request.request_id


def run_checked(engine, requests):
    for r in requests:
        engine.add_request(r)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        gang_invariant(engine)
        check_accounting(engine)
    return outs


def test_greedy_samples_equal_the_f64_oracle_and_each_other():
    """n=3 greedy continuations write the same tokens into their own copies
    of the shared last prompt page: all three equal a no-cache f64
    recomputation (a wrong copy-on-write would corrupt them)."""
    params = toy_params()
    reqs = group_requests(3, n=3, seed=1, temperature=0.0)
    outs = run_checked(make_engine(200), reqs)
    for r in reqs:
        expected = greedy_reference(params, r.prompt_ids, r.max_new_tokens)
        o = outs[r.request_id]
        assert [c.index for c in o.outputs] == [0, 1, 2]
        for c in o.outputs:
            assert c.output_ids == expected, (r.request_id, c.index)


def test_samples_share_the_prompt_pages_then_copy_on_write():
    prompt = np.random.default_rng(2).integers(0, VOCAB, size=21).tolist()  # 5 full pages + 1 token
    engine = make_engine(200, overlap=False)
    engine.add_request(Request(request_id="r", prompt_ids=prompt, max_new_tokens=10,
                               sampling=SamplingParams(temperature=1.0, seed=3, n=4)))
    engine.step()  # prefill and fork: 4 sequences on the same 6 pages
    seqs = engine._live["r"].seqs
    assert len(seqs) == 4 and all(s.slot >= 0 for s in seqs)
    tables = [engine.kv_manager.pool.pages(s.slot) for s in seqs]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 6
    assert all(engine.kv_manager.pool.ref_counts[p] == 4 for p in tables[0])
    assert engine.accounting()["used"] == 6
    engine.step()  # each writes its own token into the shared 6th page: three copies, the last keeps it
    tables = [engine.kv_manager.pool.pages(s.slot) for s in seqs]
    assert all(t[:5] == tables[0][:5] for t in tables)
    assert len({t[5] for t in tables}) == 4
    assert engine.accounting()["used"] == 9
    (out,) = engine.run()
    assert len({tuple(c.output_ids) for c in out.outputs}) > 1, "independent streams draw different samples"
    assert engine.accounting()["used"] == 0


@functools.cache
def _unpressured_samples():
    """The large pool's samples, shared by every preemption variant."""
    return run_checked(make_engine(400, max_seqs=16), group_requests(8, n=4, seed=4))


@pytest.mark.parametrize("mode,prefix_caching,swap_pages", [
    # Recompute (45 s) is a slow extra; ("swap", True, 6) recomputes the groups the swap space cannot take.
    pytest.param("recompute", True, None, marks=pytest.mark.slow),
    pytest.param("recompute", False, None, marks=pytest.mark.slow), ("swap", True, None),
    pytest.param("swap", False, None, marks=pytest.mark.slow),  # without prefix caching: slow extras
    ("swap", True, 6),  # a swap space too small for some groups: they are recomputed
])
def test_gang_preemption_keeps_every_sample(mode, prefix_caching, swap_pages):
    """n=4 requests under a pool that forces preemption (whole groups at a
    time, by recompute or swap) give the samples of a pool large enough for
    all of them."""
    reqs = group_requests(8, n=4, seed=4)
    big = _unpressured_samples()
    small_engine = make_engine(45, max_seqs=16, prefix_caching=prefix_caching,  # 40 tokens: 10 pages a sequence
                               preemption_mode=mode, swap_space_pages=swap_pages)
    small = run_checked(small_engine, reqs)
    st = small_engine.stats
    assert st.preemptions > 0
    if mode == "swap":
        assert st.swap_outs > 0 and st.swapped_in_pages > 0
        assert (st.swap_outs < st.preemptions) == (swap_pages is not None)
    else:
        assert st.swap_outs == 0
    for r in reqs:
        assert [c.output_ids for c in small[r.request_id].outputs] == [c.output_ids for c in big[r.request_id].outputs]
    assert small_engine.accounting()["used"] == 0 and small_engine.kv_manager.swap.used == 0


def test_abort_a_group_frees_all_its_sequences():
    reqs = group_requests(4, n=3, seed=5)
    engine = make_engine(200)
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    out = engine.abort(1)
    assert out.finish_reason == "abort" and len(out.outputs) == 3
    rest = {o.request_id: o for o in engine.run()}
    assert set(rest) == {0, 2, 3} and engine.accounting()["used"] == 0
    alone = run_checked(make_engine(200), [r for r in reqs if r.request_id != 1])
    for rid, o in rest.items():
        assert [c.output_ids for c in o.outputs] == [c.output_ids for c in alone[rid].outputs]


def test_group_requests_that_could_never_resume_are_refused():
    engine = make_engine(41, max_seqs=4)
    with pytest.raises(ValueError, match="n=5 exceeds max_seqs=4"):
        engine.add_request(Request(request_id=0, prompt_ids=[1], max_new_tokens=5, sampling=SamplingParams(n=5)))
    with pytest.raises(ValueError, match="could never be resumed together"):
        engine.add_request(Request(request_id=1, prompt_ids=[1] * 40, max_new_tokens=40,
                                   sampling=SamplingParams(n=3)))
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)
    assert not engine.has_unfinished()
