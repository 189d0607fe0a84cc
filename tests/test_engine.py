"""The engine: preemption by recompute does not change outputs, pages all come back.

The model is the one-layer toy in tests/engine_helpers.py, so these tests
exercise the engine alone; the decoder has its own engine test in
tests/test_llama.py, swap preemption its own tests in tests/test_swap.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import init_kv_pool
from tests.engine_helpers import (
    VOCAB,
    ToyModel,
    greedy_reference,
    make_toy_step,
    serve,
    shared_step,
    toy_params,
    toy_pool,
    toy_requests,
)


@pytest.mark.parametrize("budget", [pytest.param(64, marks=pytest.mark.slow), 8])  # 64: a slow extra
def test_reference_generation_matches_a_no_cache_loop(budget):
    """The engine's greedy tokens equal recomputing the whole sequence each
    step without a cache, whether the prompt is prefilled in one call or in
    chunks of 8 tokens (pages of 4: chunks end at page boundaries and
    inside pages as decodes interleave)."""
    params = toy_params()
    reqs = toy_requests(3, seed=3)
    outs, engine = serve(reqs, num_pages=64, budget=budget)
    for req in reqs:
        assert outs[req.request_id].output_ids == greedy_reference(params, req.prompt_ids, req.max_new_tokens)
    assert engine.stats.model_calls == len(engine.stats.calls) <= engine.stats.iterations  # one call at most each


# Slow (80 s): its default twins are the gang-preemption tests (tests/test_parallel_sampling.py), the swap
# tests (tests/test_swap.py) and the KV manager's readmission test (tests/test_kv_manager.py).
@pytest.mark.slow
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


@pytest.mark.slow  # default twin: tests/test_reservation.py (every policy's outputs and concurrency)
def test_contiguous_reservation_matches_paged_outputs_with_less_concurrency():
    reqs = toy_requests(10)
    paged, pe = serve(reqs, num_pages=81, max_seqs=10)
    contig, ce = serve(reqs, num_pages=81, max_seqs=10, reservation="max")
    for i in paged:
        assert paged[i].output_ids == contig[i].output_ids
    # 80 usable pages = 4 reservations of 80 tokens; paging fits all 10.
    assert ce.stats.peak_concurrency == 4
    assert pe.stats.peak_concurrency == 10
    assert ce.stats.kv_token_fraction < pe.stats.kv_token_fraction
    assert pe.stats.kv_token_fraction > 0.85


# Slow (55 s): default twins are tests/test_llama.py's mixed batches against the dense forward and
# tests/test_streaming.py's arrivals while others run, both through chunked prefill in mixed calls.
@pytest.mark.slow
def test_chunked_prefill_in_mixed_batches_keeps_outputs():
    """A token budget of 8 splits every long prompt into chunks that share
    calls with other sequences' decode tokens; the outputs equal one-shot
    prefill with a budget of 80."""
    reqs = toy_requests(12, seed=7)
    one, e1 = serve(reqs, num_pages=400, budget=80)
    chunked, e2 = serve(reqs, num_pages=400, budget=8)
    assert e2.stats.model_calls > e1.stats.model_calls
    assert max(c.tokens for c in e2.stats.calls) <= 8
    mixed = [c for c in e2.stats.calls if 0 < c.decode_tokens < c.tokens]
    assert mixed, "some calls carry prefill chunks and decode tokens together"
    for i in one:
        assert one[i].output_ids == chunked[i].output_ids
    assert e2.num_free_pages == 399 and int(e2.state.num_free_pages) == 399


def test_async_scheduling_keeps_outputs_under_stops_preemption_and_sampling():
    """Dispatching the next call before reading this one's tokens changes
    nothing a request sees: stop tokens (the token computed after one is
    discarded), preemption by recompute while a token is in flight, and
    seeded sampling give the outputs of the synchronous loop."""
    reqs = toy_requests(12, seed=4, sampling=lambda i: SamplingParams(temperature=0.7, seed=i) if i % 2 else
                        SamplingParams())
    first, _ = serve(reqs, num_pages=400, overlap=False)
    stops = [first[i].output_ids[2] for i in (0, 3)]
    for num_pages in (400, 25):  # 25: forces preemption
        sync, es = serve(reqs, num_pages=num_pages, stop_ids=stops, overlap=False)
        over, eo = serve(reqs, num_pages=num_pages, stop_ids=stops, overlap=True)
        for i in sync:
            assert over[i].output_ids == sync[i].output_ids, (num_pages, i)
            assert over[i].finish_reason == sync[i].finish_reason
        assert eo.stats.discarded_tokens > 0 and es.stats.discarded_tokens == 0
        assert (eo.stats.preemptions > 0) == (num_pages == 25)
        for e in (es, eo):
            assert e.num_free_pages == num_pages - 1 and int(e.state.num_free_pages) == num_pages - 1
            assert (np.asarray(e.state.ref_counts) == 0).all()


def test_stop_tokens_end_requests_and_free_pages():
    reqs = toy_requests(6, max_new=(40, 41))
    first, _ = serve(reqs, num_pages=200)
    stop = first[0].output_ids[3]
    outs, engine = serve(reqs, num_pages=200, stop_ids=[stop])
    assert outs[0].finish_reason == "stop" and outs[0].output_ids[-1] == stop
    assert len(outs[0].output_ids) <= 4
    assert engine.num_free_pages == 199


def test_compilations_are_bucketed():
    """Programs depend on the token bucket and the attention classes
    present, never on lengths: 16 requests of every length compile a
    handful, and each program the engine reports was traced once."""
    reqs = toy_requests(16, seed=5)
    step = make_toy_step(toy_params())
    engine = Engine(step, toy_pool(200, 4), EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64))
    engine.run(reqs)
    assert len(step.traces) == engine.stats.num_programs
    # Token buckets 16, 32, 64, each with decode only, chunks only or both.
    assert engine.stats.num_programs <= 9
    assert engine.stats.generated_tokens >= sum(r.max_new_tokens for r in reqs)


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
        (Request(request_id=float("nan"), prompt_ids=[1], max_new_tokens=3), "equal to itself"),
        (Request(request_id=["x"], prompt_ids=[1], max_new_tokens=3), "hashable"),
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
    with pytest.raises(ValueError, match="got one Request"):
        engine.run(good[0])
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
    [
        (dict(max_seqs=0), "max_seqs=0"),
        (dict(max_seq_len=-5), "max_seq_len=-5"),
        (dict(max_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens must be >= max_seqs"),
        (dict(tiling="fast"), "tiling must be"),
    ],
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


class FailingModel(ToyModel):
    """Raises inside the device call once its ``fail_at``-th trace comes."""

    def __init__(self, params, fail_at):
        super().__init__(params)
        self.fail_at = fail_at

    def apply(self, params, batch, kv):
        if len(self.traces) + 1 == self.fail_at:
            self.traces.append(None)
            raise RuntimeError("boom")
        return super().apply(params, batch, kv)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_step_poisons_the_engine_instead_of_hanging(overlap):
    """An exception inside a device call leaves the host plan and the device
    apart: every later step refuses, naming the first failure, and run()
    ends instead of spinning."""
    engine = Engine(FailingModel(toy_params(), fail_at=2), toy_pool(60, 4),
                    EngineConfig(max_seqs=4, max_seq_len=80, max_num_batched_tokens=8, async_scheduling=overlap),
                    vocab_size=VOCAB)
    with pytest.raises(RuntimeError, match="boom"):
        engine.run(toy_requests(3, seed=2))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed in an earlier step .*boom"):
            engine.step()
    with pytest.raises(RuntimeError, match="make a new Engine"):
        engine.run()
    with pytest.raises(RuntimeError, match="make a new Engine"):
        engine.add_request(Request(request_id="late", prompt_ids=[1], max_new_tokens=2))


def test_engine_refuses_a_pool_or_vocabulary_that_does_not_fit_the_model():
    from flax import nnx

    from models.llama import Llama, LlamaConfig
    from models.ragged import RaggedModel

    cfg = LlamaConfig(vocab_size=97, model_dim=32, mlp_dim=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)
    model = RaggedModel(Llama(cfg, rngs=nnx.Rngs(0)))
    config = EngineConfig(max_seqs=4, max_seq_len=64, max_num_batched_tokens=16)
    bad_pool = init_kv_pool(num_layers=2, num_kv_heads=2, num_pages=40, page_size=4, head_dim=16)
    with pytest.raises(ValueError, match=r"\(num_layers, num_kv_heads, head_dim\)=\(2, 2, 8\)"):
        Engine(model, bad_pool, config)
    with pytest.raises(ValueError, match="vocab_size=1000 exceeds the model's vocabulary of 97"):
        Engine(model, cfg.make_kv_pool(40, 4), config, vocab_size=1000)
    with pytest.raises(ValueError, match="kv_pool must be a"):
        Engine(model, None, config)
    with pytest.raises(ValueError, match="config must be an EngineConfig"):
        Engine(model, cfg.make_kv_pool(40, 4), dict(max_seqs=4))
    with pytest.raises(ValueError, match="floating dtype"):
        cfg.make_kv_pool(40, 4, dtype=jnp.int32)
    assert Engine(model, cfg.make_kv_pool(40, 4), config, vocab_size=np.int64(50)).vocab_size == 50
    pool = cfg.make_kv_pool(40, 4)
    engine = Engine(model, pool, config)
    engine.run([Request(request_id=0, prompt_ids=[1, 2, 3], max_new_tokens=2)])  # donates the pool's buffers
    with pytest.raises(ValueError, match="kv_pool's buffers were donated"):  # not XLA's error at the first step
        Engine(model, pool, config)


def test_cli_refuses_an_unusable_compile_cache(tmp_path):
    from experiments.serving.serve_sharegpt import parse_args

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--compile-cache", str(not_a_dir), "--out", str(tmp_path)])
    args = parse_args(["--compile-cache", str(not_a_dir), "--no-compile-cache", "--out", str(tmp_path)])
    assert args.no_compile_cache
