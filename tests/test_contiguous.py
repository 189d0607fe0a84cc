"""Contiguous allocators (:mod:`paged_jax.paging.contiguous`) and the paper's
Orca on them: each reservation one run, placed by the buddy allocator (Kwon
et al., SOSP 2023, section 6.1) or first fit, with exact runs, external
fragmentation counted, and every page back at the end."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.engine.config import EngineConfig
from paged_jax.engine.core import Request
from paged_jax.paging.contiguous import BuddyAllocator, FirstFitAllocator, make_allocator
from tests.engine_helpers import VOCAB, make_engine

# ------------------------------------------------------------ allocators


def test_buddy_splits_merges_and_refuses_with_pages_free():
    """16 pages. 3 rounds up to 4; a run is taken from the smallest free
    block, split in halves (the lower half kept); a freed run merges with
    its buddy when both are free."""
    b = BuddyAllocator(16)
    assert b.free_blocks() == [(0, 16)]
    assert b.allocate(3) == 0  # 4 pages: 16 -> 8 @8, 4 @4, keep [0, 4)
    assert b.free_blocks() == [(4, 4), (8, 8)]
    assert b.allocate(1) == 4  # 4 @4 -> 2 @6, 1 @5, keep 4
    assert b.allocate(2) == 6
    assert b.allocate(4) == 8  # 8 @8 -> 4 @12, keep [8, 12)
    assert b.runs == {0: 4, 4: 1, 6: 2, 8: 4}
    assert b.free_blocks() == [(5, 1), (12, 4)] and b.num_free == 5 and b.largest_free() == 4
    b.free(0)
    assert b.free_blocks() == [(0, 4), (5, 1), (12, 4)]
    assert b.num_free == 9 and b.allocate(8) is None  # 9 pages free, no run of 8: external fragmentation
    assert b.runs == {4: 1, 6: 2, 8: 4}  # the refusal changed nothing
    b.free(4)
    assert b.free_blocks() == [(0, 4), (4, 2), (12, 4)]  # [4, 5) + [5, 6) merged; [6, 8) held
    b.free(6)
    assert b.free_blocks() == [(0, 8), (12, 4)]
    b.free(8)
    assert b.free_blocks() == [(0, 16)] and b.runs == {}


def test_buddy_over_a_capacity_that_is_not_a_power_of_two():
    b = BuddyAllocator(13)
    assert b.free_blocks() == [(0, 8), (8, 4), (12, 1)]
    assert b.allocate(5) == 0 and b.allocate(4) == 8 and b.allocate(1) == 12
    assert b.allocate(1) is None and b.num_free == 0
    assert BuddyAllocator(13).allocate(9) is None  # 16 pages: more than any block
    for start in (12, 0, 8):
        b.free(start)
    assert b.free_blocks() == [(0, 8), (8, 4), (12, 1)]  # never merged past the capacity


def test_first_fit_places_exact_runs_lowest_first_and_coalesces():
    f = FirstFitAllocator(10)
    assert [f.allocate(n) for n in (3, 2, 4)] == [0, 3, 5]
    assert f.free_blocks() == [(9, 1)]
    f.free(0)
    f.free(5)
    assert f.free_blocks() == [(0, 3), (5, 5)]
    assert f.num_free == 8 and f.allocate(6) is None  # 8 free in 3 + 5
    assert f.allocate(2) == 0  # the lowest interval that holds it
    assert f.free_blocks() == [(2, 1), (5, 5)]
    f.free(3)  # [3, 5) joins [2, 3) and [5, 10)
    assert f.free_blocks() == [(2, 8)]


def test_allocator_arguments_are_checked():
    with pytest.raises(ValueError, match="allocator must be one of"):
        make_allocator("slab", 8)
    with pytest.raises(ValueError, match="capacity"):
        BuddyAllocator(0)
    b = BuddyAllocator(8)
    with pytest.raises(ValueError, match="pages"):
        b.allocate(0)
    with pytest.raises(ValueError, match="start=3 is not the start of a placed run"):
        b.free(3)


@pytest.mark.parametrize("name", ["buddy", "first_fit"])
@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 70), ops=st.lists(st.tuples(st.booleans(), st.integers(1, 20)), max_size=60))
def test_runs_never_overlap_and_every_page_comes_back(name, capacity, ops):
    a = make_allocator(name, capacity)
    initial = a.free_blocks()
    for alloc, n in ops:
        if alloc or not a.runs:
            before = dict(a.runs)
            start = a.allocate(n)
            if start is None:
                assert a.runs == before
                assert a.run_pages(n) > a.largest_free()  # refused only when no free run holds it
        else:
            a.free(sorted(a.runs)[n % len(a.runs)])
        taken = np.zeros(capacity, int)
        for s, size in a.runs.items():
            assert 0 <= s and s + size <= capacity
            taken[s: s + size] += 1
        assert taken.max(initial=0) <= 1
        assert a.num_free == capacity - taken.sum() == sum(n for _, n in a.free_blocks())
    for s in list(a.runs):
        a.free(s)
    assert a.free_blocks() == initial


# ---------------------------------------------------------------- engine


def test_engine_config_takes_an_allocator_under_a_reservation_only():
    assert EngineConfig(reservation="oracle").allocator == "buddy"  # the paper's Orca by default
    assert EngineConfig().allocator is None
    with pytest.raises(ValueError, match="allocator='buddy' with reservation='paged'"):
        EngineConfig(allocator="buddy")
    with pytest.raises(ValueError, match=r"allocator must be one of \('buddy', 'first_fit', 'pages'\), got "
                                         "allocator='slab'"):
        EngineConfig(reservation="max", allocator="slab")


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


# Pages of 4 tokens, 16 usable pages. Oracle runs: R0 and R2 (5 + 3 tokens)
# and R1 and R3 (1 + 7) two pages each, B (5 + 27) eight, E (5 + 11) four.
# Buddy and first fit both place R0..R3 at 0, 2, 4, 6 and B at 8; when R0
# and R2 finish, 4 pages are free at 0 and 4, and E (4 pages) waits for R1
# and R3, where a count of pages admits it at once.
_FRAG = [("R0", 5, 3), ("R1", 1, 7), ("R2", 5, 3), ("R3", 1, 7), ("B", 5, 27), ("E", 5, 11)]


def _fragmenting_run(allocator):
    engine = make_engine(17, max_seqs=8, max_seq_len=64, overlap=False, prefix_caching=False, reservation="oracle",
                         allocator=allocator)
    for i, (rid, prompt, new) in enumerate(_FRAG):
        engine.add_request(Request(request_id=rid, prompt_ids=_ids(prompt, i), max_new_tokens=new, ignore_eos=True))
    admitted, outs = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].output_ids
        for seq in engine.running:
            admitted.setdefault(seq.request.request_id, engine.stats.iterations)
    return engine, admitted, outs


@pytest.mark.parametrize("allocator", ["buddy", "first_fit"])
def test_orca_waits_with_pages_free_when_no_run_holds_them(allocator):
    engine, admitted, outs = _fragmenting_run(allocator)
    runs = engine.kv_manager.runs
    _, pages_admitted, pages_outs = _fragmenting_run("pages")
    assert admitted["B"] == pages_admitted["B"] == 1
    assert pages_admitted["E"] == 4  # R0 and R2 finish in iteration 3 (prefill, then 3 tokens)
    assert admitted["E"] == 8  # R1 and R3 finish in iteration 7: their runs merge back
    assert engine.stats.fragmentation_blocked_requests == 1
    assert engine.stats.fragmentation_blocked_steps == 4  # iterations 4-7 each found E blocked
    assert 0 < engine.stats.external_fragmentation < 1
    assert outs == pages_outs  # the same tokens, later
    assert runs.allocator.runs == {} and runs.allocator.num_free == 16  # every run back
    assert engine.kv_manager.accounting()["used"] == 0


def test_a_group_whose_runs_cannot_fit_an_empty_pool_is_refused():
    """Two beams reserving 80 tokens (20 pages) each: 40 pages fit in 59 as
    a count, but the buddy rounds each to 32 and 59 pages hold one run of
    32 (32 + 16 + 8 + 2 + 1)."""
    from paged_jax.engine.sampling import SamplingParams

    req = Request(request_id=0, prompt_ids=_ids(30, 0), max_new_tokens=10, sampling=SamplingParams(beam_width=2))
    make_engine(60, reservation="max", allocator="pages").add_request(req)
    make_engine(60, reservation="max", allocator="first_fit").add_request(req)
    with pytest.raises(ValueError, match=r"request 0: 2 runs of 32 contiguous pages \(reservation='max', "
                                         r"allocator='buddy'\) do not fit in the pool's 59 pages even when it is "
                                         "empty"):
        make_engine(60, reservation="max").add_request(req)


@pytest.mark.parametrize("sampling", [dict(n=3, seed=1, temperature=1.0), dict(beam_width=3)],
                         ids=["parallel", "beams"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_runs_follow_samples_beams_and_preemption_and_all_come_back(sampling, mode):
    """Groups of 3 samples or beams under buddy Orca with a pool that makes
    them wait and preempt: outputs equal a count of pages', and at the end
    every run is back (a pruned beam's row kept its run for the next)."""
    from paged_jax.engine.sampling import SamplingParams

    reqs = [Request(request_id=i, prompt_ids=_ids(3 + 2 * i, i), max_new_tokens=9 + i,
                    sampling=SamplingParams(**sampling)) for i in range(6)]
    results = {}
    for allocator in ("buddy", "pages"):
        engine = make_engine(49, max_seqs=9, reservation="oracle", allocator=allocator, preemption_mode=mode)
        outs = engine.run(reqs)
        results[allocator] = {o.request_id: [c.output_ids for c in o.outputs] for o in outs}
        if allocator == "buddy":
            assert engine.kv_manager.runs.allocator.runs == {} and engine.kv_manager.runs._held == {}
    assert results["buddy"] == results["pages"]
