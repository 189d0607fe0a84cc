"""A non-finite value in the forward is never served as tokens.

Attention must carry NaN (and inf) from a logit or value a row sees into
that row's output, in every implementation the engine serves with; only rows
that see no key (padding, empty sequences) are zeros, and NaN in a slot no
row may see changes nothing. End to end: one NaN entry in a weight of the
real decoder, or in the embedding row of a prompt token, stops the engine
with ``FloatingPointError`` naming the requests it reached.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.llama import Llama, LlamaConfig
from models.ragged import RaggedModel
from paged_jax.attention.batch import RaggedBatch, Tiling, batch_shape
from paged_jax.attention.ragged import attend
from paged_jax.engine.core import Engine, EngineConfig, Request

PAGE = 4
IMPLS = ["xla", "xla_loop", "pallas_gpu", "pallas_tpu", "pallas_ragged"]
"""Every implementation ``attend`` serves with: the XLA work list (``xla``,
and ``xla_loop``, whose CPU decode loop serves only padded batches) and the
flat Pallas kernels (``pallas_gpu`` and ``pallas_ragged``: the Triton
kernel; ``pallas_tpu``: the Mosaic kernel; interpret mode here)."""

# Row 0 decodes (6 cached tokens), row 1 brings a 5-token chunk (9 cached,
# queries at positions 4..8), row 2 is empty. Flat rows: 0 is row 0's query,
# 1..5 row 1's, 6..7 padding.
Q_LENS, KV_LENS = np.array([1, 5, 0], np.int32), np.array([6, 9, 0], np.int32)
BLOCK_TABLES = np.array([[3, 5, 0, 0], [2, 6, 1, 0], [0, 0, 0, 0]], np.int32)  # page 0: the null page
NUM_PAGES, KV_HEADS, GROUP, HEAD_DIM = 8, 1, 2, 8


def slot(row: int, pos: int) -> tuple[int, int]:
    """(page, offset) of sequence row ``row``'s token at ``pos``."""
    return int(BLOCK_TABLES[row, pos // PAGE]), pos % PAGE


def make_case(seed=0, unowned=np.nan):
    """``(q [8, N, H], k, v [1, K, P, L, H])``: random values in owned slots,
    ``unowned`` in every other slot (the null page included)."""
    r = np.random.default_rng(seed)
    shape = (1, KV_HEADS, NUM_PAGES, PAGE, HEAD_DIM)
    k = np.full(shape, unowned, np.float32)
    v = np.full(shape, unowned, np.float32)
    for row, kv_len in enumerate(KV_LENS):
        for pos in range(kv_len):
            page, off = slot(row, pos)
            k[0, :, page, off] = r.normal(size=(KV_HEADS, HEAD_DIM))
            v[0, :, page, off] = r.normal(size=(KV_HEADS, HEAD_DIM))
    q = np.zeros((8, KV_HEADS * GROUP, HEAD_DIM), np.float32)
    q[:Q_LENS.sum()] = r.normal(size=(Q_LENS.sum(), KV_HEADS * GROUP, HEAD_DIM))
    return q, k, v


@functools.cache
def attention_fn(impl):
    shape = batch_shape(Q_LENS, num_seq_rows=3, tiling=Tiling(min_tokens=8, max_prefill_chunks=2))
    z = jnp.zeros(shape.num_tokens, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(BLOCK_TABLES),
                        q_starts=jnp.asarray([0, 1, 6], jnp.int32), q_lens=jnp.asarray(Q_LENS),
                        kv_lens=jnp.asarray(KV_LENS), logits_rows=jnp.zeros(1, jnp.int32), shape=shape)
    fn = jax.jit(functools.partial(attend, impl=impl))
    return lambda q, k, v: np.array(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0, batch))


def assert_rows(out, base, nan_rows):
    """Rows ``nan_rows`` are NaN throughout; every other row equals ``base``
    to the bit (and is finite); padding rows are zeros."""
    for t in range(out.shape[0]):
        if t in nan_rows:
            assert np.isnan(out[t]).all(), (t, out[t])
        else:
            assert np.isfinite(out[t]).all() and np.array_equal(out[t], base[t]), (t, out[t], base[t])
    assert (out[6:] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_a_seen_key_reaches_exactly_the_rows_that_see_it(impl):
    run = attention_fn(impl)
    q, k, v = make_case()
    base = run(q, k, v)
    page, off = slot(1, 6)
    k[0, 0, page, off, 3] = np.nan  # row 1's key at position 6: its queries at 6, 7, 8 see it; 4, 5 do not
    page, off = slot(0, 2)
    k[0, 0, page, off, 0] = np.nan  # row 0's key at position 2: its decode query sees it
    assert_rows(run(q, k, v), base, nan_rows={0, 3, 4, 5})


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_a_seen_value_reaches_the_row(impl):
    run = attention_fn(impl)
    q, k, v = make_case(1)
    base = run(q, k, v)
    page, off = slot(0, 1)
    v[0, 0, page, off, 5] = np.nan  # row 0's value at position 1, seen by its decode query
    out = run(q, k, v)
    assert np.isnan(out[0, :, 5]).all()  # every head of the group; the other head dims do not mix with dim 5
    out[0, :, 5] = base[0, :, 5]
    assert_rows(out, base, nan_rows=set())


def test_nan_in_a_value_after_a_row_stays_out_of_it():
    """Row 1's value at position 8 is seen by its query at 8 (flat row 5) only: the queries at 4-7 share its
    block but are masked from it, and 0 * NaN must not reach them (the engine's XLA path; the Pallas kernels
    zero values by ownership only, docs/limits.md)."""
    run = attention_fn("xla")
    q, k, v = make_case(2)
    base = run(q, k, v)
    page, off = slot(1, 8)
    v[0, 0, page, off, 5] = np.nan
    out = run(q, k, v)
    assert np.isnan(out[5, :, 5]).all()
    out[5, :, 5] = base[5, :, 5]
    assert_rows(out, base, nan_rows=set())


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_whose_every_logit_is_minus_inf_is_nan_not_zeros(impl):
    """A softmax over logits that are all -inf is undefined: the row sees
    keys, so its output must not pass for the zeros of a row that sees none."""
    run = attention_fn(impl)
    q, k, v = make_case(2)
    base = run(q, k, v)
    q[0] = 1.0
    for pos in range(KV_LENS[0]):
        page, off = slot(0, pos)
        k[0, 0, page, off] = -np.inf  # q . k = -inf for every key row 0 sees
    assert_rows(run(q, k, v), base, nan_rows={0})


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_unowned_slots_changes_nothing(impl):
    run = attention_fn(impl)
    q, k, v = make_case(3, unowned=np.nan)
    _, k0, v0 = make_case(3, unowned=0.0)
    assert_rows(run(q, k, v), run(q, k0, v0), nan_rows=set())


# ---------------------------------------------------------------------------
# End to end: the real decoder in the engine

TINY = dict(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=2, num_q_heads=3, num_kv_heads=1, head_dim=16,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False)
POISON_TOKEN = 7
"""The token whose embedding row is poisoned; only the "bad" prompt holds it."""


@functools.cache
def shared_model() -> RaggedModel:
    """One RaggedModel, so the engine's programs compile once; each case
    swaps in its own weights (``params`` is an argument of the program)."""
    return RaggedModel(Llama(LlamaConfig(**TINY), rngs=nnx.Rngs(0)))


def poison(name):
    """Weights with one NaN entry in ``name``'s tensor (layer 1 where the
    tensor is per layer)."""
    model = Llama(LlamaConfig(**TINY), rngs=nnx.Rngs(0))
    blocks = model.blocks
    param, index = {
        "k_proj": (blocks.attn.wk, (1, 3, 0, 5)),
        "v_proj": (blocks.attn.wv, (1, 3, 0, 5)),
        "q_proj": (blocks.attn.wq, (1, 3, 2, 5)),
        "mlp_up": (blocks.mlp.w_up, (1, 3, 7)),
        "embedding": (model.embed, (POISON_TOKEN, 4)),
    }[name]
    param.set_value(param[...].at[index].set(jnp.nan))
    return nnx.split(model)[1]


def serve(params):
    rm = shared_model()
    clean, rm.params = rm.params, params
    try:
        engine = Engine(rm, rm.config.make_kv_pool(40, PAGE),
                        EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16))
        requests = [Request(request_id="bad", prompt_ids=[POISON_TOKEN, 11, 12, 13, 14], max_new_tokens=4),
                    Request(request_id="good", prompt_ids=[21, 22, 23, 24, 25, 26], max_new_tokens=4)]
        return {o.request_id: o.output_ids for o in engine.run(requests)}
    finally:
        rm.params = clean


def test_clean_weights_serve_tokens():
    outs = serve(shared_model().params)
    assert sorted(outs) == ["bad", "good"] and all(len(ids) == 4 for ids in outs.values())


@pytest.mark.parametrize("name", ["k_proj", "v_proj", "q_proj", "mlp_up"])
def test_one_nan_weight_stops_the_engine_naming_the_requests(name):
    with pytest.raises(FloatingPointError, match=r"requests \['bad', 'good'\]|requests \['good', 'bad'\]"):
        serve(poison(name))


def test_a_nan_embedding_row_stops_only_the_requests_that_read_it():
    with pytest.raises(FloatingPointError) as info:
        serve(poison("embedding"))
    assert "'bad'" in str(info.value) and "'good'" not in str(info.value)


# ------------------------------------------ poison that would outlive its request (issue 34)


def _engine(rm, **config):
    return Engine(rm, rm.config.make_kv_pool(40, PAGE), EngineConfig(max_seqs=4, max_seq_len=64,
                                                                      max_num_batched_tokens=16, **config))


def _cached_pages_are_finite(engine) -> bool:
    kv = jax.device_get(engine.kv)
    return all(np.isfinite(kv.k[:, :, p]).all() and np.isfinite(kv.v[:, :, p]).all()
               for p in engine.kv_manager.prefix_cache.pages)


def test_an_aborted_requests_nonfinite_pages_are_never_cached():
    """A request aborted before it samples: its first chunk (16 clean tokens) and its second (the poisoned
    token and what follows: NaN K/V) were computed, and the second's pages were offered to the prefix cache
    when dispatched. When the call is read they leave it (they stayed, for the next request with these tokens
    to be blamed), the clean pages stay, and the engine serves on."""
    rm = shared_model()
    clean, rm.params = rm.params, poison("embedding")
    try:
        engine = _engine(rm)
        prefix = list(range(21, 37))  # 16 clean tokens: four pages
        engine.add_request(Request(request_id="bad", prompt_ids=prefix + [POISON_TOKEN] + list(range(40, 51)),
                                   max_new_tokens=4))
        engine.step()  # dispatches the first chunk
        engine.step()  # dispatches the second (the poison), reads the first
        engine.abort("bad")
        while engine.has_unfinished() or engine._inflight is not None:
            engine.step()
        engine.step()  # reads the last call in flight, if any
        assert engine.stats.nonfinite_kv == 1
        assert len(engine.kv_manager.prefix_cache) == 4 and _cached_pages_are_finite(engine)
        [out] = engine.run([Request(request_id="good", prompt_ids=prefix + [60, 61, 62], max_new_tokens=3)])
        assert out.num_cached_tokens == 16 and len(out.output_ids) == 3
    finally:
        rm.params = clean


def test_nan_that_no_sampled_row_sees_still_stops_its_request():
    """A sliding window of 4 over 2 layers: the poisoned token at position 1 reaches positions up to 7, and
    the prompt's last row (position 19) never sees it, so its logits are finite; the K/V of positions 1-7 are
    not, and the request that computed them is stopped by name, its pages kept out of the prefix cache."""
    model = Llama(LlamaConfig(**{**TINY, "sliding_window": 4}), rngs=nnx.Rngs(0))
    model.embed.set_value(model.embed[...].at[POISON_TOKEN, 4].set(jnp.nan))
    engine = Engine(RaggedModel(model), model.config.make_kv_pool(40, PAGE),
                    EngineConfig(max_seqs=4, max_seq_len=64, max_num_batched_tokens=32))
    prompt = [21, POISON_TOKEN] + list(range(22, 40))  # 20 tokens, one call
    with pytest.raises(FloatingPointError, match=r"non-finite values .* requests \['window'\]"):
        engine.run([Request(request_id="window", prompt_ids=prompt, max_new_tokens=2),
                    Request(request_id="clean", prompt_ids=list(range(41, 61)), max_new_tokens=2)])
    assert _cached_pages_are_finite(engine)


def test_a_model_that_does_not_report_finiteness_is_checked_from_the_pool():
    """The toy model's ``apply`` returns ``(logits, kv)`` only: the engine reads the K/V the call wrote back
    from the pool and stops the request whose token has a NaN embedding, by name."""
    from engine_helpers import VOCAB, make_toy_step, toy_params, toy_pool

    params = toy_params()
    params["emb"] = params["emb"].at[5, 0].set(jnp.nan)
    engine = Engine(make_toy_step(params), toy_pool(40), EngineConfig(max_seqs=4, max_seq_len=64,
                                                                      max_num_batched_tokens=16), vocab_size=VOCAB)
    with pytest.raises(FloatingPointError, match=r"non-finite values .* requests \['toy'\]"):
        engine.run([Request(request_id="toy", prompt_ids=[1, 5, 2, 3], max_new_tokens=2),
                    Request(request_id="fine", prompt_ids=[1, 2, 3, 4], max_new_tokens=2)])
