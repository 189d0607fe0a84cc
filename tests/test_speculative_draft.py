"""Speculative decoding with a draft model (its own engine and pool) and with
the decoder's own first layers (early exit).

Greedy outputs equal those without speculation (prefix caching, preemption
by recompute and swap, parallel samples); a draft that is the target itself
is always accepted; the early-exit draft's K/V equal the target's first
layers' and its weights follow ``update_weights``; bad drafts are refused by
name.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import VOCAB, ToyModel, check_accounting, greedy_reference, make_engine, shared_step
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama
from models.ragged import RaggedModel
from paged_jax.engine import Engine, EngineConfig, Request, SamplingParams
from paged_jax.engine.speculation import DraftModelProposer
from paged_jax.speculative.config import DraftModel, SpeculativeConfig, add_speculative_flags, speculative_from_args


def _near_draft(noise=0.25, seed=7):
    """The toy target's weights plus noise: a draft that agrees with it often, not always."""
    rng = np.random.default_rng(seed)
    params = {k: v + noise * jnp.asarray(rng.normal(size=v.shape), v.dtype) for k, v in shared_step().params.items()}
    return ToyModel(params)


DRAFT = _near_draft()


def _requests(n, seed=0, sampling=None):
    rng = np.random.default_rng(seed)
    return [Request(request_id=i, prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(2, 30))).tolist(),
                    max_new_tokens=int(rng.integers(6, 30)),
                    sampling=sampling(i) if sampling else SamplingParams()) for i in range(n)]


def _ids(outputs):
    return {o.request_id: [c.output_ids for c in o.outputs] for o in outputs}


def _engine(**kwargs):
    return make_engine(**{"num_pages": 40, "max_seqs": 6, **kwargs})


@pytest.mark.parametrize("case", [
    dict(),
    # ~30 s; the default case preempts by recompute through the same rollback, test_speculative_engine swaps
    pytest.param(dict(preemption_mode="swap"), marks=pytest.mark.slow),
    dict(prefix_caching=False, overlap=False),
], ids=["default", "swap", "no-prefix-cache-sync"])
def test_draft_model_greedy_outputs_equal_without_speculation(case):
    swap = case.get("preemption_mode") == "swap"
    spec = SpeculativeConfig.draft(3, model=DRAFT, page_size=2 if swap else None)  # the draft's own page size
    base, engine = _engine(**case), _engine(speculative=spec, **case)
    assert _ids(engine.run(_requests(10))) == _ids(base.run(_requests(10)))
    st = engine.stats
    assert st.spec_proposed > 20 and 0 < st.spec_accepted < st.spec_proposed
    assert st.preemptions > 0  # 40 pages: both runs preempt
    assert check_accounting(engine)["used"] == 0
    proposer = engine.speculator.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.rounds > 0
    draft_pages = proposer.engine.accounting()
    assert draft_pages["used"] == 0 and draft_pages["cached"] > 0  # every round's pages back, full ones cached
    assert proposer.engine.stats.prefix_hit_tokens > 0  # later rounds reuse the draft's K/V
    engine.reset_prefix_cache()
    assert proposer.engine.accounting()["cached"] == 0


def test_a_draft_that_is_the_target_is_always_accepted():
    reqs = _requests(6, seed=2)
    engine = _engine(speculative=SpeculativeConfig.draft(4, model=shared_step()))
    outs = {o.request_id: o for o in engine.run(reqs)}
    for r in reqs:
        assert outs[r.request_id].outputs[0].output_ids == greedy_reference(
            shared_step().params, r.prompt_ids, r.max_new_tokens)
    assert engine.stats.spec_accepted == engine.stats.spec_proposed > 0


@pytest.mark.slow  # 30 s of compiles; test_speculative_engine.py checks the verification rule (chi-square)
def test_sampled_parallel_requests_with_a_draft_reproduce_their_seeds():
    sampling = lambda i: SamplingParams(temperature=0.9, top_p=0.9, seed=i, n=2 if i % 2 else 1)  # noqa: E731
    runs = [_ids(_engine(speculative=SpeculativeConfig.draft(3, model=DRAFT)).run(_requests(6, 5, sampling)))
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(c) == (2 if i % 2 else 1) for i, c in runs[0].items())


# ------------------------------------------------------------ early exit

TINY = LlamaConfig(vocab_size=61, model_dim=32, mlp_dim=48, num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8,
                   max_seq_len=128)


def _tiny(seed=0):
    return RaggedModel(Llama(TINY, rngs=nnx.Rngs(seed)))


def _tiny_engine(model, **config):
    return Engine(model, model.make_kv_pool(48, 4), EngineConfig(max_seqs=4, max_seq_len=96,
                                                                max_num_batched_tokens=32, **config))


def test_the_early_exit_draft_is_the_first_layers_and_writes_their_kv():
    target = _tiny()
    draft = target.early_exit(2)
    assert draft.config.num_layers == 2 and draft.vocab_size == target.vocab_size
    full, cut = jax.tree.leaves(target.params), jax.tree.leaves(draft.params)
    assert len(full) == len(cut)
    for a, b in zip(full, cut):
        assert b.shape == a.shape or (b.shape[0] == 2 and a.shape[0] == 3)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a[:b.shape[0]]))
    # The same prompt in both engines (greedy, one token): the draft's pool holds the target's first two layers' K/V.
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9]
    kvs = []
    for model in (target, draft):
        engine = _tiny_engine(model, enable_prefix_caching=False)
        engine.run([Request(request_id=0, prompt_ids=prompt, max_new_tokens=1)])
        kvs.append(engine.kv)
    pages = slice(1, 4)  # the first pages handed out hold the prompt in both
    np.testing.assert_allclose(np.asarray(kvs[1].k[:, :, pages]), np.asarray(kvs[0].k[:2, :, pages]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kvs[1].v[:, :, pages]), np.asarray(kvs[0].v[:2, :, pages]), atol=1e-5)


def test_an_early_exit_draft_keeps_greedy_outputs_and_follows_new_weights():
    target = _tiny()
    reqs = lambda: [Request(request_id=i, prompt_ids=[(7 * i + j) % 61 for j in range(5 + 3 * i)],  # noqa: E731
                            max_new_tokens=12) for i in range(4)]
    base = _tiny_engine(target)
    engine = _tiny_engine(target, speculative=SpeculativeConfig.draft(3, num_layers=2))
    assert _ids(engine.run(reqs())) == _ids(base.run(reqs()))
    assert engine.stats.spec_proposed > 0
    new = _tiny(seed=1).params
    engine.update_weights(new)
    base.update_weights(new)
    drafted = engine.speculator.proposer.engine.params
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(drafted)[0]),
                                  np.asarray(jax.tree.leaves(target.early_exit(2, new).params)[0]))
    assert _ids(engine.run(reqs())) == _ids(base.run(reqs()))


# ------------------------------------------------------------ bad inputs


def test_bad_drafts_are_refused_by_name():
    with pytest.raises(ValueError, match="one of model"):
        DraftModel()
    with pytest.raises(ValueError, match="one of model"):
        DraftModel(model=DRAFT, num_layers=2)
    with pytest.raises(ValueError, match="num_layers"):
        DraftModel(num_layers=0)
    with pytest.raises(ValueError, match="kv_tokens"):
        DraftModel(num_layers=1, kv_tokens=-4)
    with pytest.raises(ValueError, match="page_size"):
        DraftModel(num_layers=1, page_size=0)
    with pytest.raises(ValueError, match="make_kv_pool"):
        DraftModel(model=object())
    with pytest.raises(ValueError, match="early_exit"):  # the toy model has no layers to cut
        _engine(speculative=SpeculativeConfig.draft(2, num_layers=1))
    with pytest.raises(ValueError, match="num_layers must be an int in"):
        _tiny_engine(_tiny(), speculative=SpeculativeConfig.draft(2, num_layers=3))
    with pytest.raises(ValueError, match="vocabulary"):
        _tiny_engine(_tiny(), speculative=SpeculativeConfig.draft(2, model=DRAFT))
    with pytest.raises(ValueError, match="kv_tokens=8"):
        _engine(speculative=SpeculativeConfig.draft(2, model=DRAFT, kv_tokens=8))
    with pytest.raises(ValueError, match="num_layers"):
        _tiny().early_exit(0)


@pytest.mark.parametrize("argv, want", [
    (["--speculative", "early-exit", "--draft-layers", "5"], 5),
    (["--speculative", "none", "--draft-layers", "5"], None),
])
def test_the_early_exit_flags(argv, want):
    p = argparse.ArgumentParser()
    add_speculative_flags(p)
    config = speculative_from_args(p, p.parse_args(argv))
    assert (config.proposer.num_layers if config else None) == want


def test_a_bad_draft_layers_flag_is_named(capsys):
    p = argparse.ArgumentParser()
    add_speculative_flags(p)
    with pytest.raises(SystemExit):
        speculative_from_args(p, p.parse_args(["--speculative", "early-exit", "--draft-layers", "0"]))
    assert "--draft-layers: num_layers must be an int >= 1" in capsys.readouterr().err


class _BatchOfWrongLength:
    def propose(self, token_ids, k):
        return []

    def propose_batch(self, token_ids, ks):
        return [[]] * (len(token_ids) + 1)


def test_a_batch_proposer_returning_the_wrong_number_of_lists_is_named():
    engine = _engine(speculative=SpeculativeConfig(num_speculative_tokens=2, proposer=_BatchOfWrongLength()))
    engine.add_request(Request(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=6))
    with pytest.raises(ValueError, match="from propose_batch: expected a list of 1 proposal lists"):
        while engine.has_unfinished():
            engine.step()


@pytest.mark.slow  # ~35 s; test_an_early_exit_draft_keeps_greedy_outputs_and_follows_new_weights covers the draft
def test_a_hybrid_targets_early_exit_pool_holds_its_share_of_the_bytes():
    # Sliding and full layers (Gemma 2's alternation): the target's pool holds a table per layer group; its first
    # three layers have a group more. The draft's pool holds as many tokens per group as the target's, so its
    # bytes are the layers' share, and greedy outputs stay those without speculation.
    config = LlamaConfig(vocab_size=61, model_dim=32, mlp_dim=48, num_layers=4, num_q_heads=4, num_kv_heads=2,
                         head_dim=8, max_seq_len=128, sliding_window=8,
                         layer_types=("sliding_attention", "full_attention") * 2)
    target = RaggedModel(Llama(config, rngs=nnx.Rngs(0)))
    make = lambda **c: Engine(target, target.make_budget_kv_pool(25, 4), EngineConfig(  # noqa: E731
        max_seqs=4, max_seq_len=48, max_num_batched_tokens=32, **c))
    reqs = lambda: [Request(request_id=i, prompt_ids=[(5 * i + j) % 61 for j in range(6 + 4 * i)],  # noqa: E731
                            max_new_tokens=10) for i in range(3)]
    engine = make(speculative=SpeculativeConfig.draft(3, num_layers=3))
    assert _ids(engine.run(reqs())) == _ids(make().run(reqs()))
    nbytes = lambda kv: kv.k.nbytes + kv.v.nbytes  # noqa: E731
    assert nbytes(engine.speculator.proposer.engine.kv) / nbytes(engine.kv) == pytest.approx(3 / 4, rel=0.05)


def test_an_engine_checking_prompts_against_fewer_ids_still_speculates():
    # vocab_size below the model's bounds prompt ids only: the target samples from its whole vocabulary, and so
    # may the draft.
    make = lambda spec=None: Engine(shared_step(), ToyModel.make_kv_pool(None, 100, 4), EngineConfig(  # noqa: E731
        max_seqs=4, max_seq_len=80, max_num_batched_tokens=64, speculative=spec), vocab_size=30)
    reqs = lambda: [Request(request_id=i, prompt_ids=[(3 * i + j) % 30 for j in range(6 + i)],  # noqa: E731
                            max_new_tokens=12) for i in range(3)]
    assert _ids(make(SpeculativeConfig.draft(3, model=shared_step())).run(reqs())) == _ids(make().run(reqs()))
