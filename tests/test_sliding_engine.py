"""The engine on a model whose every layer attends a sliding window: pages
that leave the window return to the pool while their sequence runs, and
nothing else changes (paged_jax.paging.sliding_window through the KV manager).

Every engine here compares its device page state with the host's twin
after each call (``check_page_state``)."""

import functools

import numpy as np
import pytest
from engine_helpers import (
    PAGE,
    VOCAB,
    ToyModel,
    check_accounting,
    greedy_reference,
    make_engine,
    one_sequence_steps,
    toy_params,
    toy_pool,
    toy_requests,
)

from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.memory import layer_pages
from paged_jax.paging.page_state import NULL_PAGE, pages_for_tokens
from paged_jax.paging.sliding_window import window_first_kept

WINDOW = 10  # tokens; pages of 4, so a long sequence keeps 3 or 4 pages


@functools.lru_cache(maxsize=None)
def window_model():
    return ToyModel(toy_params(), window=WINDOW)


def window_engine(num_pages=200, *, drop=True, max_seqs=8, budget=64, max_seq_len=60, **config):
    return Engine(window_model(), toy_pool(num_pages),
                  EngineConfig(max_seqs=max_seqs, max_seq_len=max_seq_len, max_num_batched_tokens=budget,
                               drop_out_of_window_pages=drop, **config),
                  vocab_size=VOCAB, check_page_state=True)


def outputs(engine, requests):
    return {o.request_id: [list(c.output_ids) for c in o.outputs] for o in engine.run(requests)}


def test_greedy_outputs_equal_the_windowed_oracle_and_keeping_every_page():
    reqs = toy_requests(4, seed=3, prompt_len=(2, 20), max_new=(20, 40))
    dropping, keeping = window_engine(), window_engine(drop=False)
    got, kept = outputs(dropping, reqs), outputs(keeping, reqs)
    assert got == kept
    params = toy_params()
    for r in reqs[:3]:
        assert got[r.request_id][0] == greedy_reference(params, r.prompt_ids, r.max_new_tokens, window=WINDOW)
    assert dropping.stats.window_dropped_pages > 0 and keeping.stats.window_dropped_pages == 0
    assert dropping.stats.peak_pages_used < keeping.stats.peak_pages_used
    check_accounting(dropping)
    assert dropping.accounting()["used"] == 0


def test_a_decoding_sequence_holds_exactly_the_pages_its_window_sees():
    engine = window_engine(budget=8, max_seq_len=120)
    engine.add_request(Request(request_id=0, prompt_ids=list(range(1, 14)), max_new_tokens=50))
    pool = engine.kv_manager.pool
    checked = 0
    for slot, n, computed in one_sequence_steps(engine, prompt_len=13, chunk=8):
        live = [p for p in pool.block_tables[slot, : pool.num_seq_pages[slot]].tolist() if p != NULL_PAGE]
        expected = pages_for_tokens(n, PAGE) - int(window_first_kept(computed, sliding_window=WINDOW,
                                                                      page_size=PAGE))
        assert len(live) == expected, (n, live)
        if n > 13:  # decoding: what the memory maths counts for a sequence of n tokens
            assert expected == layer_pages(n, PAGE, WINDOW)
        assert len(live) <= pages_for_tokens(WINDOW, PAGE) + 2  # never more than the window and the page it grows
        checked += 1
    assert checked > 40
    # the last round saw 62 tokens computed (the 63rd, the last sampled, is never fed back)
    assert engine.stats.window_dropped_pages == int(window_first_kept(62, sliding_window=WINDOW, page_size=PAGE))


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])  # 20 s more
def test_preemption_under_a_small_pool_gives_the_large_pools_outputs(mode):
    """A pool so small that it preempts while pages drop: by recompute (the
    dropped prefix is prefilled again, then dropped again) and by swap
    (only live pages are copied; dropped ones come back null)."""
    reqs = toy_requests(6, seed=5, prompt_len=(4, 16), max_new=(20, 36),
                        sampling=lambda i: SamplingParams(temperature=0.7, seed=i))
    small = window_engine(num_pages=16, preemption_mode=mode)
    assert outputs(small, reqs) == outputs(window_engine(drop=False), reqs)
    assert small.stats.preemptions > 0 and small.stats.window_dropped_pages > 0
    if mode == "swap":
        assert small.stats.swap_outs > 0
    check_accounting(small)


def test_parallel_samples_beams_and_prefix_hits_give_the_large_pools_outputs():
    shared = [int(t) for t in np.random.default_rng(9).integers(0, VOCAB, 12)]
    reqs = [Request(request_id=i, prompt_ids=shared + [i], max_new_tokens=14,
                    sampling=[SamplingParams(temperature=0.9, seed=i, n=2), SamplingParams(beam_width=2),
                              SamplingParams()][i % 3])
            for i in range(3)]
    small = window_engine(num_pages=24, max_seqs=8)
    assert outputs(small, reqs) == outputs(window_engine(drop=False), reqs)
    assert small.stats.window_dropped_pages > 0 and small.stats.prefix_hit_tokens > 0
    check_accounting(small)


def test_a_model_with_a_full_attention_layer_keeps_every_page():
    engine = make_engine()  # the shared toy model: causal attention over everything
    engine.run(toy_requests(2, seed=1, max_new=(30, 40)))
    assert engine.kv_manager.sliding_window is None and engine.stats.window_dropped_pages == 0


@pytest.mark.parametrize("window", [np.int64(3), 0, 2.5, True])
def test_a_bad_kv_window_is_refused_when_the_engine_is_built(window):
    with pytest.raises(ValueError, match="model.kv_window must be None or an int >= 1"):
        Engine(ToyModel(toy_params(), window=window), toy_pool(20), EngineConfig(max_seqs=2, max_seq_len=40),
               vocab_size=VOCAB)
