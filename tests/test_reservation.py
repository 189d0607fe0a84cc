"""Reservation policies: the PagedAttention paper's Orca baselines (Kwon et
al., SOSP 2023, section 6.1) as ``EngineConfig.reservation``, with exact
page counts.

Pages are 4 tokens (``PAGE``) and sequences at most 80 tokens (20 pages)
unless a test says otherwise. A prompt of 5 tokens with 25 new ones
reserves, from admission on: max 80 tokens (20 pages), pow2 5 + 32 = 37
(10 pages), oracle 5 + 25 = 30 (8 pages); paged holds 2 pages for the
prompt and takes one more each time the last fills.

These tests count pages, so their engines take a reservation as a count of
pages (``allocator="pages"``); where the runs of a contiguous allocator
change what is admitted, ``tests/test_contiguous.py`` tests it.
"""

import functools
import re

import numpy as np
import pytest

from paged_jax.engine.config import RESERVATIONS, EngineConfig, reserved_tokens
from paged_jax.engine.core import Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.block_pool import BlockPool
from paged_jax.paging.page_state import pages_for_tokens
from tests import engine_helpers
from tests.engine_helpers import PAGE, VOCAB, check_accounting, toy_requests

assert PAGE == 4


def _pages_allocator(kw):
    return {**kw, "allocator": None if kw.get("reservation", "paged") == "paged" else "pages"}


def make_engine(*args, **kw):
    """``engine_helpers.make_engine``, reservations counted in pages."""
    return engine_helpers.make_engine(*args, **_pages_allocator(kw))


def serve(requests, *args, **kw):
    """``engine_helpers.serve``, reservations counted in pages."""
    return engine_helpers.serve(requests, *args, **_pages_allocator(kw))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


# -------------------------------------------------------------- the rule


@pytest.mark.parametrize("prompt_len, max_new, expected", [
    (5, 25, {"paged": 0, "max": 80, "pow2": 37, "oracle": 30}),  # the paper's example: 25 -> 32
    (5, 32, {"paged": 0, "max": 80, "pow2": 37, "oracle": 37}),  # a power of two is its own
    (5, 33, {"paged": 0, "max": 80, "pow2": 69, "oracle": 38}),  # 33 -> 64
    (40, 33, {"paged": 0, "max": 80, "pow2": 80, "oracle": 73}),  # 40 + 64 = 104, capped at max_seq_len
    (1, 1, {"paged": 0, "max": 80, "pow2": 2, "oracle": 2}),
])
def test_reserved_tokens_follows_the_paper(prompt_len, max_new, expected):
    assert {p: reserved_tokens(p, prompt_len, max_new, 80) for p in RESERVATIONS} == expected


def test_an_unknown_reservation_is_refused_naming_the_field():
    needle = "reservation must be one of ('paged', 'max', 'pow2', 'oracle'), got reservation='bogus'"
    with pytest.raises(ValueError, match=re.escape(needle)):
        EngineConfig(reservation="bogus")
    with pytest.raises(ValueError, match="reservation"):
        EngineConfig(reservation=True)
    with pytest.raises(ValueError, match="policy must be one of"):
        reserved_tokens("bogus", 5, 25, 80)


# ------------------------------------------------------------- host twin


def test_block_pool_extend_takes_each_slots_own_reservation():
    """Slots 0 and 1 grow by 2 tokens each: slot 0 reserves 3 pages and
    takes 1 2 3, slot 1 none and takes 4 for its tokens; slot 2 does not
    grow, so its reservation takes nothing."""
    pool = BlockPool(num_pages=8, max_seqs=3, max_pages_per_seq=4, page_size=PAGE)
    assert pool.extend(np.array([2, 2, 0]), np.array([3, 0, 4])) == []
    assert [pool.pages(s) for s in range(3)] == [[1, 2, 3], [4], []]
    assert pool.extend(np.array([2, 2, 0]), np.array([3, 0, 4])) == []  # 4 tokens: slot 0 holds enough already
    assert [pool.pages(s) for s in range(3)] == [[1, 2, 3], [4], []]
    assert pool.extend(np.array([0, 0, 1]), np.array([0, 0, 5])) is None  # past max_pages_per_seq: refused
    assert pool.num_free == 3


# ------------------------------------------------------------ the engine


def _held_per_step(engine):
    """Steps ``engine`` (synchronous) to the end; returns, for each step,
    ``(tokens computed, pages held)`` of every running sequence, and the
    outputs. A new beam is left out until the call that forks its parent's
    pages to it."""
    trace, outs = [], {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        pool = engine.kv_manager.pool
        trace.append([(s.num_computed, int(pool.num_seq_pages[s.slot])) for s in engine.running if s.fork_pre is None])
        check_accounting(engine)
    return trace, outs


@pytest.mark.parametrize("prompt_len, max_new, expected", [
    (5, 25, {"max": 20, "pow2": 10, "oracle": 8}),
    (40, 33, {"max": 20, "pow2": 20, "oracle": 19}),  # pow2 capped at max_seq_len; oracle 73 tokens
])
@pytest.mark.parametrize("policy", RESERVATIONS)
def test_each_sequence_holds_its_reservation_from_admission_on(policy, prompt_len, max_new, expected):
    """One request, run step by step: under a reservation its pages are
    taken by its first call and never change; paged holds exactly the
    pages its computed tokens fill, one more at a time."""
    engine = make_engine(200, overlap=False, prefix_caching=False, reservation=policy)
    engine.add_request(Request(request_id=0, prompt_ids=_prompt(prompt_len), max_new_tokens=max_new))
    trace, outs = _held_per_step(engine)
    held = [pages for step in trace for _, pages in step]
    assert len(held) == max_new - 1  # the step that samples the last token finishes it
    if policy == "paged":
        assert held == [pages_for_tokens(c, PAGE) for step in trace for c, _ in step]
        assert held[0] == pages_for_tokens(prompt_len, PAGE)
        # 28 tokens computed (7 pages) before the call that samples the 25th
        assert set(np.diff(held)) <= {0, 1} and held[-1] == pages_for_tokens(prompt_len + max_new - 2, PAGE)
    else:
        assert held == [expected[policy]] * len(held)
    assert len(outs[0].output_ids) == max_new
    assert engine.accounting()["used"] == 0


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=3, n=3), SamplingParams(beam_width=3)],
                         ids=["parallel", "beams"])
def test_every_sequence_of_a_group_reserves_the_same(sampling):
    """Parallel samples and beams fork the pages holding their parent's
    tokens and take their own reservation when they first grow: from the
    second step on, each of the group's sequences holds 8 pages (oracle,
    5 + 25 tokens)."""
    engine = make_engine(200, max_seqs=8, overlap=False, reservation="oracle")
    engine.add_request(Request(request_id=0, prompt_ids=_prompt(5), max_new_tokens=25, sampling=sampling))
    trace, outs = _held_per_step(engine)
    assert trace[0][0][1] == 8
    assert max(len(step) for step in trace) == 3
    for step in trace[1:]:
        assert [pages for _, pages in step] == [8] * len(step)
    paged, _ = serve([Request(request_id=0, prompt_ids=_prompt(5), max_new_tokens=25, sampling=sampling)],
                     max_seqs=8)
    assert [c.output_ids for c in outs[0].outputs] == [c.output_ids for c in paged[0].outputs]


@functools.cache
def _paged_outputs():
    outs, _ = serve(toy_requests(10), num_pages=81, max_seqs=10)
    return {i: o.output_ids for i, o in outs.items()}


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_greedy_outputs_equal_paged_under_every_policy(policy):
    """80 usable pages: paging runs all 10 requests at once, max 4; every
    policy gives the same tokens."""
    outs, engine = serve(toy_requests(10), num_pages=81, max_seqs=10, reservation=policy)
    assert {i: o.output_ids for i, o in outs.items()} == _paged_outputs()
    assert engine.accounting()["used"] == 0


@pytest.mark.parametrize("policy, running", [("paged", 3), ("oracle", 2), ("pow2", 2), ("max", 1)])
def test_admission_counts_each_sequences_reservation(policy, running):
    """20 usable pages, three requests of 5 + 25 tokens: each holds 20
    pages under max (one runs), 10 under pow2 and 8 under oracle (two run,
    a third would need 30 or 24), 2 for its prompt when paging (all
    three)."""
    reqs = [Request(request_id=i, prompt_ids=_prompt(5, seed=i), max_new_tokens=25) for i in range(3)]
    engine = make_engine(21, max_seqs=4, prefix_caching=False, reservation=policy)
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert len(engine.running) == running
    if policy != "paged":
        assert engine.stats.peak_concurrency == running
    outs = {o.request_id: o.output_ids for o in engine.run()}
    alone, _ = serve(reqs, num_pages=200)
    assert outs == {i: o.output_ids for i, o in alone.items()}


def test_a_group_whose_reservations_overflow_the_pool_is_refused():
    """30 usable pages: two sequences of 5 + 25 tokens need 16 pages under
    oracle and 40 under max, which could never run together."""
    req = Request(request_id=0, prompt_ids=_prompt(5), max_new_tokens=25, sampling=SamplingParams(n=2))
    make_engine(31, reservation="oracle").add_request(req)
    with pytest.raises(ValueError, match=r"2 sequences holding 80 tokens each \(reservation='max'\) need up to 40 "
                                         r"pages, more than the pool's 30"):
        make_engine(31, reservation="max").add_request(req)


def _group_requests():
    return toy_requests(8, seed=4, prompt_len=(2, 20), max_new=(5, 17),  # pow2: 9 pages a sequence at most
                        sampling=lambda i: SamplingParams(temperature=0.8, seed=100 + i, n=4))


@functools.cache
def _paged_groups():
    """Paging's samples in the same pool (preempted too: a sample's tokens
    do not depend on it, tests/test_parallel_sampling.py)."""
    outs, _ = serve(_group_requests(), num_pages=45, max_seqs=16)
    return {i: [c.output_ids for c in o.outputs] for i, o in outs.items()}


def _preempt_newest(engine):
    """Steps ``engine`` to the end, preempting its newest running group
    once, after the step in which 3 groups first run; returns the outputs."""
    outs, done = {}, False
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        groups = list(dict.fromkeys(s.group for s in engine.running))
        if not done and len(groups) >= 3:
            engine.scheduler.preempt(groups[-1])
            done = True
        check_accounting(engine)
    assert done
    return outs


# Slow: the default twins are the swap-in and preemption tests below (a group swapped out and back in, a group
# preempted before its forks).
@pytest.mark.parametrize("policy, mode", [
    pytest.param("oracle", "swap", marks=pytest.mark.slow), pytest.param("pow2", "recompute", marks=pytest.mark.slow),
    pytest.param("pow2", "swap", marks=pytest.mark.slow), pytest.param("oracle", "recompute", marks=pytest.mark.slow),
])
def test_preemption_keeps_outputs_under_a_reservation(policy, mode):
    """Groups of 4 samples, every sample's reservation held from its
    group's admission on (so the pool never runs short: Orca never
    preempts); the newest group preempted by hand (recompute or swap;
    swapped in, each sequence takes its reservation again). The samples
    equal paging's, and every page comes back."""
    engine = make_engine(200, max_seqs=16, reservation=policy, preemption_mode=mode)
    for r in _group_requests():
        engine.add_request(r)
    outs = _preempt_newest(engine)
    st = engine.stats
    assert st.preemptions == 1
    assert (st.swap_outs > 0) == (mode == "swap")
    assert {i: [c.output_ids for c in o.outputs] for i, o in outs.items()} == _paged_groups()
    assert engine.accounting()["used"] == 0 and engine.kv_manager.swap.used == 0
    assert engine.num_free_pages == 199


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=3, n=3), SamplingParams(beam_width=3)],
                         ids=["parallel", "beams"])
@pytest.mark.parametrize("policy", ["oracle", "paged"])
def test_orca_holds_a_copy_of_the_prompt_per_sequence(sampling, policy):
    """The paper's Orca shares nothing (section 6.3): a group of 3
    sequences of 9 + 25 tokens holds 3 x 9 = 27 pages (oracle) from its
    admission on, its prompt's 2 full pages counted once per sequence
    although the forks share them on device; paging counts a shared page
    once. A second such group waits under oracle (50 usable pages < 2 x
    27) and runs beside the first when paging."""
    reqs = [Request(request_id=i, prompt_ids=_prompt(9, seed=i), max_new_tokens=25, sampling=sampling)
            for i in range(2)]
    engine = make_engine(51, max_seqs=8, overlap=False, prefix_caching=False, reservation=policy)
    for r in reqs:
        engine.add_request(r)
    seen, outs = [], {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        check_accounting(engine)
        kvm = engine.kv_manager
        distinct = int(np.count_nonzero(kvm.pool.ref_counts))  # pages on device
        groups = {s.group.request.request_id for s in engine.running}
        seen.append(len(groups))
        if policy == "oracle" and engine.running:
            assert len(groups) == 1
            assert engine.num_free_pages == 50 - 27  # each sequence's 9 pages, prompt included
            assert kvm.pool.num_free == 50 - distinct  # on device the prompt's full pages are shared
        elif engine.running:
            assert engine.num_free_pages == kvm.pool.num_free
    assert max(seen) == (1 if policy == "oracle" else 2)
    paged, _ = serve(reqs, max_seqs=8)
    assert {i: [c.output_ids for c in o.outputs] for i, o in outs.items()} == {
        i: [c.output_ids for c in o.outputs] for i, o in paged.items()}
    assert engine.num_free_pages == 50


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=3, n=3), SamplingParams(beam_width=3)],
                         ids=["parallel", "beams"])
def test_orca_never_preempts_in_a_pool_its_reservations_fill(sampling):
    """54 usable pages hold exactly two groups of 3 x 9 pages (oracle, 9 +
    25 tokens): both run at once and nothing is preempted. A sample's first
    token lands in the prompt's shared last page, whose copy-on-write copy
    the reservation already counts (counting it again preempted a group)."""
    reqs = [Request(request_id=i, prompt_ids=_prompt(9, seed=i), max_new_tokens=25, sampling=sampling)
            for i in range(2)]
    outs, engine = serve(reqs, num_pages=55, max_seqs=8, prefix_caching=False, reservation="oracle")
    assert engine.stats.preemptions == 0 and engine.stats.peak_concurrency == 6
    paged, _ = serve(reqs, max_seqs=8)
    assert {i: [c.output_ids for c in o.outputs] for i, o in outs.items()} == {
        i: [c.output_ids for c in o.outputs] for i, o in paged.items()}


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0, seed=3, n=2), SamplingParams(beam_width=2)],
                         ids=["parallel", "beams"])
@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_rows_for_sequences_to_come_give_their_reservations_back(sampling, end):
    """A group aborted or preempted while prefilling (its samples or beams
    not forked yet) gives back the reservations its rows to come held, at
    once: an idle engine has no call to recount them (it hung with 39 of 59
    pages free). A request needing the whole pool then runs."""
    engine = make_engine(60, max_seqs=8, budget=8, reservation="max", prefix_caching=False)
    engine.add_request(Request(request_id=0, prompt_ids=_prompt(30), max_new_tokens=10, sampling=sampling))
    engine.step()
    assert engine.num_free_pages == 59 - 2 * 20  # both sequences' 80 tokens reserved from admission on
    if end == "abort":
        engine.abort(0)
    else:
        engine.scheduler.preempt(engine.running[0].group)
        engine.abort(0)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_pages == 59
    big = Request(request_id=1, prompt_ids=_prompt(30, seed=1), max_new_tokens=44, sampling=sampling)
    outs = {o.request_id: o for o in engine.run([big])}
    paged, _ = serve([big], max_seqs=8)
    assert [c.output_ids for c in outs[1].outputs] == [c.output_ids for c in paged[1].outputs]
    assert engine.num_free_pages == 59


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("policy", ["oracle", "max"])
def test_a_group_swapped_out_comes_back_into_a_pool_its_reservations_fill(policy, n):
    """A pool of exactly n x 9 usable pages (oracle: 9 + 25 tokens; max:
    sequences of at most 36 tokens) holds one group of n sequences;
    preempted by swap by hand, the group is swapped back in and gives
    paging's samples. Its cost counted a copy-on-write page per sequence
    that a reservation never takes, so it waited for ever."""
    sampling = SamplingParams(temperature=1.0, seed=3, n=n)
    req = Request(request_id=0, prompt_ids=_prompt(9), max_new_tokens=25, sampling=sampling)
    engine = make_engine(9 * n + 1, max_seqs=8, max_seq_len=36, prefix_caching=False, reservation=policy,
                         preemption_mode="swap")
    engine.add_request(req)
    for _ in range(3):
        engine.step()
    assert len(engine.running) == n
    engine.scheduler.preempt(engine.running[0].group)
    outs = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id] = o
    assert not engine.has_unfinished() and engine.stats.swap_outs == 1
    paged, _ = serve([req], max_seqs=8, max_seq_len=36)
    assert [c.output_ids for c in outs[0].outputs] == [c.output_ids for c in paged[0].outputs]
    assert engine.num_free_pages == 9 * n
