"""Streaming outputs, token times, stop strings, log-probabilities and new
weights, on the toy engine (tests/engine_helpers.py) with a word-level toy
tokenizer (token ``i`` reads ``w{i}``, words joined by spaces)."""

import dataclasses

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from paged_jax.engine.core import Engine, EngineConfig, Request, SamplingParams, num_traces
from tests.engine_helpers import (
    PAGE,
    VOCAB,
    dense_logits,
    greedy_reference,
    make_toy_step,
    shared_step,
    toy_params,
    toy_pool,
    toy_requests,
)


def toy_tokenizer():
    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))


def engine_with(model=None, tokenizer=True, overlap=True, num_pages=200, **config):
    return Engine(model or shared_step(), toy_pool(num_pages),
                  EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64, async_scheduling=overlap,
                               **config),
                  vocab_size=VOCAB, tokenizer=toy_tokenizer() if tokenizer else None, check_page_state=True)


def with_kind(requests, kind):
    return [Request(request_id=r.request_id, prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens,
                    sampling=SamplingParams(**{**r.sampling.__dict__, "output_kind": kind})) for r in requests]


def stream(engine, requests):
    """Every report per request id, in order."""
    for r in requests:
        engine.add_request(r)
    reports = {}
    while engine.has_unfinished():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    return reports


SAMPLINGS = {
    "greedy": lambda i: SamplingParams(),
    "sampled": lambda i: SamplingParams(temperature=1.0, top_p=0.9, seed=i),
    "n3": lambda i: SamplingParams(temperature=0.8, seed=i, n=3),
    "beams": lambda i: SamplingParams(beam_width=3),
}


@pytest.mark.parametrize("name,overlap", [("greedy", True)] + [
    pytest.param("sampled", True, marks=pytest.mark.slow), pytest.param("beams", True, marks=pytest.mark.slow),
    pytest.param("n3", True, marks=pytest.mark.slow), pytest.param("n3", False, marks=pytest.mark.slow)])
def test_deltas_concatenate_to_the_final_output(name, overlap):
    requests = toy_requests(6, seed=3, max_new=(3, 14), sampling=SAMPLINGS[name])
    final = {o.request_id: o for o in engine_with(overlap=overlap).run(requests)}
    deltas = stream(engine_with(overlap=overlap), with_kind(requests, "delta"))
    cumulative = stream(engine_with(overlap=overlap), with_kind(requests, "cumulative"))
    for rid, want in final.items():
        assert [o.finished for o in deltas[rid]] == [False] * (len(deltas[rid]) - 1) + [True]
        assert cumulative[rid][-1].finished
        assert untimed(cumulative[rid][-1].outputs) == untimed(want.outputs)
        if name != "beams":  # beams report once, when finished
            assert len(deltas[rid]) > 1 or want.outputs[0].output_ids.__len__() == 1
        for c in want.outputs:
            parts = [p for o in deltas[rid] for p in o.outputs if p.index == c.index]
            assert sum((p.output_ids for p in parts), []) == c.output_ids
            assert "".join(p.text for p in parts) == c.text
            assert len(sum((p.token_times for p in parts), [])) == len(c.output_ids)
            assert [p.finish_reason for p in parts][-1] == c.finish_reason
            assert all(p.finish_reason is None for p in parts[:-1])
            assert c.text == text_after(want.prompt_ids, c.output_ids)


def untimed(outputs):
    return [dataclasses.replace(c, token_times=len(c.token_times)) for c in outputs]


def text_after(prompt, output_ids):
    """The output's text as vLLM defines it: the whole sequence's text
    after the prompt's (the toy tokenizer joins words with spaces)."""
    tok = toy_tokenizer()
    return tok.decode(prompt + output_ids)[len(tok.decode(prompt)):]


def test_token_times_are_ordered():
    engine = engine_with()
    outs = engine.run(toy_requests(8, seed=1, sampling=SAMPLINGS["n3"]))
    for o in outs:
        assert 0 <= o.arrival_s <= o.first_token_s <= o.finish_s <= engine.clock()
        for c in o.outputs:
            assert len(c.token_times) == len(c.output_ids)
            assert c.token_times == sorted(c.token_times)
            assert o.first_token_s <= c.token_times[0] and c.token_times[-1] <= o.finish_s


def texts_of(out):
    return [c.text for c in out.outputs]


@pytest.mark.parametrize("overlap", [True, False])
def test_stop_strings(overlap):
    prompt = [3, 9, 27, 4, 11]
    ref = greedy_reference(toy_params(), prompt, 20)
    text = text_after(prompt, ref)
    words = text.split()
    cases = {
        "inside a token": words[4][:2],  # "w1" of "w17": the token's text goes on past it
        "over two tokens": words[5][1:] + " " + words[6][:2],
        "at the first token": words[0],
    }
    for what, stop in cases.items():
        first = text.index(stop)
        engine = engine_with(overlap=overlap)
        [out] = engine.run([Request(request_id=what, prompt_ids=prompt, max_new_tokens=20,
                                    sampling=SamplingParams(stop=[stop, "never there"]))])
        c = out.outputs[0]
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:first]), what
        # The output ends at the token that completed the stop string; none after it.
        n = next(i for i in range(1, 21) if stop in text_after(prompt, ref[:i]))
        assert c.output_ids == ref[:n], what
    [out] = engine_with(overlap=overlap).run(
        [Request(request_id="never", prompt_ids=prompt, max_new_tokens=20, sampling=SamplingParams(stop="zz"))])
    assert (out.outputs[0].output_ids, out.outputs[0].finish_reason, out.outputs[0].text) == (ref, "length", text)


def test_deltas_never_emit_part_of_a_stop_string():
    prompt = [3, 9, 27, 4, 11]
    text = text_after(prompt, greedy_reference(toy_params(), prompt, 20))
    stop = text.split()[8] + " w"
    reports = stream(engine_with(), [Request(request_id=0, prompt_ids=prompt, max_new_tokens=20,
                                             sampling=SamplingParams(stop=stop, output_kind="delta"))])[0]
    streamed = "".join(o.outputs[0].text for o in reports)
    assert streamed == text[: text.index(stop)]
    for k in range(len(reports)):
        assert stop[:2] not in "".join(o.outputs[0].text for o in reports[:k]) or k == len(reports)


def test_stop_strings_need_a_tokenizer():
    engine = engine_with(tokenizer=False)
    with pytest.raises(ValueError, match="need an engine built with a tokenizer"):
        engine.add_request(Request(request_id=0, prompt_ids=[1, 2], max_new_tokens=3, sampling=SamplingParams(stop="x")))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="tokenizer"):
        engine_with(tokenizer=False).__class__(shared_step(), toy_pool(50), EngineConfig(max_seq_len=80),
                                               tokenizer=object())


def log_softmax64(logits):
    z = logits - logits.max()
    return z - np.log(np.exp(z).sum())


@pytest.mark.parametrize("k,temperature", [(5, 0.0), (0, 0.7), pytest.param(0, 0.0, marks=pytest.mark.slow),
                                           pytest.param(5, 0.7, marks=pytest.mark.slow)])
def test_logprobs_equal_a_float64_log_softmax(k, temperature):
    params = toy_params()
    requests = toy_requests(5, seed=4, max_new=(2, 9), prompt_len=(1, 20),
                            sampling=lambda i: SamplingParams(temperature=temperature, seed=i, logprobs=k,
                                                              n=2 if i == 0 else 1))
    for out in engine_with().run(requests):
        for c in out.outputs:
            assert len(c.logprobs) == len(c.output_ids)
            total = 0.0
            for i, (tok, lps) in enumerate(zip(c.output_ids, c.logprobs)):
                want = log_softmax64(dense_logits(params, out.prompt_ids + c.output_ids[:i]))
                top = np.argsort(-want, kind="stable")[:k]
                assert set(lps) == set(top.tolist()) | {tok}
                for t, lp in lps.items():
                    assert lp == pytest.approx(want[t], rel=2e-5, abs=1e-4)  # f32 logits of magnitude ~30
                total += want[tok]
            assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_no_logprobs_unless_asked():
    [out] = engine_with().run(toy_requests(1, seed=2))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_update_weights_serves_the_new_model_without_recompiling():
    model = make_toy_step(toy_params(0))
    engine = engine_with(model=model)
    prompt = list(range(3, 3 + 4 * PAGE + 1))
    req = lambda rid: Request(request_id=rid, prompt_ids=prompt, max_new_tokens=6)  # noqa: E731
    [first] = engine.run([req("a")])
    assert first.output_ids == greedy_reference(toy_params(0), prompt, 6)
    [again] = engine.run([req("b")])
    assert again.num_cached_tokens == 4 * PAGE  # the prefix cache hits while the weights are the same
    traces = num_traces(model)
    engine.update_weights(toy_params(1))
    [after] = engine.run([req("c")])
    assert after.num_cached_tokens == 0  # no K/V of the old weights is hit
    assert after.output_ids == greedy_reference(toy_params(1), prompt, 6)
    assert num_traces(model) == traces  # same shapes: no new program


def test_update_weights_refuses_and_leaves_the_engine_as_it_was():
    engine = engine_with()
    bad_shape = {**toy_params(1), "wq": toy_params(1)["wq"][:, :4]}
    with pytest.raises(ValueError, match=r"params\['wq'\]: shape"):
        engine.update_weights(bad_shape)
    with pytest.raises(ValueError, match=r"params\['wo'\] is missing"):
        engine.update_weights({k: v for k, v in toy_params(1).items() if k != "wo"})
    with pytest.raises(ValueError, match=r"params\['extra'\] is not in the model's params"):
        engine.update_weights({**toy_params(1), "extra": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"params\['wv'\]: holds NaN or inf"):
        engine.update_weights({**toy_params(1), "wv": toy_params(1)["wv"].at[0, 0].set(np.nan)})
    with pytest.raises(ValueError, match=r"params\['emb'\].*dtype"):
        engine.update_weights({**toy_params(1), "emb": toy_params(1)["emb"].astype(np.float16)})
    engine.add_request(Request(request_id=0, prompt_ids=[1, 2, 3], max_new_tokens=4))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.update_weights(toy_params(1))
    [out] = engine.run()
    assert out.output_ids == greedy_reference(toy_params(0), [1, 2, 3], 4)


def test_requests_arriving_while_others_run_match_the_offline_engine():
    requests = toy_requests(10, seed=7, max_new=(4, 20))
    offline = {o.request_id: o.output_ids for o in engine_with().run(requests)}
    engine = engine_with()
    pending = list(requests)
    online = {}
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            online[o.request_id] = o.output_ids
    assert online == offline


def test_run_refuses_delta_requests():
    engine = engine_with()
    [r] = with_kind(toy_requests(1), "delta")
    with pytest.raises(ValueError, match="output_kind='delta' streams through step"):
        engine.run([r])
    assert not engine.has_unfinished()


def test_update_weights_after_an_abort_reads_the_call_in_flight():
    engine = engine_with(model=make_toy_step(toy_params(0)))
    engine.add_request(Request(request_id="a", prompt_ids=[1, 2, 3], max_new_tokens=8))
    engine.step()
    engine.abort("a")
    engine.update_weights(toy_params(1))  # no request left: the aborted one's call in flight is read and dropped
    [out] = engine.run([Request(request_id="b", prompt_ids=[1, 2, 3], max_new_tokens=4)])
    assert out.output_ids == greedy_reference(toy_params(1), [1, 2, 3], 4)
