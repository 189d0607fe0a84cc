"""The memory-waste simulation: hand-worked cases and bounds (its first-fit space is
:class:`paged_jax.paging.contiguous.FirstFitAllocator`, tested in ``tests/test_contiguous.py``)."""

import numpy as np
import pytest

from experiments.lib.waste_sim import SCHEMES, SimConfig, simulate

ALL_AT_ONCE = 1e9  # arrivals per iteration: every request arrives at iteration 0


def test_one_request_contiguous_max_by_hand():
    # prompt 5, output 3: lengths 6, 7, 8 over 3 iterations, 16 slots reserved.
    #   token states 6 + 7 + 8 = 21; reserved (8-6) + (8-7) + 0 = 3;
    #   internal (16 - 8) * 3 = 24; 48 slot-iterations in all.
    cfg = SimConfig(scheme="contiguous-max", pool_tokens=64, max_seq_len=16, arrival_rate=ALL_AT_ONCE)
    r = simulate([5], [3], cfg)
    assert (r.iterations, r.token_slot_iters, r.reserved_slot_iters, r.internal_slot_iters) == (3, 21, 3, 24)
    assert r.external_slot_iters == 0 and r.unused_slot_iters == 3 * 64 - 48
    assert r.token_share == 21 / 48


def test_one_request_paged_by_hand():
    # Page 4: 5 prompt tokens take 2 pages (8 slots); 6, 7, 8 tokens fit in them.
    #   token 21; reserved 2 + 1 + 0 = 3; internal 0.
    cfg = SimConfig(scheme="paged", pool_tokens=64, page_size=4, max_seq_len=16,
                    arrival_rate=ALL_AT_ONCE, watermark=0.0)
    r = simulate([5], [3], cfg)
    assert (r.token_slot_iters, r.reserved_slot_iters, r.internal_slot_iters, r.external_slot_iters) == (21, 3, 0, 0)
    assert r.max_unfilled_slots == 2


def test_external_fragmentation_by_hand():
    # Pool 12, oracle reservations: R0 (4 slots) at [0, 4), R1 (6) at [4, 10);
    # R2 (6) waits. R0 ends after iteration 1: holes [0, 4) and [10, 12) hold 6
    # in total but not in one run, so at iterations 2 and 3 (until R1 ends)
    # those 6 free slots are external fragmentation: 12 slot-iterations.
    cfg = SimConfig(scheme="contiguous-oracle", pool_tokens=12, max_seq_len=12, arrival_rate=ALL_AT_ONCE)
    r = simulate([2, 2, 3], [2, 4, 3], cfg)
    assert r.external_slot_iters == 12
    assert r.internal_slot_iters == 0
    assert r.iterations == 7  # R2 runs at iterations 4, 5, 6


def workload(n=120, seed=0, max_len=256):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, max_len // 2, n)
    output = rng.integers(4, max_len // 2, n)
    return prompt, output


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_paged_waste_below_one_page_per_request_in_simulation(page_size):
    prompt, output = workload()
    cfg = SimConfig(scheme="paged", pool_tokens=2048, page_size=page_size, max_seq_len=256,
                    arrival_rate=0.5)
    r = simulate(prompt, output, cfg)
    # Read from the allocator's state at every iteration: no running request
    # ever holds a whole unfilled page.
    assert 0 <= r.max_unfilled_slots < page_size
    assert r.external_slot_iters == 0
    # At most one partly filled page per running request, averaged over time.
    waste = r.reserved_slot_iters + r.internal_slot_iters
    assert waste <= r.mean_running * r.iterations * (page_size - 1)


def test_all_schemes_account_for_every_slot():
    prompt, output = workload()
    results = {}
    for scheme in SCHEMES:
        cfg = SimConfig(scheme=scheme, pool_tokens=2048, page_size=16, max_seq_len=256, arrival_rate=0.5)
        r = simulate(prompt, output, cfg)
        shares = r.token_share + r.reserved_share + r.internal_share + r.external_share
        assert shares == pytest.approx(1.0)
        assert 0 <= r.unused_share <= 1
        results[scheme] = r
    assert results["contiguous-oracle"].internal_slot_iters == 0
    assert results["contiguous-max"].internal_share > results["contiguous-pow2"].internal_share
    assert results["paged"].token_share > 0.9
    assert results["contiguous-max"].token_share < results["contiguous-oracle"].token_share < results["paged"].token_share
    # Same tokens generated whatever the layout (a preempted request resumes
    # where it stopped: its tokens are recomputed, not generated again).
    tokens = {round(r.mean_running * r.iterations) for r in results.values()}
    assert tokens == {int(output.sum())}


def test_bad_config_and_inputs():
    with pytest.raises(ValueError, match="scheme='virtual'"):
        SimConfig(scheme="virtual")
    with pytest.raises(ValueError, match="page_size"):
        SimConfig(scheme="paged", page_size=0)
    with pytest.raises(ValueError, match="page_size must divide pool_tokens"):
        SimConfig(scheme="paged", pool_tokens=100, page_size=16)
    with pytest.raises(ValueError, match="arrival_rate"):
        SimConfig(scheme="paged", arrival_rate=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        simulate([300], [10], SimConfig(scheme="paged", max_seq_len=256))
    with pytest.raises(ValueError, match="pool_tokens=256"):
        simulate([200], [10], SimConfig(scheme="contiguous-max", pool_tokens=256, max_seq_len=512))
    with pytest.raises(ValueError, match="equal-length"):
        simulate([5, 6], [3], SimConfig(scheme="paged"))
