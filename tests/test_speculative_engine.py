"""Speculative decoding in the engine: proposals verified in the one ragged
call, rejected tokens' pages rolled back, outputs unchanged.

Greedy outputs with speculation equal those without it token for token (with
prefix caching, preemption by recompute and swap, parallel samples, stop
tokens, streaming); the device page state is compared with the host's twin
after every call (``check_page_state``) and after every rollback; page ids
after a rollback are checked exactly; sampling verification emits the
target's distribution (chi-square, with a mutant that fails it).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import PAGE, VOCAB, check_accounting, greedy_reference, make_engine, shared_step, toy_requests

from paged_jax.engine import EngineConfig, Request, SamplingParams
from paged_jax.engine import sampling as sampling_mod
from paged_jax.speculative.config import SpeculativeConfig
from paged_jax.speculative.proposers import NgramProposer

NGRAM = SpeculativeConfig.ngram(3, 1, 3)


def _repetitive_requests(n, seed=0, sampling=None, max_new=(5, 24)):
    """Prompts that repeat a short random motif, so n-gram lookup proposes often."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        motif = rng.integers(0, VOCAB, size=int(rng.integers(3, 9))).tolist()
        prompt = (motif * 6)[: int(rng.integers(8, 40))]
        out.append(Request(request_id=i, prompt_ids=prompt, max_new_tokens=int(rng.integers(*max_new)),
                           sampling=sampling(i) if sampling else SamplingParams()))
    return out


def _engine(**kwargs):
    """``make_engine`` with one pool and row count for every test here (they
    then share compiled programs; 40 pages make the busier runs preempt)."""
    return make_engine(**{"num_pages": 40, "max_seqs": 6, **kwargs})


def _ids(outputs):
    return {o.request_id: [c.output_ids for c in o.outputs] for o in outputs}


class OracleProposer:
    """Proposes the target's own greedy continuation (every proposal accepted)."""

    def propose(self, token_ids, k):
        return greedy_reference(shared_step().params, list(token_ids), k)


class WrongProposer:
    """Proposes ``k`` copies of a token the target never picks next (every proposal rejected)."""

    def propose(self, token_ids, k):
        nxt = greedy_reference(shared_step().params, list(token_ids), 1)[0]
        return [(nxt + 1) % VOCAB] * k


class PrefixProposer:
    """The target's next ``good`` tokens, then wrong ones: rejects at position ``good``."""

    def __init__(self, good):
        self.good = good

    def propose(self, token_ids, k):
        right = greedy_reference(shared_step().params, list(token_ids), k)
        return right[: self.good] + [(t + 1) % VOCAB for t in right[self.good:]]


# ------------------------------------------------------------ greedy equality


@pytest.mark.parametrize("case", [
    dict(),
    dict(overlap=False),
    dict(prefix_caching=False),
    dict(preemption_mode="swap"),
    dict(budget=12),  # proposals cut by the token budget
    dict(reservation="oracle"),
], ids=["default", "sync", "no-prefix-cache", "swap", "small-budget", "orca-oracle"])
def test_greedy_outputs_equal_without_speculation(case):
    reqs = lambda: _repetitive_requests(10)  # noqa: E731
    base = _engine(**case)
    spec = _engine(speculative=NGRAM, **case)
    want, got = _ids(base.run(reqs())), _ids(spec.run(reqs()))
    assert got == want
    st = spec.stats
    assert st.spec_proposed > 10 and 0 < st.spec_accepted < st.spec_proposed
    assert st.spec_accepted == sum(st.spec_accepted_by_position)
    assert st.spec_proposed == sum(st.spec_proposed_by_position)
    assert 1 < st.mean_accepted_length < 1 + NGRAM.num_speculative_tokens
    if not {"budget", "reservation"} & set(case):  # the pool is small: both runs preempt (by recompute, or swap)
        assert st.preemptions > 0
    assert check_accounting(spec)["used"] == 0


def test_greedy_equality_with_parallel_samples_stop_tokens_and_streaming():
    stop = [7, 11]
    reqs = lambda: _repetitive_requests(  # noqa: E731
        10, seed=3, sampling=lambda i: SamplingParams(n=2 if i % 3 == 0 else 1,
                                                      output_kind="delta" if i % 2 else "final"))
    outs = {}
    for name, cfg in (("base", {}), ("spec", {"speculative": NGRAM})):
        engine = _engine(stop_ids=stop, **cfg)
        for r in reqs():
            engine.add_request(r)
        got: dict = {}
        while engine.has_unfinished():
            for o in engine.step():
                for c in o.outputs:  # deltas (odd requests) are appended, finals replace
                    key = (o.request_id, c.index)
                    got[key] = got.get(key, []) + c.output_ids if o.request_id % 2 else c.output_ids
        outs[name] = got
        if name == "spec":
            assert engine.stats.spec_accepted > 0
    assert outs["spec"] == outs["base"]


def test_outputs_match_the_float64_oracle_with_every_proposal_accepted():
    reqs = toy_requests(6, seed=2, max_new=(8, 20))
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=3, proposer=OracleProposer()))
    outs = {o.request_id: o for o in engine.run(reqs)}
    for r in reqs:
        assert outs[r.request_id].outputs[0].output_ids == greedy_reference(
            shared_step().params, r.prompt_ids, r.max_new_tokens)
    st = engine.stats
    assert st.spec_accepted == st.spec_proposed > 0  # the oracle is never wrong
    out = outs[0].outputs[0]
    assert out.num_accepted_tokens == out.num_proposed_tokens > 0


def test_beam_search_and_logprobs_requests_do_not_speculate():
    reqs = lambda: [  # noqa: E731
        Request(request_id=0, prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=8,
                sampling=SamplingParams(beam_width=2)),
        Request(request_id=1, prompt_ids=[4, 5, 4, 5, 4, 5], max_new_tokens=8, sampling=SamplingParams(logprobs=2)),
    ]
    base, spec = _engine(), _engine(speculative=NGRAM)
    want, got = base.run(reqs()), spec.run(reqs())
    assert _ids(got) == _ids(want)
    assert spec.stats.spec_proposed == 0
    assert [o.outputs[0].logprobs for o in got if o.request_id == 1] == \
        [o.outputs[0].logprobs for o in want if o.request_id == 1]


def test_speculation_waits_while_the_batch_is_large():
    reqs = lambda: _repetitive_requests(6)  # noqa: E731
    never = _engine(speculative=SpeculativeConfig.ngram(3, 1, 3, disable_by_batch_size=1))
    assert _ids(never.run(reqs())) == _ids(_engine().run(reqs())) and never.stats.spec_proposed == 0
    capped = _engine(speculative=SpeculativeConfig.ngram(3, 1, 3, disable_by_batch_size=3))
    always = _engine(speculative=SpeculativeConfig.ngram(3, 1, 3))
    capped.run(reqs())
    always.run(reqs())
    assert 0 < capped.stats.spec_proposed < always.stats.spec_proposed


def test_a_call_with_proposals_is_read_at_once_when_an_admission_fills_the_batch():
    """A request arriving while one sequence decodes: that one proposes (one running, under the cap
    of 2), then the admission lifts the batch to the cap; the call is still read before the next
    (its proposals decide the next call's tokens), and the calls after it stay in flight."""
    spec = SpeculativeConfig(num_speculative_tokens=3, proposer=WrongProposer(), disable_by_batch_size=2)
    engine = _engine(speculative=spec)
    pending, outs = toy_requests(5, seed=6, max_new=(6, 14)), []
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(pending.pop(0))
        outs += [o for o in engine.step() if o.finished]
    assert engine.stats.spec_proposed > 0 and engine.stats.spec_accepted == 0
    assert _ids(outs) == _ids(_engine().run(toy_requests(5, seed=6, max_new=(6, 14))))
    assert check_accounting(engine)["used"] == 0


# ------------------------------------------------------------ pages


def _one_sequence(proposer, k, prompt_len=6):
    """An engine running one greedy request of ``prompt_len`` tokens with
    ``proposer``, stepped through its prefill; returns (engine, sequence)."""
    engine = _engine(overlap=False, prefix_caching=False,
                         speculative=SpeculativeConfig(num_speculative_tokens=k, proposer=proposer))
    engine.add_request(Request(request_id=0, prompt_ids=list(range(1, prompt_len + 1)), max_new_tokens=30))
    engine.step()  # the prefill samples the first token: proposals start next call
    (seq,) = engine.running
    assert seq.num_computed == prompt_len and len(seq.tokens) == prompt_len + 1
    return engine, seq


def test_a_step_that_rejects_everything_gives_back_the_lookahead_pages():
    engine, seq = _one_sequence(WrongProposer(), k=6)
    pool = engine.kv_manager.pool
    assert pool.pages(seq.slot) == [1, 2]  # 6 prompt tokens in pages of 4
    engine.step()  # computes the last token and 6 proposals: 13 tokens, pages 3 and 4 taken, then rolled back
    assert engine.stats.spec_proposed == 6 and engine.stats.spec_accepted == 0
    assert seq.num_computed == 7 and len(seq.tokens) == 8
    assert pool.pages(seq.slot) == [1, 2] and int(pool.seq_lens[seq.slot]) == 7
    assert pool.free_pages()[-2:] == [4, 3]  # back at the queue's tail, tail first
    engine.kv_manager.pool.check(engine.kv_manager.state)  # the device did the same


def test_a_step_that_accepts_everything_keeps_its_pages():
    engine, seq = _one_sequence(OracleProposer(), k=6)
    pool = engine.kv_manager.pool
    engine.step()
    assert engine.stats.spec_accepted == 6
    assert seq.num_computed == 13 and len(seq.tokens) == 14  # 6 accepted and the bonus
    assert pool.pages(seq.slot) == [1, 2, 3, 4]
    engine.kv_manager.pool.check(engine.kv_manager.state)


def test_a_rejection_across_a_page_boundary_frees_only_the_pages_past_it():
    engine, seq = _one_sequence(PrefixProposer(good=2), k=6)
    pool = engine.kv_manager.pool
    engine.step()  # positions 6..12 computed (pages 2, 3, 4); two accepted: 9 tokens keep page 3, page 4 back
    assert engine.stats.spec_accepted == 2
    assert seq.num_computed == 9 and pool.pages(seq.slot) == [1, 2, 3]
    assert pool.free_pages()[-1] == 4
    engine.kv_manager.pool.check(engine.kv_manager.state)
    out = engine.run([])
    assert out[0].outputs[0].output_ids == greedy_reference(shared_step().params, list(range(1, 7)), 30)


def test_nothing_rejected_is_ever_a_prefix_cache_hit():
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]  # two full pages
    engine = _engine(overlap=False, speculative=SpeculativeConfig(num_speculative_tokens=6,
                                                                      proposer=WrongProposer()))
    (first,) = engine.run([Request(request_id="a", prompt_ids=prompt, max_new_tokens=12)])
    assert engine.stats.spec_proposed > 0 and engine.stats.spec_accepted == 0
    out = first.outputs[0].output_ids
    # A prompt that continues with the rejected proposals shares only the accepted tokens' full pages.
    wrong = WrongProposer().propose(prompt + out[:1], 6)
    second = prompt + out[:1] + wrong
    (hit,) = engine.run([Request(request_id="b", prompt_ids=second, max_new_tokens=1)])
    common = next(i for i, (x, y) in enumerate(zip(prompt + out, second)) if x != y)
    assert hit.num_cached_tokens == common // PAGE * PAGE == 2 * PAGE


def test_every_page_comes_back_after_a_soak_with_aborts():
    rng = np.random.default_rng(5)
    engine = _engine(speculative=NGRAM)
    reqs = _repetitive_requests(24, seed=5, max_new=(5, 30))
    pending = list(reqs)
    live = set()
    while pending or engine.has_unfinished():
        while pending and len(live) < 8:
            r = pending.pop()
            engine.add_request(r)
            live.add(r.request_id)
        for o in engine.step():
            if o.finished:
                live.discard(o.request_id)
        if live and rng.random() < 0.15:
            victim = sorted(live)[int(rng.integers(len(live)))]
            engine.abort(victim)
            live.discard(victim)
    assert engine.stats.spec_accepted > 0 and engine.stats.aborted > 0
    acc = check_accounting(engine)
    assert acc["used"] == 0 and engine.kv_manager.pool.num_free == acc["total"]


# ------------------------------------------------------------ sampling

V_TOY, N_DRAWS = 6, 40_000
CHI2_DF5_P1E6 = 35.9  # chi-square, 5 degrees of freedom, p = 1e-6


def _verified_tokens(logits_row, proposal, temperature, top_p, fn=None):
    """N_DRAWS independent verifications of ``proposal`` against one logits
    row: the token each emits (the proposal when accepted, else the row's
    own draw)."""
    fn = fn or sampling_mod.verify_proposals
    B = N_DRAWS
    accept, token = fn(jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (B, V_TOY)),
                       jnp.full((B,), proposal, jnp.int32), jnp.full((B,), temperature, jnp.float32),
                       jnp.full((B,), top_p, jnp.float32), jnp.full((B,), 7, jnp.uint32),
                       jnp.zeros((B,), jnp.int32), jnp.arange(B, dtype=jnp.int32))
    return np.where(np.asarray(accept), proposal, np.asarray(token))


def _target(logits_row, temperature, top_p):
    """The float64 distribution ``sample`` draws from: softmax(logits / T) on the nucleus."""
    z = np.asarray(logits_row, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    keep[order[np.concatenate([[0], np.flatnonzero(np.cumsum(p[order]) < top_p) + 1])]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_p,proposal", [(1.0, 1.0, 2), (0.7, 1.0, 0), (1.3, 0.8, 4)])
def test_verification_emits_the_target_distribution(temperature, top_p, proposal):
    logits = np.array([1.2, -0.3, 0.8, 0.1, 1.9, -1.0])
    p = _target(logits, temperature, top_p)
    tokens = _verified_tokens(logits, proposal, temperature, top_p)
    counts = np.bincount(tokens, minlength=V_TOY)
    support = p > 0
    assert counts[~support].sum() == 0  # nothing outside the nucleus
    assert _chi2(counts[support], p[support]) < CHI2_DF5_P1E6


def test_the_chi_square_test_catches_verification_that_skips_the_ratio(monkeypatch):
    """The mutant accepts every proposal: the emitted token is always the
    proposal, and the same check must fail."""
    logits = np.array([1.2, -0.3, 0.8, 0.1, 1.9, -1.0])
    p = _target(logits, 1.0, 1.0)
    real = sampling_mod.verify_proposals

    def mutant(*args):
        accept, token = real(*args)
        return jnp.ones_like(accept), token

    tokens = _verified_tokens(logits, 2, 1.0, 1.0, fn=mutant)
    assert _chi2(np.bincount(tokens, minlength=V_TOY), p) > CHI2_DF5_P1E6


def _chi2(counts, probs):
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_runs_with_speculation_reproduce_their_seeds():
    sampling = lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=i, n=2 if i == 1 else 1)  # noqa: E731
    runs = [_ids(_engine(speculative=NGRAM).run(_repetitive_requests(4, seed=4, sampling=sampling)))
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = _ids(_engine(speculative=NGRAM).run(_repetitive_requests(
        4, seed=4, sampling=lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=i + 100, n=2 if i == 1 else 1))))
    assert other != runs[0]


# ------------------------------------------------------------ bad inputs


def test_bad_speculative_settings_are_refused_by_name():
    for kwargs, needle in (({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                           ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
                           ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
                           ({"proposer": "ngram"}, "proposer"),
                           ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
                           ({"proposer": NgramProposer}, "proposer"),  # the class, not a proposer
                           ({"proposer": type("P", (), {"propose": 5})()}, "proposer")):
        with pytest.raises(ValueError, match=needle):
            SpeculativeConfig(**kwargs)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="ngram")
    with pytest.raises(ValueError, match="min_n"):
        SpeculativeConfig.ngram(4, 0, 3)


class _Named:
    """A proposer whose ``propose`` is ``fn`` and whose repr is ``name``."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def propose(self, token_ids, k):
        return self.fn(token_ids, k)

    def __repr__(self):
        return self.name


def _step_until_refused(proposer, error, match):
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=4, proposer=proposer))
    engine.add_request(Request(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=8))
    with pytest.raises(error, match=match):
        while engine.has_unfinished():
            engine.step()


def test_a_proposer_that_raises_or_edits_the_tokens_is_named():
    def edit(token_ids, k):
        token_ids.append(5)  # the engine hands a copy it cannot change
        return []

    _step_until_refused(_Named("Editing()", edit), RuntimeError,
                        r"proposer Editing\(\) raised AttributeError.*request 'r'")


@pytest.mark.parametrize("returned", [[VOCAB], [-1], [1.5], "12", [1, 2, 3, 4, 5, 6]],
                         ids=["past-vocab", "negative", "float", "str", "too-many"])
def test_a_proposer_returning_garbage_is_named(returned):
    _step_until_refused(_Named("Bad()", lambda token_ids, k: returned), ValueError,
                        r"proposer Bad\(\) returned .*request 'r'")

