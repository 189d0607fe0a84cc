"""A hybrid model (sliding-window and full layers mixed, as Gemma 3) with a
block table per layer group (paged_jax.paging.kv_groups through the KV manager):
each sliding group's pages return to the pool once they leave its window,
the full group keeps its pages, and outputs equal the same engine keeping
every page in one table and the float64 oracle.

Every engine here compares its device page state with the host's twin
after each call (``check_page_state``). Pages of the grouped pool hold
``group_size`` layers, those of the whole pool every layer: memory is
compared in page-layers (pages x layers a page holds)."""

import functools

import numpy as np
import pytest
from engine_helpers import (
    PAGE,
    VOCAB,
    LayeredToyModel,
    check_accounting,
    layered_greedy_reference,
    layered_params,
    one_sequence_steps,
    toy_requests,
)

from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.memory import layer_pages, sliding_layer_count
from paged_jax.paging.kv_groups import KVGroups, kv_groups, single_group
from paged_jax.paging.page_state import NULL_PAGE, pages_for_tokens
from paged_jax.paging.sliding_window import window_first_kept

WINDOW = 8  # tokens; pages of 4
WINDOWS = (WINDOW,) * 5 + (None,)  # Gemma 3's 5 local : 1 global -> 6 groups of one layer


# ------------------------------------------------------------------ groups


def gemma_windows(num_layers, global_every, window):
    """Gemma's rule: layer i global iff (i + 1) % global_every == 0."""
    return [None if (i + 1) % global_every == 0 else window for i in range(num_layers)]


def test_gemma_3_12b_has_six_groups_of_eight_layers():
    groups = kv_groups(gemma_windows(48, 6, 1024))
    assert sliding_layer_count(48, 6) == 40
    assert groups.group_size == 8 and groups.num_groups == 6 and groups.padded_layer_rows == 0
    assert groups.windows == (1024,) * 5 + (None,)  # sliding first: layer 0 is sliding
    assert groups.layer_group[:7] == (0, 0, 0, 0, 0, 5, 0) and groups.layer_index[:7] == (0, 1, 2, 3, 4, 0, 5)
    assert groups.layer_group[47] == 5 and groups.layer_index[47] == 7  # the 8th full layer
    assert groups.layer_group[46] == 4 and groups.layer_index[46] == 7  # the 40th sliding layer


def test_gemma_2_alternating_layers_make_two_groups():
    groups = kv_groups(gemma_windows(42, 2, 4096))
    assert (groups.num_groups, groups.group_size, groups.windows) == (2, 21, (4096, None))
    assert groups.layer_index[:4] == (0, 0, 1, 1)


def test_a_kind_not_a_multiple_of_the_group_size_pads_its_last_group():
    groups = kv_groups([6, None, 6, 6, None, 6, 6])  # 5 sliding, 2 full -> groups of 2: sliding 2, 2, 1; full 2
    assert groups.group_size == 2 and groups.windows == (6, 6, 6, None)
    assert groups.padded_layer_rows == 1  # group 2's pages carry one unused layer row
    assert groups.layer_group == (0, 3, 0, 1, 3, 1, 2) and groups.layer_index == (0, 0, 1, 0, 1, 1, 0)


def test_one_kind_is_one_group_of_every_layer():
    assert single_group(5) == kv_groups([None] * 5)
    g = kv_groups([7] * 3)
    assert (g.num_groups, g.group_size, g.uniform_window, g.rows(2, 8)) == (1, 3, 7, [2])
    assert kv_groups(WINDOWS).rows(2, 8) == [2, 10, 18, 26, 34, 42]


@pytest.mark.parametrize("windows, match", [([], "layer_windows"), ([4, 0], r"layer_windows\[1\]"),
                                            ([None, 2.5], r"layer_windows\[1\]"), ([True], r"layer_windows\[0\]")])
def test_bad_layer_windows_are_refused_by_name(windows, match):
    with pytest.raises(ValueError, match=match):
        kv_groups(windows)


def test_inconsistent_groups_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        KVGroups(windows=(None,), layer_group=(0, 0), layer_index=(0, 0), group_size=2)
    with pytest.raises(ValueError, match="no layer"):
        KVGroups(windows=(None, 4), layer_group=(0,), layer_index=(0,), group_size=1)


# ------------------------------------------------------------------ engine


@functools.lru_cache(maxsize=None)
def hybrid_model():
    return LayeredToyModel(layered_params(len(WINDOWS)), WINDOWS)


def hybrid_engine(num_pages=400, *, grouped=True, max_seqs=8, budget=64, max_seq_len=48, **config):
    model = hybrid_model()
    return Engine(model, model.pool(num_pages, grouped=grouped),
                  EngineConfig(max_seqs=max_seqs, max_seq_len=max_seq_len, max_num_batched_tokens=budget, **config),
                  vocab_size=VOCAB, check_page_state=True)


def outputs(engine, requests):
    return {o.request_id: [list(c.output_ids) for c in o.outputs] for o in engine.run(requests)}


@functools.lru_cache(maxsize=None)
def whole_run(key):
    """The engine keeping every page in one table (the layout before layer
    groups), on the requests ``REQUESTS[key]``: (outputs, its stats)."""
    engine = hybrid_engine(grouped=False)
    return outputs(engine, REQUESTS[key]()), engine.stats


def whole_outputs(key):
    return whole_run(key)[0]


REQUESTS = {
    "greedy": lambda: toy_requests(4, seed=3, prompt_len=(10, 24), max_new=(16, 24)),
    "sampled": lambda: toy_requests(6, seed=5, prompt_len=(4, 16), max_new=(20, 30),
                                    sampling=lambda i: SamplingParams(temperature=0.7, seed=i)),
    "prefix": lambda: shared_prefix_requests(),
    "forks": lambda: [Request(request_id=i, prompt_ids=[int(t) for t in np.random.default_rng(i).integers(0, VOCAB, 14)],
                              max_new_tokens=14,
                              sampling=[SamplingParams(temperature=0.9, seed=i, n=2), SamplingParams(beam_width=2),
                                        SamplingParams()][i % 3])
                      for i in range(3)],
}


def test_greedy_outputs_equal_the_oracle_and_keeping_every_page_in_less_memory():
    reqs = REQUESTS["greedy"]()
    engine = hybrid_engine()
    got = outputs(engine, reqs)
    assert got == whole_outputs("greedy")
    params = hybrid_model().params
    for r in reqs[:2]:
        assert got[r.request_id][0] == layered_greedy_reference(params, r.prompt_ids, r.max_new_tokens, WINDOWS)
    kvm = engine.kv_manager
    assert kvm.groups.num_groups == 6 and kvm.state.max_seqs == 6 * 8
    assert kvm.prefix_cache is not None
    assert engine.stats.window_dropped_pages > 0
    # page-layers at the peak: a grouped page holds 1 layer, a whole page 6
    assert engine.stats.peak_pages_used * 1 < whole_run("greedy")[1].peak_pages_used * len(WINDOWS)
    check_accounting(engine)
    assert engine.accounting()["used"] == 0


def test_a_decoding_sequence_holds_exactly_its_groups_pages():
    """Per row: the full group every page of the sequence, each sliding
    group only the pages its window sees (what the memory maths counts)."""
    engine = hybrid_engine(budget=8, max_seq_len=120)
    engine.add_request(Request(request_id=0, prompt_ids=list(range(1, 14)), max_new_tokens=40))
    pool, S = engine.kv_manager.pool, 8
    checked = 0
    for slot, n, computed in one_sequence_steps(engine, prompt_len=13, chunk=8):
        for g, window in enumerate(WINDOWS):
            row = g * S + slot
            assert int(pool.seq_lens[row]) == n
            live = [p for p in pool.block_tables[row, : pool.num_seq_pages[row]].tolist() if p != NULL_PAGE]
            dropped = 0 if window is None else int(window_first_kept(computed, sliding_window=window, page_size=PAGE))
            assert len(live) == pages_for_tokens(n, PAGE) - dropped, (g, n, live)
            if n > 13:
                assert len(live) == layer_pages(n, PAGE, window)
        checked += 1
    assert checked > 30
    # the last round saw 52 tokens computed: 5 sliding groups dropped what their window no longer saw
    assert engine.stats.window_dropped_pages == 5 * int(window_first_kept(52, sliding_window=WINDOW, page_size=PAGE))


def shared_prefix_requests(prefix_len=22, seed=11):
    """Three requests with one prompt prefix (different tails)."""
    r = np.random.default_rng(seed)
    prefix = r.integers(0, VOCAB, prefix_len).tolist()
    return [Request(request_id=i, prompt_ids=prefix + r.integers(0, VOCAB, 3 + i).tolist(), max_new_tokens=10)
            for i in range(3)]


def test_prefix_hits_take_each_groups_pages_and_keep_the_outputs():
    """Request 0 runs alone; 1 and 2 then hit its 5 full prefix pages (20
    tokens): the full group shares all five, each sliding group (window 8)
    only the pages the query at 20 still sees, columns 3 and 4, null
    before (vLLM v1's find_longest_cache_hit)."""
    reqs = shared_prefix_requests()
    engine = hybrid_engine()
    first = outputs(engine, reqs[:1])
    engine.add_request(reqs[1])
    engine.add_request(reqs[2])
    engine.step()  # admits both: the prefix from the cache, the tails computed
    kvm, S = engine.kv_manager, 8
    seqs = sorted(engine.running, key=lambda s: s.request.request_id)
    assert [s.group.num_cached_tokens for s in seqs] == [20, 20]
    first_kept = int(window_first_kept(20, sliding_window=WINDOW, page_size=PAGE))
    assert first_kept == 3
    for g, window in enumerate(WINDOWS):
        a, b = (kvm.pool.block_tables[g * S + s.slot, :5].tolist() for s in seqs)
        assert a == b  # both hold the cached pages
        if window is None:
            assert NULL_PAGE not in a
        else:
            assert a[:3] == [NULL_PAGE] * 3 and NULL_PAGE not in a[3:]
    rest = outputs(engine, [])
    assert {**first, **rest} == outputs(hybrid_engine(enable_prefix_caching=False), reqs) == whole_outputs("prefix")
    assert engine.stats.prefix_hit_tokens == 40
    assert engine.stats.prefix_hit_pages == 2 * (5 + 5 * 2)  # per request: the full group's 5, 2 per sliding group
    check_accounting(engine)
    assert engine.accounting()["used"] == 0


def test_prefix_hits_under_recompute_preemption_give_the_large_pools_outputs():
    """Six requests sharing a 22-token prefix in a pool that preempts: hits
    at admission and at readmission (a recomputed sequence takes its own
    cached window pages back) keep the outputs."""
    r = np.random.default_rng(4)
    prefix = r.integers(0, VOCAB, 22).tolist()
    reqs = [Request(request_id=i, prompt_ids=prefix + r.integers(0, VOCAB, 2 + i).tolist(), max_new_tokens=18)
            for i in range(6)]
    small = hybrid_engine(num_pages=80)
    got = outputs(small, reqs)
    assert small.stats.preemptions > 0 and small.stats.prefix_hit_tokens > 0
    assert small.stats.window_dropped_pages > 0
    assert got == outputs(hybrid_engine(enable_prefix_caching=False), reqs)
    check_accounting(small)


def test_a_request_is_checked_against_its_groups_pages_not_an_even_split():
    """79 usable pages, 6 groups, window 8, chunks of 8: two sequences of
    39 tokens hold at most 2 x (10 + 5 x 5) = 70 pages (a sliding group:
    its window and one chunk), so they are served; an even split of the
    pool (13 pages a group) refused them. With chunks of 64 a sliding group
    may hold all 10 at once: 120 pages, refused, saying so."""
    prompt = list(range(1, 26))
    request = Request(request_id=0, prompt_ids=prompt, max_new_tokens=14,
                      sampling=SamplingParams(temperature=0.8, seed=1, n=2))
    small = hybrid_engine(num_pages=80, budget=8)
    assert small.limits.seq_pages(39) == 35
    got = outputs(small, [request])
    assert got == outputs(hybrid_engine(budget=8), [request]) and small.stats.window_dropped_pages > 0
    check_accounting(small)
    with pytest.raises(ValueError, match=r"request 0: 2 sequences holding 39 tokens each \(reservation='paged'\) need "
                                         r"up to 120 pages, over 6 layer groups, more than the pool's 79"):
        hybrid_engine(num_pages=80).add_request(request)


@pytest.mark.slow  # 30-80 s each; the default twin: test_sliding_engine's preemption of a one-group model
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_small_pool_gives_the_large_pools_outputs(mode):
    small = hybrid_engine(num_pages=80, preemption_mode=mode)
    assert outputs(small, REQUESTS["sampled"]()) == whole_outputs("sampled")
    assert small.stats.preemptions > 0 and small.stats.window_dropped_pages > 0
    if mode == "swap":
        assert small.stats.swap_outs > 0 and small.stats.swapped_in_pages > 0
    check_accounting(small)


@pytest.mark.slow  # 250 s on two busy cores (the beams' and samplers' programs)
def test_parallel_samples_and_beams_give_the_large_pools_outputs():
    small = hybrid_engine(num_pages=90)
    assert outputs(small, REQUESTS["forks"]()) == whole_outputs("forks")
    assert small.stats.window_dropped_pages > 0
    check_accounting(small)


def test_what_several_groups_do_not_take_is_refused_by_name():
    with pytest.raises(ValueError, match="reservation='max' with 6 layer groups"):
        hybrid_engine(reservation="max")
    with pytest.raises(ValueError, match="drop_out_of_window_pages=False keeps one table"):
        hybrid_engine(drop_out_of_window_pages=False)
    model = hybrid_model()
    with pytest.raises(ValueError, match="kv pool must have 6 or 1 layers"):
        Engine(model, LayeredToyModel(model.params, WINDOWS[:2] * 2).pool(50, grouped=False),
               EngineConfig(max_seqs=2, max_seq_len=40), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="per layer group"):  # 6 groups: 20 usable pages hold 3 pages each
        hybrid_engine(num_pages=21, max_seq_len=40)


@pytest.mark.slow  # compiles the decoder for two layouts: 560 s on two busy cores
def test_the_decoder_reads_per_group_tables_as_it_reads_one():
    """models.llama with Gemma 3's layer pattern (a window shorter than the
    prompts): a pool laid out by layer group gives the greedy tokens of a
    pool of every layer, and of the dense forward."""
    import jax.numpy as jnp
    from flax import nnx

    from models.config import LlamaConfig
    from models.llama import Llama, forward_dense
    from models.ragged import RaggedModel

    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6))
    config = LlamaConfig(vocab_size=VOCAB, model_dim=16, mlp_dim=32, num_layers=6, num_q_heads=2, num_kv_heads=1,
                         head_dim=8, sliding_window=WINDOW, layer_types=types, local_rope_theta=10_000.0,
                         qk_norm="head", norm_plus_one=True, norm_placement="pre_post", mlp_activation="gelu_tanh")
    decoder = Llama(config, rngs=nnx.Rngs(0))
    model = RaggedModel(decoder, impl="xla")
    assert model.kv_groups.num_groups == 6 and model.make_kv_pool(10, PAGE).num_layers == 1
    reqs = toy_requests(2, seed=7, prompt_len=(14, 20), max_new=(8, 10))
    got = {}
    for grouped in (True, False):
        pool = model.make_kv_pool(120, PAGE) if grouped else config.make_kv_pool(40, PAGE)
        engine = Engine(model, pool, EngineConfig(max_seqs=2, max_seq_len=32, max_num_batched_tokens=32),
                        vocab_size=VOCAB, check_page_state=True)
        got[grouped] = outputs(engine, reqs)
        assert (engine.stats.window_dropped_pages > 0) == grouped
    assert got[True] == got[False]
    r = reqs[0]
    tokens = list(r.prompt_ids)
    for _ in range(r.max_new_tokens):
        tokens.append(int(jnp.argmax(forward_dense(decoder, jnp.asarray([tokens]))[0, -1])))
    assert got[True][r.request_id][0] == tokens[len(r.prompt_ids):]


@pytest.mark.slow  # ~30 s; its engine path is the grouped-pool tests' above, its table is in results/
def test_hybrid_capacity_script_counts_and_says_when_memory_did_not_bind(tmp_path):
    """experiments.memory.hybrid_capacity at toy size: the maths columns, and the
    warning when the schedule rather than the pool capped the sequences
    (2 generated tokens, chunks of 8: a request ends before the next is
    prefilled)."""
    from experiments.memory import hybrid_capacity

    args = ["--context", "64", "--window", "8", "--page-size", "4", "--full-sequences", "2", "--num-requests", "6",
            "--baseline-requests", "3", "--budget-tokens", "8", "--max-seqs", "8", "--out", str(tmp_path)]
    rows = hybrid_capacity.main(args + ["--new-tokens", "2"])
    assert [r["maths_page_layers_per_seq"] for r in rows] == [6 * 16, 16 + 5 * layer_pages(64, PAGE, 8)] == [96, 26]
    assert [r["maths_sequences"] for r in rows] == [2, 7]
    text = (tmp_path / "hybrid_capacity.md").read_text()
    assert "Memory did not bind the a table per layer group run" in text and "Raise --new-tokens" in text
