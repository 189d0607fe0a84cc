"""Beam search: the engine's paged, page-sharing beam search equals an
unpaged f64 NumPy beam search over the same model (every beam recomputed
from its own tokens), and with enough beams it equals exhaustive search.
"""

import functools
import itertools

import numpy as np
import pytest

from paged_jax.engine import beam_search
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from tests.engine_helpers import PAGE, ToyModel, dense_logits, make_engine, toy_params, toy_pool


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def reference_beam_search(params, prompt, width, max_new, length_penalty=1.0, stop_ids=frozenset()):
    """The same search on the f64 oracle: no cache, no pages, each beam's
    log-probabilities recomputed from its whole token list."""
    beams = [(list(prompt), 0.0)]
    hyps = []
    for step in range(max_new):
        lps = np.stack([log_softmax(dense_logits(params, toks)) for toks, _ in beams])
        k = min(2 * width, lps.shape[1])
        ids = np.argsort(-lps, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(lps, ids, axis=1)
        chosen, ended = beam_search.expand([c for _, c in beams], ids, top, width=width, stop_ids=stop_ids,
                                           at_max_len=step + 1 == max_new)
        for c in ended:
            out = beams[c.parent][0][len(prompt):] + [c.token]
            hyps.append((beam_search.score(c.cum_logprob, len(out), length_penalty), out, c.cum_logprob))
        if not chosen or len(hyps) >= width:
            break
        beams = [(beams[c.parent][0] + [c.token], c.cum_logprob) for c in chosen]
    return [(out, cum) for _, out, cum in sorted(hyps, key=lambda h: -h[0])[:width]]


def beam_request(rid, prompt, width, max_new, **kw):
    return Request(request_id=rid, prompt_ids=prompt, max_new_tokens=max_new, ignore_eos=True,
                   sampling=SamplingParams(beam_width=width, **kw))


def test_expand_picks_the_best_continuations_and_keeps_stop_hypotheses():
    ids = np.array([[5, 2, 7], [2, 9, 5]])
    lps = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    beams, ended = beam_search.expand([0.0, np.log(0.4)], ids, lps, width=2, stop_ids=frozenset({2}))
    # Probabilities: (0,5) .5, (0,2) .3 stop, (1,2) .24 stop, (0,7) .2, (1,9) .12, (1,5) .04
    assert [(c.parent, c.token) for c in beams] == [(0, 5), (0, 7)]
    assert [(c.parent, c.token, c.finish_reason) for c in ended] == [(0, 2, "stop")]  # rank 1 < width; rank 2 is not
    beams, ended = beam_search.expand([0.0, 0.0], ids, lps, width=2, at_max_len=True)
    assert beams == [] and [c.finish_reason for c in ended] == ["length", "length"]
    assert beam_search.score(-6.0, 3, 1.0) == -2.0 and beam_search.score(-6.0, 3, 0.0) == -6.0


@pytest.mark.parametrize("width,overlap", [(2, True), (4, False), (5, True)])
def test_engine_beams_equal_the_unpaged_reference(width, overlap):
    params = toy_params()
    rng = np.random.default_rng(width)
    reqs = [beam_request(i, rng.integers(0, 50, size=int(rng.integers(3, 14))).tolist(), width, 9,
                         length_penalty=0.7) for i in range(3)]
    engine = make_engine(max_seqs=16, overlap=overlap)
    outs = {o.request_id: o for o in engine.run(reqs)}
    for r in reqs:
        ref = reference_beam_search(params, r.prompt_ids, width, 9, length_penalty=0.7)
        got = [(c.output_ids, c.cumulative_logprob) for c in outs[r.request_id].outputs]
        assert [o for o, _ in got] == [o for o, _ in ref], r.request_id
        np.testing.assert_allclose([c for _, c in got], [c for _, c in ref], rtol=1e-4)
    assert engine.accounting()["used"] == 0


def test_beams_share_pages_while_searching():
    prompt = np.random.default_rng(1).integers(0, 50, size=17).tolist()  # 4 full pages + 1 token
    engine = make_engine(max_seqs=8, overlap=False)
    engine.add_request(beam_request("b", prompt, 4, 12))
    shared_seen = 0
    while engine.has_unfinished():
        engine.step()
        live = [s for s in engine.running if s.fork_pre is None]
        if len(live) == 4:
            tables = [engine.kv_manager.pool.pages(s.slot) for s in live]
            assert all(t[:4] == tables[0][:4] for t in tables)  # the prompt's full pages, once
            assert engine.kv_manager.pool.ref_counts[tables[0][0]] == 4
            shared_seen += 1
            used = engine.accounting()["used"]
            assert used < sum(len(t) for t in tables)
    assert shared_seen > 3
    assert engine.accounting()["used"] == 0


class TinyVocabModel(ToyModel):
    vocab_size = 3


def test_enough_beams_equal_exhaustive_search():
    """Vocabulary 3, 3 new tokens: 9 beams keep every prefix, so the 9
    hypotheses are the 9 best of all 27 continuations, in order."""
    params = dict(toy_params(seed=4))
    params["emb"] = params["emb"][:3] * 3.0
    model = TinyVocabModel(params)
    engine = Engine(model, toy_pool(64, PAGE), EngineConfig(max_seqs=9, max_seq_len=32, max_num_batched_tokens=32),
                    vocab_size=3, check_page_state=True)
    prompt = [0, 2, 1, 1, 0]
    (out,) = engine.run([beam_request(0, prompt, 9, 3)])
    scored = []
    for cont in itertools.product(range(3), repeat=3):
        toks, total = list(prompt), 0.0
        for t in cont:
            total += log_softmax(dense_logits(params, toks))[t]
            toks.append(t)
        scored.append((total, list(cont)))
    best = sorted(scored, key=lambda x: -x[0])[:9]
    assert [c.output_ids for c in out.outputs] == [cont for _, cont in best]
    np.testing.assert_allclose([c.cumulative_logprob for c in out.outputs], [s for s, _ in best], rtol=1e-5)


def _preemption_requests():
    rng = np.random.default_rng(8)
    return [beam_request(i, rng.integers(0, 50, size=int(rng.integers(3, 16))).tolist(), 3, 14) for i in range(6)]


@functools.cache
def _unpressured_beams():
    """The large pool's beams, shared by both preemption modes."""
    return {o.request_id: o for o in make_engine(400, max_seqs=16).run(_preemption_requests())}


@pytest.mark.parametrize("mode", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])  # 25 s: one mode by default
def test_beam_groups_survive_preemption(mode):
    reqs = _preemption_requests()
    big = _unpressured_beams()
    engine = make_engine(30, max_seqs=16, preemption_mode=mode, max_seq_len=36)
    small = {o.request_id: o for o in engine.run(reqs)}
    assert engine.stats.preemptions > 0
    for r in reqs:
        assert [c.output_ids for c in small[r.request_id].outputs] == [c.output_ids for c in big[r.request_id].outputs]
    assert engine.accounting()["used"] == 0 and engine.kv_manager.swap.used == 0


def test_beam_search_arguments_are_checked():
    with pytest.raises(ValueError, match="needs temperature=0"):
        SamplingParams(beam_width=2, temperature=0.5)
    with pytest.raises(ValueError, match="beam_width must be"):
        SamplingParams(beam_width=-1)
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(beam_width=2, length_penalty=float("nan"))
    engine = make_engine(64, max_seqs=4)
    with pytest.raises(ValueError, match="beam_width=5 exceeds max_seqs=4"):
        engine.add_request(beam_request(0, [1, 2], 5, 3))
