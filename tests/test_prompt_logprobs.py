"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) on a tiny
random Llama, f32, CPU, against a float64 log-softmax of
``models.llama.forward_dense``'s logits (the training forward: no pages, no
cache): whole prompts and chunked ones, a warm prefix cache, mixed batches
(whose other requests are unchanged and compile nothing new), preemption by
recompute and by swap, delta reports, the offline ``LLM.generate``; bad
values refused. Also ``SamplingParams.stop``'s de-duplication and cap.

Every engine here shares one model object and pool shape, every call
rounds up to 16 tokens, every request is greedy with ``logprobs=2`` and, if
it scores its prompt, a ``prompt_logprobs`` that rounds up to 4, and a
request that decodes keeps every chunked call sampling (a call where none
samples is a program of its own): the module compiles five step programs
(5-10 s each on 2 busy cores), the bulk of its time.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama, forward_dense
from models.llm import LLM
from paged_jax.engine.core import Engine, EngineConfig, Request, SamplingParams, num_traces
from paged_jax.engine.sampling import MAX_STOP_STRINGS
from paged_jax.jit_stats import CompileMonitor

TINY = dict(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=2, num_q_heads=3, num_kv_heads=1, head_dim=16,
            rope_theta=10000.0, rms_norm_eps=1e-5)
PAGE, PAGES, SEQS, MAX_LEN, BUDGET = 4, 65, 4, 64, 16
TOL = dict(rel=2e-5, abs=2e-5)  # f32 logits (matmul precision "highest", conftest) against f64 log-softmax


def sp(**kw):
    """Every request's sampling here: greedy, ``logprobs=2`` (one set of program options)."""
    return SamplingParams(logprobs=2, **kw)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig(**TINY), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def llm(model):
    return LLM((model, None), kv_tokens=(PAGES - 1) * PAGE, page_size=PAGE, max_seqs=SEQS, max_seq_len=MAX_LEN,
               max_num_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def engine(llm):
    """``engine(**config)``: a fresh engine on the LLM's model object (its compiled programs shared)."""

    def make(num_pages=PAGES, **config):
        config = dict(dict(max_seqs=SEQS, max_seq_len=MAX_LEN, max_num_batched_tokens=BUDGET), **config)
        return Engine(llm.engine.model, llm.config.make_kv_pool(num_pages, PAGE, llm.engine.kv.k.dtype),
                      EngineConfig(**config), check_page_state=True)

    return make


def oracle(model, tokens):
    """f64[T, V]: row q is the log-softmax of the dense forward's logits at position q (predicting q + 1).
    Run padded to MAX_LEN tokens (causal: the padding changes no earlier row), so it compiles once."""
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(tokens)] = tokens
    logits = np.asarray(forward_dense(model, jnp.asarray(padded))[0, : len(tokens)], np.float64)
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def check_against_oracle(model, prompt, entries, k):
    """``entries`` (``RequestOutput.prompt_logprobs``) are the oracle's, top ``k`` ids in order included."""
    want = oracle(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        top = np.argsort(-want[p - 1], kind="stable")[:k].tolist()
        assert list(entries[p])[:k] == top and set(entries[p]) == set(top) | {prompt[p]}
        for t, lp in entries[p].items():
            assert lp == pytest.approx(want[p - 1, t], **TOL), (p, t)


def assert_close(a, b):
    """Two ``prompt_logprobs`` lists (or ``logprobs`` lists) hold the same tokens, values within f32 noise."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()), rel=1e-5, abs=1e-5)


def with_companion(engine, request):
    """Runs ``request`` beside a short one that decodes meanwhile (so that every call samples); returns its
    output."""
    companion = Request(request_id="companion", prompt_ids=[5, 6], max_new_tokens=8, sampling=sp())
    [out] = [o for o in engine.run([companion, request]) if o.request_id == request.request_id]
    return out


def prompt_of(n, seed):
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], n).tolist()


# --------------------------------------------------------------- the values


def test_generate_reports_the_oracle_values_and_top_k(model, llm):
    prompts = [prompt_of(n, seed) for seed, n in enumerate((1, 6, 13))]
    sampling = [sp(prompt_logprobs=3), sp(prompt_logprobs=0), sp(prompt_logprobs=4, n=2)]
    outs = llm.generate(prompts, sampling, max_tokens=4)
    assert outs[0].prompt_logprobs == [None]  # one token: nothing to score
    check_against_oracle(model, prompts[1], outs[1].prompt_logprobs, 0)
    assert all(len(e) == 1 for e in outs[1].prompt_logprobs[1:])  # k = 0: the token's own only
    check_against_oracle(model, prompts[2], outs[2].prompt_logprobs, 4)  # once per request, whatever n
    assert all(o.num_cached_tokens == 0 for o in outs)
    plain = llm.generate(prompts, [sp(), sp(), sampling[2]], max_tokens=4)
    assert plain[0].prompt_logprobs is None and plain[1].prompt_logprobs is None
    assert_close(plain[2].prompt_logprobs, outs[2].prompt_logprobs)
    assert [o.output_ids for o in plain] == [o.output_ids for o in outs]


def test_chunked_prefill_gives_what_one_chunk_gives(model, engine):
    # A budget of 6 tokens, one of them the companion's decode, cuts a 14-token prompt into 4 + 5 + 5 (boundaries
    # inside pages); 16 takes it whole. Every call rounds up to 16 tokens: the same programs.
    prompt = prompt_of(14, seed=7)
    req = Request(request_id=0, prompt_ids=prompt, max_new_tokens=3, sampling=sp(prompt_logprobs=3))
    chunked_engine, whole_engine = engine(max_num_batched_tokens=6), engine()
    chunked, whole = with_companion(chunked_engine, req), with_companion(whole_engine, req)
    assert [c.tokens for c in list(chunked_engine.stats.calls)[:3]] == [2 + 4, 1 + 5, 1 + 5]
    assert [c.tokens for c in list(whole_engine.stats.calls)[:1]] == [2 + 14]
    assert sum(c.shape.num_prompt_logits > 0 for c in chunked_engine.stats.calls) == 3
    check_against_oracle(model, prompt, chunked.prompt_logprobs, 3)
    assert_close(chunked.prompt_logprobs, whole.prompt_logprobs)
    assert chunked.output_ids == whole.output_ids


def test_a_warm_prefix_cache_does_not_change_them(model, engine):
    prompt = prompt_of(30, seed=3)
    e = engine()
    cold = with_companion(e, Request(request_id=0, prompt_ids=prompt, max_new_tokens=2, sampling=sp(prompt_logprobs=3)))
    [warm] = e.run([Request(request_id=1, prompt_ids=prompt, max_new_tokens=2, sampling=sp())])
    assert warm.num_cached_tokens == 28  # the cache is warm: (30 - 1) // 4 whole pages
    again = with_companion(e, Request(request_id=2, prompt_ids=prompt, max_new_tokens=2,
                                      sampling=sp(prompt_logprobs=3)))
    assert again.num_cached_tokens == 0  # the whole prompt computed
    check_against_oracle(model, prompt, again.prompt_logprobs, 3)
    assert_close(again.prompt_logprobs, cold.prompt_logprobs)
    assert again.output_ids == cold.output_ids == warm.output_ids


def test_a_mixed_batch_leaves_the_others_unchanged_and_compiles_only_scoring_programs(model, llm, engine):
    # Alone, the others make every class of call without prompt rows: prefill only (3 + 5 + 8 of 20 tokens),
    # prefill and decode together (the 20-token prompt's rest beside two decodes), decode only.
    others = [Request(request_id=f"o{i}", prompt_ids=prompt_of(n, seed=20 + i), max_new_tokens=6, sampling=sp())
              for i, n in enumerate((3, 5, 20))]
    scored = [Request(request_id=f"s{i}", prompt_ids=prompt_of(9 + 11 * i, seed=30 + i), max_new_tokens=3,
                      sampling=sp(prompt_logprobs=3)) for i in range(2)]
    alone_engine = engine()
    alone = {o.request_id: o for o in alone_engine.run(others)}
    shapes = {key[0] for key in alone_engine.stats.programs}
    assert all(s.num_prompt_logits == 0 for s in shapes)  # the shapes (and programs) of a build without the feature
    traces = num_traces(llm.engine.model)
    mixed_engine = engine()
    with CompileMonitor() as monitor:
        mixed = {o.request_id: o for o in mixed_engine.run([others[0], scored[0], others[1], scored[1], others[2]])}
    new = {key for key in mixed_engine.stats.programs if key not in alone_engine.stats.programs}
    assert all(key[0].num_prompt_logits > 0 for key in new), new  # the calls without prompt rows compiled nothing
    assert num_traces(llm.engine.model) - traces <= len(new) and monitor.counts.compiled <= len(new)
    for r in others:
        a, m = alone[r.request_id], mixed[r.request_id]
        assert m.prompt_logprobs is None and m.output_ids == a.output_ids
        assert_close(m.outputs[0].logprobs, a.outputs[0].logprobs)
    for r in scored:
        check_against_oracle(model, r.prompt_ids, mixed[r.request_id].prompt_logprobs, 3)


# ------------------------------------------------------------ preemption


# Swap is slow here for a reason of its own: the pool comes back from a swap-in committed to its device, and
# JAX then compiles every step program again (25 s on 2 busy cores).
@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_preemption_neither_repeats_nor_loses_them(model, engine, mode):
    prompt = prompt_of(41, seed=11)
    e = engine(preemption_mode=mode, async_scheduling=False)
    # The companion decodes in every call, so that every call samples (and its program is one of the others').
    e.add_request(Request(request_id="companion", prompt_ids=[5, 6], max_new_tokens=40, sampling=sp()))
    e.add_request(Request(request_id="r", prompt_ids=prompt, max_new_tokens=5,
                          sampling=sp(prompt_logprobs=3, output_kind="delta")))
    deltas = []

    def step():
        deltas.extend(o for o in e.step() if o.request_id == "r")

    step()  # the first chunk: tokens 1..14 scored
    group = e.running[-1].group
    assert group.request.request_id == "r" and group.seqs[0].num_computed == 14
    e.scheduler.preempt(group)  # in the middle of the prompt
    while not deltas:
        step()
    # Recompute once more while decoding (every prompt token is scored by now; swapped, nothing is computed
    # again, and a second swap would only compile copies of other sizes).
    preemptions = 1 if mode == "swap" else 2
    if mode == "recompute":
        e.scheduler.preempt(group)
    calls_before = len(e.stats.calls)
    while e.has_unfinished():
        step()
    assert deltas[-1].finished and deltas[-1].num_preemptions == e.stats.preemptions == preemptions
    assert all(c.shape.num_prompt_logits == 0 for c in list(e.stats.calls)[calls_before:])  # nothing scored again
    reported = [d.prompt_logprobs for d in deltas]
    assert reported[1:] == [[]] * (len(deltas) - 1)  # all in the first report, with the first token
    check_against_oracle(model, prompt, reported[0], 3)
    if mode == "swap":
        assert e.stats.swap_outs == 1 and e.stats.recomputed_tokens == 0
    else:
        assert e.stats.swap_outs == 0 and e.stats.recomputed_tokens > 0


# ------------------------------------------------------------ refusals


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_bad_prompt_logprobs_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=rf"prompt_logprobs must be an int in \[0, 21\), got prompt_logprobs={bad!r}"):
        SamplingParams(prompt_logprobs=bad)


def test_stop_strings_are_deduplicated_and_capped():
    assert SamplingParams(stop=["b", "a", "b", "a"]).stop == ("b", "a")
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert len(SamplingParams(stop=many + many[:5]).stop) == MAX_STOP_STRINGS  # duplicates do not count
    with pytest.raises(ValueError, match=rf"stop must hold at most {MAX_STOP_STRINGS} distinct strings.*"
                                         rf"got len\(stop\)={MAX_STOP_STRINGS + 1}"):
        SamplingParams(stop=many + ["one more"])
