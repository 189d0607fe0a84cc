"""The engine: preemption by recompute does not change outputs, pages all come back.

The model here is a one-layer toy attention model written against the step
convention, so these tests exercise the engine alone; the decoder has its own
engine test in tests/test_llama.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import paged_attention, query_positions
from paged_jax.engine import Engine, EngineConfig, Request, bucket
from paged_jax.kv_cache import KVPool, init_kv_pool, write_layer_pages
from paged_jax.page_state import slot_mapping
from paged_jax.sampling import SamplingParams

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM = 50, 16, 2, 1, 8


def toy_params(seed=0):
    r = np.random.default_rng(seed)
    return {
        "emb": jnp.asarray(r.normal(size=(VOCAB, DIM)), jnp.float32),
        "pos": jnp.asarray(r.normal(size=(256, DIM)) * 0.5, jnp.float32),
        "wq": jnp.asarray(r.normal(size=(DIM, HEADS * HEAD_DIM)), jnp.float32),
        "wk": jnp.asarray(r.normal(size=(DIM, KV_HEADS * HEAD_DIM)), jnp.float32),
        "wv": jnp.asarray(r.normal(size=(DIM, KV_HEADS * HEAD_DIM)), jnp.float32),
        "wo": jnp.asarray(r.normal(size=(HEADS * HEAD_DIM, DIM)), jnp.float32),
    }


def make_toy_step(params):
    """A one-layer attention LM in the engine's step convention."""

    traces = []

    @functools.partial(jax.jit, donate_argnums=1)
    def step(tokens, kv: KVPool, block_tables, kv_lens, q_lens):
        traces.append(tokens.shape)
        b, t = tokens.shape
        pos = query_positions(kv_lens, q_lens, t)
        valid = jnp.arange(t)[None, :] < q_lens[:, None]
        x = params["emb"][tokens] + params["pos"][jnp.clip(pos, 0, 255)]  # [B, T, D]
        q = (x @ params["wq"]).reshape(b, t, HEADS, HEAD_DIM)
        k = (x @ params["wk"]).reshape(b * t, KV_HEADS, HEAD_DIM)
        v = (x @ params["wv"]).reshape(b * t, KV_HEADS, HEAD_DIM)
        slots = slot_mapping(block_tables, pos, valid, page_size=kv.page_size).reshape(-1)
        kv = KVPool(k=write_layer_pages(kv.k, 0, k, slots), v=write_layer_pages(kv.v, 0, v, slots))
        o = paged_attention(q, kv.k[0], kv.v[0], block_tables, kv_lens, q_lens)
        h = x + o.reshape(b, t, -1) @ params["wo"]
        last = h[jnp.arange(b), jnp.maximum(q_lens - 1, 0)]  # [B, D]
        return last @ params["emb"].T, kv

    step.traces = traces
    return step


def toy_pool(num_pages, page_size):
    return init_kv_pool(num_layers=1, num_kv_heads=KV_HEADS, num_pages=num_pages, page_size=page_size, head_dim=HEAD_DIM)


def toy_requests(n, seed=0, max_new=(5, 30), sampling=None):
    r = np.random.default_rng(seed)
    return [
        Request(
            request_id=i,
            prompt_ids=r.integers(0, VOCAB, size=int(r.integers(1, 40))).tolist(),
            max_new_tokens=int(r.integers(*max_new)),
            sampling=sampling(i) if sampling else SamplingParams(),
        )
        for i in range(n)
    ]


@functools.lru_cache(maxsize=None)
def shared_step():
    """One jitted toy step for the tests that do not count compilations, so
    they share compiled programs."""
    return make_toy_step(toy_params())


def serve(requests, num_pages, page_size=4, max_seqs=8, max_seq_len=80, reserve=False, stop_ids=(), split=None):
    step = shared_step()
    engine = Engine(
        step,
        toy_pool(num_pages, page_size),
        EngineConfig(max_seqs=max_seqs, max_seq_len=max_seq_len, reserve_max_len=reserve, decode_split_overhead=split),
        stop_ids=stop_ids,
        vocab_size=VOCAB,
    )
    outs = engine.run(requests)
    return {o.request_id: o for o in outs}, engine


def test_reference_generation_matches_a_no_cache_loop():
    """The engine's greedy tokens equal recomputing the whole sequence each step."""
    params = toy_params()
    req = toy_requests(1, seed=3)[0]
    outs, _ = serve([req], num_pages=64)
    step = shared_step()
    tokens = list(req.prompt_ids)
    bt = jnp.arange(1, 21, dtype=jnp.int32)[None]  # 20 pages of 4: 80 tokens
    for _ in range(req.max_new_tokens):
        n = len(tokens)
        padded = np.zeros((1, 80), np.int32)
        padded[0, :n] = tokens
        logits, _ = step(jnp.asarray(padded), toy_pool(64, 4), bt, jnp.asarray([n]), jnp.asarray([n]))
        tokens.append(int(jnp.argmax(logits[0])))
    assert outs[0].output_ids == tokens[len(req.prompt_ids):]


@pytest.mark.parametrize("sampled", [False, True])
def test_preemption_does_not_change_outputs(sampled):
    sampling = (lambda i: SamplingParams(temperature=0.8, top_p=0.9, seed=i)) if sampled else None
    reqs = toy_requests(12, sampling=sampling)
    big, big_engine = serve(reqs, num_pages=400)
    # 80 tokens per sequence at most = 20 pages; 24 usable pages force preemption.
    small, small_engine = serve(reqs, num_pages=25)
    assert big_engine.stats.preemptions == 0
    assert small_engine.stats.preemptions > 0
    assert sum(o.num_preemptions for o in small.values()) == small_engine.stats.preemptions
    for i in big:
        assert small[i].output_ids == big[i].output_ids, i
        assert len(big[i].output_ids) == reqs[i].max_new_tokens
    for engine in (big_engine, small_engine):
        assert engine.num_free_pages == engine.state.num_pages - 1
        assert int(engine.state.num_free_pages) == engine.state.num_pages - 1
        assert (np.asarray(engine.state.ref_counts) == 0).all()
        assert not engine.has_unfinished()


def test_contiguous_reservation_matches_paged_outputs_with_less_concurrency():
    reqs = toy_requests(10)
    paged, pe = serve(reqs, num_pages=81, max_seqs=10)
    contig, ce = serve(reqs, num_pages=81, max_seqs=10, reserve=True)
    for i in paged:
        assert paged[i].output_ids == contig[i].output_ids
    # 80 usable pages = 4 reservations of 80 tokens; paging fits all 10.
    assert ce.stats.peak_concurrency == 4
    assert pe.stats.peak_concurrency == 10
    assert ce.stats.kv_token_fraction < pe.stats.kv_token_fraction
    assert pe.stats.kv_token_fraction > 0.85


def test_decode_split_by_length_keeps_outputs():
    reqs = toy_requests(12, seed=7)
    one, e1 = serve(reqs, num_pages=400)
    two, e2 = serve(reqs, num_pages=400, split=0)  # split whenever it saves any padding
    assert e2.stats.decode_calls > e1.stats.decode_calls
    for i in one:
        assert one[i].output_ids == two[i].output_ids
    assert e2.num_free_pages == 399


def test_stop_tokens_end_requests_and_free_pages():
    reqs = toy_requests(6, max_new=(40, 41))
    first, _ = serve(reqs, num_pages=200)
    stop = first[0].output_ids[3]
    outs, engine = serve(reqs, num_pages=200, stop_ids=[stop])
    assert outs[0].finish_reason == "stop" and outs[0].output_ids[-1] == stop
    assert len(outs[0].output_ids) <= 4
    assert engine.num_free_pages == 199


def test_compilations_are_bucketed():
    reqs = toy_requests(16, seed=5)
    step = make_toy_step(toy_params())
    engine = Engine(step, toy_pool(200, 4), EngineConfig(max_seqs=8, max_seq_len=80))
    engine.run(reqs)
    assert len(step.traces) == engine.stats.num_programs
    # Buckets: prefill T in {16, 32, 64}, decode B in {1..8}, pages in {1..32}.
    assert engine.stats.num_programs < 25
    assert engine.stats.generated_tokens >= sum(r.max_new_tokens for r in reqs)


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert bucket(3, 16) == 16 and bucket(100, 16, 64) == 64


@pytest.mark.parametrize(
    "req, needle",
    [
        (Request(request_id="e", prompt_ids=[], max_new_tokens=4), "prompt_ids is empty"),
        (Request(request_id="l", prompt_ids=[1] * 70, max_new_tokens=20), "exceeds max_seq_len=80"),
        (Request(request_id="z", prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
        (Request(request_id="v", prompt_ids=[1, VOCAB], max_new_tokens=3), f"token id {VOCAB}"),
        (Request(request_id="f", prompt_ids=[1.9, 2.7], max_new_tokens=3), "token id 1.9 is not an integer"),
        (Request(request_id="s", prompt_ids="123", max_new_tokens=3), "sequence of token ids"),
        (Request(request_id="b", prompt_ids=[1], max_new_tokens=True), "max_new_tokens"),
        (Request(request_id="d", prompt_ids=[1], max_new_tokens=3, sampling={"temperature": 1.0}), "SamplingParams"),
        (Request(request_id="w", prompt_ids={3, 1, 2}, max_new_tokens=3), "sequence of token ids"),
        (Request(request_id="i", prompt_ids=[1], max_new_tokens=3, ignore_eos="no"), "ignore_eos"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(req, needle):
    engine = Engine(shared_step(), toy_pool(40, 4), EngineConfig(max_seqs=4, max_seq_len=80), vocab_size=VOCAB)
    engine.add_request(Request(request_id="ok", prompt_ids=[1, 2], max_new_tokens=2))
    with pytest.raises(ValueError, match=needle):
        engine.add_request(req)
    assert len(engine.waiting) == 1 and engine.num_free_pages == 39
    with pytest.raises(ValueError, match="already added"):
        engine.add_request(Request(request_id="ok", prompt_ids=[3], max_new_tokens=2))
    outs = engine.run()
    assert [o.request_id for o in outs] == ["ok"]


def test_run_is_all_or_nothing():
    engine = Engine(shared_step(), toy_pool(40, 4), EngineConfig(max_seqs=4, max_seq_len=80), vocab_size=VOCAB)
    good = [Request(request_id=i, prompt_ids=[1, 2], max_new_tokens=2) for i in range(2)]
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.run(good + [Request(request_id=9, prompt_ids=[], max_new_tokens=2)])
    with pytest.raises(ValueError, match="already added"):
        engine.run(good + good[:1])
    assert not engine.waiting
    assert sorted(o.request_id for o in engine.run(good)) == [0, 1]


def test_token_ids_fit_int32_without_a_vocabulary_and_stop_ids_are_checked():
    engine = Engine(shared_step(), toy_pool(40, 4), EngineConfig(max_seqs=4, max_seq_len=80))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(Request(request_id=0, prompt_ids=[2**40], max_new_tokens=2))
    assert not engine.waiting
    for bad in ([2.7], "12", 5, [-1]):
        with pytest.raises(ValueError, match="stop_ids"):
            Engine(shared_step(), toy_pool(40, 4), EngineConfig(max_seqs=4, max_seq_len=80), stop_ids=bad)


def test_pool_too_small_for_one_sequence():
    with pytest.raises(ValueError, match="max_seq_len=80"):
        Engine(make_toy_step(toy_params()), toy_pool(10, 4), EngineConfig(max_seq_len=80))


@pytest.mark.parametrize(
    "kwargs, needle",
    [(dict(max_seqs=0), "max_seqs=0"), (dict(max_seq_len=-5), "max_seq_len=-5"), (dict(decode_split_overhead=-1.0), "decode_split_overhead")],
)
def test_bad_engine_config(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(seed=True), "seed"),
    ],
)
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)
