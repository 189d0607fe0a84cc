"""The Llama decoder on the paged KV pool: paged equals dense, token-by-token
equals one-shot, chunked prefill equals one-shot prefill, a ragged batch
equals each sequence alone. Tiny random weights, f32, CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import SMOLLM2_135M
from models.llama import Llama, LlamaConfig, forward, make_step_fn
from models.ragged import RaggedModel, forward_ragged
from models.smollm2 import generate_greedy
from paged_jax.paging.kv_cache import write_layer_pages, write_pages
from paged_jax.paging.page_state import NULL_PAGE
from tests.decoder_helpers import NUM_PAGES, PAGE_SIZE, mixed_calls, nan_pool, small_mixed_batch

TOL = {"rtol": 1e-5, "atol": 1e-5}  # f32, matmul precision "highest" (conftest)

TINY = dict(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=2, num_q_heads=3,
            num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)


@functools.cache
def tiny_model(*, tie_embeddings=True, seed=0) -> Llama:
    """Random tiny model; norm scales randomized too so a dropped norm shows.
    Cached: tests only read it."""
    config = LlamaConfig(**TINY, tie_embeddings=tie_embeddings)
    model = Llama(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for i, norm in enumerate((model.blocks.attn_norm, model.blocks.mlp_norm, model.final_norm)):
        shape = norm.scale[...].shape
        norm.scale.set_value(1.0 + 0.3 * jax.random.normal(jax.random.fold_in(key, i), shape))
    return model


@functools.cache
def tiny_step(*, all_logits: bool, tie_embeddings=True, seed=0):
    """One jitted step per model and output kind, shared by the tests so that
    equal shapes compile once."""
    return make_step_fn(tiny_model(tie_embeddings=tie_embeddings, seed=seed), all_logits=all_logits)


PAGES_PER_SEQ = 4
"""One pool shape and block-table width for every test (fewer compilations)."""


def dense_reference(model: Llama, tokens: np.ndarray) -> np.ndarray:
    """Independent plain-jnp causal forward of one sequence, no paging:
    f32[T, V] logits for i32[T] tokens."""
    c = model.config
    p = nnx.state(model)
    num_tokens = len(tokens)
    x = p["embed"][...][tokens]  # [T, D]

    def norm(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * scale

    pos = jnp.arange(num_tokens, dtype=jnp.float32)
    inv = c.rope_theta ** (-jnp.arange(0, c.head_dim, 2, dtype=jnp.float32) / c.head_dim)
    ang = jnp.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]  # [T, 1, H]

    def rope(x):  # [T, heads, H], Hugging Face rotate_half
        half = c.head_dim // 2
        rot = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * jnp.cos(ang) + rot * jnp.sin(ang)

    blocks = p["blocks"]
    causal = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))
    for i in range(c.num_layers):
        h = norm(x, blocks["attn_norm"]["scale"][...][i])
        q = rope(jnp.einsum("TD,DNH->TNH", h, blocks["attn"]["wq"][...][i]))
        k = rope(jnp.einsum("TD,DKH->TKH", h, blocks["attn"]["wk"][...][i]))
        v = jnp.einsum("TD,DKH->TKH", h, blocks["attn"]["wv"][...][i])
        k = jnp.repeat(k, c.group_size, axis=1)  # [T, N, H]: query head n uses KV head n // G
        v = jnp.repeat(v, c.group_size, axis=1)
        s = jnp.einsum("TNH,SNH->NTS", q, k) / np.sqrt(c.head_dim)
        s = jnp.where(causal, s, -jnp.inf)
        o = jnp.einsum("NTS,SNH->TNH", jax.nn.softmax(s, -1), v)
        x = x + jnp.einsum("TNH,NHD->TD", o, blocks["attn"]["wo"][...][i])
        h = norm(x, blocks["mlp_norm"]["scale"][...][i])
        g = h @ blocks["mlp"]["w_gate"][...][i]
        u = h @ blocks["mlp"]["w_up"][...][i]
        x = x + (jax.nn.silu(g) * u) @ blocks["mlp"]["w_down"][...][i]
    x = norm(x, p["final_norm"]["scale"][...])
    w = p["embed"][...] if c.tie_embeddings else p["lm_head"][...]
    return np.asarray(x @ w.T)


def run(step, tokens, kv, block_table, kv_len, q_len, *, width=None):
    """One jitted step for one sequence (``kv`` is donated); ``tokens``
    padded to ``width``."""
    width = width or len(tokens)
    padded = np.zeros((1, width), np.int32)
    padded[0, : len(tokens)] = tokens
    return step(jnp.asarray(padded), kv, jnp.asarray([block_table], jnp.int32),
                jnp.asarray([kv_len], jnp.int32), jnp.asarray([q_len], jnp.int32))


def check_mixed_against_dense(model, prompts, schedule, tol, kv_dtype=None):
    """Every chunk's last-token logits from :func:`mixed_calls` equal the
    dense reference on the sequence so far."""
    got = mixed_calls(model, schedule, kv_dtype=kv_dtype)
    full = {row: [t for call in schedule for r, chunk in call if r == row for t in chunk] for row in range(len(prompts))}
    dense = {row: dense_reference(model, np.asarray(seq)) for row, seq in full.items()}  # causal: one pass each
    seen = {row: 0 for row in full}
    for call, logits in zip(schedule, got):
        for row, chunk in call:
            seen[row] += len(chunk)
            np.testing.assert_allclose(logits[row], dense[row][seen[row] - 1], **tol)
            assert np.isfinite(logits[row]).all()


# ---------------------------------------------------------------- config


def test_config_rejects_bad_heads_and_sizes():
    with pytest.raises(ValueError, match="num_q_heads=4 num_kv_heads=3"):
        LlamaConfig(**{**TINY, "num_q_heads": 4, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="model_dim=0"):
        LlamaConfig(**{**TINY, "model_dim": 0})
    with pytest.raises(ValueError, match="num_layers=2.5"):
        LlamaConfig(**{**TINY, "num_layers": 2.5})
    with pytest.raises(ValueError, match="head_dim=15"):
        LlamaConfig(**{**TINY, "head_dim": 15})
    with pytest.raises(ValueError, match="rope_theta=0"):
        LlamaConfig(**{**TINY, "rope_theta": 0.0})
    with pytest.raises(TypeError):
        LlamaConfig(97, 32, 48, 2, 3, 1, 16)  # keyword-only
    with pytest.raises(AttributeError):
        SMOLLM2_135M.num_layers = 3  # frozen


def test_config_derived_values_and_pool():
    assert SMOLLM2_135M.group_size == 3
    assert SMOLLM2_135M.num_params == 134_515_008  # 134.5 M, FACTS.md
    assert SMOLLM2_135M.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4
    kv = LlamaConfig(**TINY).make_kv_pool(num_pages=5, page_size=4, dtype=jnp.bfloat16)
    assert kv.k.shape == kv.v.shape == (2, 1, 5, 4, 16)
    assert kv.k.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="num_pages"):
        LlamaConfig(**TINY).make_kv_pool(num_pages=1, page_size=4)


def test_forward_rejects_mismatched_pool_and_shapes():
    model = tiny_model()
    kv = LlamaConfig(**{**TINY, "num_layers": 3}).make_kv_pool(4, 4)
    with pytest.raises(ValueError, match="num_layers, num_kv_heads, head_dim"):
        run(make_step_fn(model), [1, 2], kv, [1, 2], 2, 2)
    kv = model.config.make_kv_pool(4, 4)
    with pytest.raises(ValueError, match="q_lens must have shape"):
        forward(model, jnp.zeros((2, 3), jnp.int32), kv, jnp.ones((2, 2), jnp.int32),
                jnp.array([3, 3]), jnp.array([3]))
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        forward(model, jnp.zeros((1, 3)), kv, jnp.ones((1, 2), jnp.int32), jnp.array([3]), jnp.array([3]))


# ---------------------------------------------------------------- pool writes


def test_write_layer_pages_equals_write_pages():
    pool = jax.random.normal(jax.random.key(0), (3, 2, 6, 4, 5))  # [layers, K, P, L, H]
    new = jax.random.normal(jax.random.key(1), (7, 2, 5))  # [N_tok, K, H]
    slots = jnp.array([0, 5, -1, 23, 9, -1, 12], jnp.int32)
    got = write_layer_pages(pool, jnp.int32(1), new, slots)
    want = pool.at[1].set(write_pages(pool[1], new, slots))
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- equivalences


FULL_WIDTH = 13
"""Token width of every one-shot forward (shorter prompts are padded)."""


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_one_shot_prefill_equals_dense_reference(tie_embeddings):
    model = tiny_model(tie_embeddings=tie_embeddings)
    tokens = np.random.default_rng(0).integers(0, 97, size=11)
    # Pages 5, 2, 7 in that order; the spare entry points at the null page.
    block_table = [5, 2, 7, NULL_PAGE]
    step = tiny_step(all_logits=True, tie_embeddings=tie_embeddings)
    logits, kv = run(step, tokens, nan_pool(model.config), block_table, 11, 11, width=FULL_WIDTH)
    assert logits.shape == (1, FULL_WIDTH, 97) and logits.dtype == jnp.float32
    want = dense_reference(model, tokens)
    np.testing.assert_allclose(logits[0, :11], want, **TOL)
    # The K/V landed in the pages the block table names, nowhere else.
    written = ~np.isnan(np.asarray(kv.k[0, 0, :, :, 0]))  # [P, L]
    expect = np.zeros((NUM_PAGES, PAGE_SIZE), bool)
    expect[5] = expect[2] = True
    expect[7, :3] = True
    np.testing.assert_array_equal(written, expect)
    assert np.abs(want).max() > 1.0  # logits of a real scale, so TOL means something


def test_token_by_token_decode_equals_full_forward():
    model = tiny_model()
    tokens = np.random.default_rng(1).integers(0, 97, size=13)
    block_table = [3, 6, 1, 4]
    full, _ = run(tiny_step(all_logits=True), tokens, nan_pool(model.config), block_table, 13, 13)
    kv = nan_pool(model.config)
    step = make_step_fn(model)
    for t in range(len(tokens)):
        logits, kv = step(jnp.asarray([[tokens[t]]], jnp.int32), kv,
                          jnp.asarray([block_table], jnp.int32), jnp.asarray([t + 1], jnp.int32),
                          jnp.asarray([1], jnp.int32))
        np.testing.assert_allclose(logits[0], full[0, t], **TOL, err_msg=f"position {t}")
    assert step.num_compilations == 1


@pytest.mark.parametrize("chunks", [(4, 5, 4), (1, 12), (7, 6)])
def test_chunked_prefill_equals_one_shot(chunks):
    model = tiny_model()
    tokens = np.random.default_rng(2).integers(0, 97, size=sum(chunks))
    block_table = [2, 4, 6, 1]
    step_all, step_last = tiny_step(all_logits=True), tiny_step(all_logits=False)
    full, _ = run(step_all, tokens, nan_pool(model.config), block_table, 13, 13)
    kv = nan_pool(model.config)
    width = 12  # every chunk padded to one width, as an engine bucket would
    done = 0
    for n in chunks:
        chunk = tokens[done: done + n]
        logits, kv = run(step_all, chunk, kv, block_table, done + n, n, width=width)
        np.testing.assert_allclose(logits[0, :n], full[0, done: done + n], **TOL)
        # Writing the same chunk again rewrites the same slots with the same values.
        last, kv = run(step_last, chunk, kv, block_table, done + n, n, width=width)
        np.testing.assert_allclose(last[0], full[0, done + n - 1], **TOL)
        done += n


def test_ragged_batch_equals_each_sequence_alone():
    """Four sequences in one pool, pages handed out in a random order; a
    batched prefill of ragged prompts, then one mixed call (decode, a
    prefill chunk, an idle row, a decode) equals running each alone."""
    model = tiny_model()
    rng = np.random.default_rng(7)
    page_size, pages_per_seq, num_pages = PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 stays the null page
    prompt_lens = [1, 4, 5, 9]
    new_lens = [1, 3, 0, 1]
    seqs = [rng.integers(0, 97, size=p + n) for p, n in zip(prompt_lens, new_lens)]
    tables = np.full((4, pages_per_seq), NULL_PAGE, np.int32)
    next_page = 0
    for b, seq in enumerate(seqs):
        need = -(-len(seq) // page_size)
        tables[b, :need] = perm[next_page: next_page + need]
        next_page += need

    kv = nan_pool(model.config)
    step = tiny_step(all_logits=True)
    width = max(prompt_lens)
    tokens = np.zeros((4, width), np.int32)
    for b, p in enumerate(prompt_lens):
        tokens[b, :p] = seqs[b][:p]
    lens = jnp.asarray(prompt_lens, jnp.int32)
    pre, kv = step(jnp.asarray(tokens), kv, jnp.asarray(tables), lens, lens)

    width = max(new_lens)
    tokens = np.zeros((4, width), np.int32)
    for b, (p, n) in enumerate(zip(prompt_lens, new_lens)):
        tokens[b, :n] = seqs[b][p: p + n]
    kv_lens = jnp.asarray([p + n for p, n in zip(prompt_lens, new_lens)], jnp.int32)
    mixed, kv = step(jnp.asarray(tokens), kv, jnp.asarray(tables), kv_lens,
                     jnp.asarray(new_lens, jnp.int32))

    for b, (seq, p, n) in enumerate(zip(seqs, prompt_lens, new_lens)):
        alone, _ = run(step, seq, nan_pool(model.config), tables[b], len(seq), len(seq),
                       width=FULL_WIDTH)
        np.testing.assert_allclose(pre[b, :p], alone[0, :p], **TOL, err_msg=f"prefill, seq {b}")
        np.testing.assert_allclose(mixed[b, :n], alone[0, p: p + n], **TOL, err_msg=f"mixed, seq {b}")
    assert np.isfinite(np.asarray(mixed)).all() and np.isfinite(np.asarray(pre)).all()


def test_step_fn_last_logits_donation_and_compile_count():
    model = tiny_model()
    step = make_step_fn(model)
    kv = model.config.make_kv_pool(6, 4)
    tables = jnp.asarray([[1, 2], [3, 4], [5, NULL_PAGE]], jnp.int32)
    tokens = jnp.asarray([[5, 6, 7], [8, 9, 0], [1, 0, 0]], jnp.int32)
    q_lens = jnp.asarray([3, 2, 0], jnp.int32)
    # Eager (unjitted) forward, on a pool that is not donated.
    want, _ = forward(model, tokens, model.config.make_kv_pool(6, 4), tables, q_lens, q_lens,
                      all_logits=True)
    old = kv
    logits, kv = step(tokens, kv, tables, q_lens, q_lens)
    assert logits.shape == (3, 97) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits[0], want[0, 2], **TOL)
    np.testing.assert_allclose(logits[1], want[1, 1], **TOL)
    np.testing.assert_array_equal(logits[2], 0.0)  # q_lens = 0: no row to report
    assert old.k.is_deleted() and old.v.is_deleted()  # donated: updated in place
    for _ in range(3):  # same shapes: no retrace
        logits, kv = step(tokens, kv, tables, q_lens + 3, q_lens)
    assert step.num_compilations == 1
    logits, kv = step(tokens[:, :1], kv, tables, q_lens + 4, jnp.minimum(q_lens, 1))
    assert step.num_compilations == 2
    with pytest.raises(ValueError, match="impl"):
        make_step_fn(model, impl="cuda-magic")


def test_generate_greedy_equals_dense_argmax_loop():
    model = tiny_model()
    prompt = [5, 17, 42, 8, 63]
    out = generate_greedy(model, prompt, max_new_tokens=6, page_size=PAGE_SIZE, prefill_bucket=8,
                          length_bucket=16, step=tiny_step(all_logits=False))
    # Greedy means: under teacher forcing on prompt + output, each output
    # token is the argmax of the dense model's logits one position earlier.
    dense = dense_reference(model, np.asarray(prompt + out))  # [T, V]
    assert out == dense[len(prompt) - 1: -1].argmax(-1).tolist()
    # A stop id ends generation and is included.
    stop = generate_greedy(model, prompt, max_new_tokens=6, stop_ids=(out[2],), page_size=PAGE_SIZE,
                           prefill_bucket=8, length_bucket=16, step=tiny_step(all_logits=False))
    assert stop == out[: out.index(out[2]) + 1]
    with pytest.raises(ValueError, match="at least one token"):
        generate_greedy(model, [])
    with pytest.raises(ValueError, match=r"in \[0, 97\), got min=0 max=97"):
        generate_greedy(model, [0, 97])
    with pytest.raises(ValueError, match="tokenizer is needed"):
        generate_greedy(model, "text")


@pytest.mark.slow  # 15-25 s; preemption is covered on the toy model (tests/test_engine.py)
def test_engine_on_the_decoder_preemption_keeps_greedy_outputs():
    """The real decoder behind the engine: a pool small enough to force
    preemption by recompute gives the same greedy tokens as a large one, and
    every page comes back."""
    from paged_jax.engine.core import Engine, EngineConfig, Request

    model = tiny_model()
    step = RaggedModel(model)
    r = np.random.default_rng(11)
    reqs = [
        Request(request_id=i, prompt_ids=r.integers(0, TINY["vocab_size"], int(r.integers(3, 30))).tolist(),
                max_new_tokens=int(r.integers(8, 30)))
        for i in range(10)
    ]
    outs = {}
    for num_pages in (200, 17):  # 16 usable pages of 4 = 64 tokens = one max-length sequence
        engine = Engine(step, model.config.make_kv_pool(num_pages, 4),
                        EngineConfig(max_seqs=8, max_seq_len=64, max_num_batched_tokens=16))
        outs[num_pages] = {o.request_id: o.output_ids for o in engine.run(reqs)}
        assert engine.num_free_pages == num_pages - 1
        assert (engine.stats.preemptions > 0) == (num_pages == 17)
    assert outs[200] == outs[17]


PRECISION = {
    None: ({"rtol": 1e-4, "atol": 1e-4}, None),
    # int8 K/V: one f32 scale per token and KV head, errors up to max|x| / 254 per element; the dense reference
    # is f32 throughout, so the tolerance is that of the quantization (logits here span about +-15; measured
    # errors up to 0.11), not of the path: test_ragged_attention checks int8 attention exactly against dequantized
    # pages. Scales dropped or misplaced give errors of 10-100x the tolerance.
    "int8": ({"rtol": 0, "atol": 0.25}, jnp.int8),
}


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["f32", "int8"])
def test_mixed_batches_equal_dense_forward(kv_dtype):
    """Prefill chunks and decode tokens of several sequences share calls:
    chunks end at a page boundary (4), inside a page and across pages; a
    one-token prompt and a decode run beside them. Each chunk's logits equal
    the dense forward of the sequence so far (NaN pool: nothing unwritten is
    read)."""
    r = np.random.default_rng(3)
    a, b, c = (r.integers(0, TINY["vocab_size"], n).tolist() for n in (17, 6, 1))
    schedule = [
        [(0, a[:4]), (1, b)],  # chunk at a page boundary + a whole prompt
        [(0, a[4:11]), (1, [5]), (2, c)],  # chunk across pages + decode + one-token prompt
        [(1, [7]), (0, a[11:17]), (2, [9])],  # last chunk + two decodes
        [(0, [3]), (1, [11]), (2, [2])],  # decode only
    ]
    check_mixed_against_dense(tiny_model(), [a, b, c], schedule, *PRECISION[kv_dtype])


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
def test_forward_ragged_checks_the_attention_once(monkeypatch, impl):
    """Validated at the door: one model call checks the attention's options,
    layer and lengths once (``check_attend``); the work list and the flat
    kernels under it trust them (their ``unchecked_*``)."""
    from pallas_kernels import common

    counts = {}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)

        return wrapper

    for name in ("validate_inputs", "validate_options", "checked_lengths", "checked_layer"):
        monkeypatch.setattr(common, name, counting(name, getattr(common, name)))
    model = tiny_model()
    batch = small_mixed_batch()  # row 0: a 5-token prompt; row 1: decodes its third token
    kv = model.config.make_kv_pool(8, PAGE_SIZE)
    logits, _, _ = jax.eval_shape(lambda b, kv: forward_ragged(model, b, kv, impl=impl), batch, kv)
    assert logits.shape == (2, TINY["vocab_size"])
    assert counts == {"validate_options": 1, "checked_lengths": 1, "checked_layer": 1}


# pallas_ragged (the older ragged kernel, 46 s) is a slow extra; its kernel against the reference is in
# tests/test_ragged_attention.py.
@pytest.mark.parametrize("impl", ["pallas_gpu", pytest.param("pallas_ragged", marks=pytest.mark.slow)])
def test_engine_through_pallas_kernels_equals_xla(impl):
    """The engine's mixed batches through the Pallas kernels (interpret mode
    on CPU, as a GPU would run them natively) give the XLA path's greedy
    tokens."""
    from paged_jax.engine.core import Engine, EngineConfig, Request

    model = tiny_model()
    r = np.random.default_rng(5)
    reqs = [Request(request_id=i, prompt_ids=r.integers(0, TINY["vocab_size"], int(r.integers(2, 20))).tolist(),
                    max_new_tokens=6) for i in range(4)]
    outs = {}
    for name in ("xla", impl):
        engine = Engine(RaggedModel(model, impl=name), model.config.make_kv_pool(40, 4),
                        EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16))
        outs[name] = {o.request_id: o.output_ids for o in engine.run(reqs)}
    assert outs[impl] == outs["xla"]


def test_int8_pool_stores_quantized_kv_and_refuses_half_pools():
    from paged_jax.paging.kv_cache import KVPool, init_kv_pool, write_layer_kv
    from pallas_kernels.common import dequantize_kv

    config = LlamaConfig(**TINY)
    kv = config.make_kv_pool(num_pages=5, page_size=4, dtype=jnp.int8)
    assert kv.quantized and kv.k.dtype == jnp.int8 and kv.k_scale.shape == (2, 1, 5, 4)
    assert kv.nbytes == 2 * (2 * 1 * 5 * 4) * (16 + 4) == 5 * 4 * config.kv_bytes_per_token(jnp.int8)
    r = np.random.default_rng(0)
    k, v = (jnp.asarray(r.normal(size=(3, 1, 16)), jnp.float32) for _ in range(2))
    out = write_layer_kv(kv, jnp.int32(1), k, v, jnp.asarray([0, 9, -1], jnp.int32))  # slot 9: page 2, offset 1
    for pages, scales, want in ((out.k, out.k_scale, k), (out.v, out.v_scale, v)):
        got = np.asarray(dequantize_kv(pages[1], scales[1]))  # [K, P, L, H]
        for row, (page, offset) in enumerate(((0, 0), (2, 1))):
            step = float(scales[1, 0, page, offset])
            assert step == pytest.approx(float(jnp.max(jnp.abs(want[row]))) / 127)
            np.testing.assert_array_less(np.abs(got[0, page, offset] - np.asarray(want[row, 0])), step / 2 + 1e-7)
    assert not np.any(np.asarray(out.k[0]))  # layer 0 untouched, the -1 slot skipped
    assert int(np.count_nonzero(np.asarray(out.k_scale))) == 2
    with pytest.raises(ValueError, match="or int8, got dtype=int32"):
        init_kv_pool(num_layers=1, num_kv_heads=1, num_pages=2, page_size=1, head_dim=2, dtype=jnp.int32)
    half = KVPool(k=kv.k, v=kv.v)  # int8 pages without scales would store truncated K/V
    with pytest.raises(ValueError, match="an int8 kv pool needs k_scale and v_scale"):
        RaggedModel(tiny_model()).check_kv_pool(half)


@pytest.mark.parametrize("beam", [False, True])
def test_non_finite_logits_stop_the_engine_instead_of_giving_a_token(beam):
    """NaN weights make NaN logits; an argmax over them would return a
    valid-looking id. The engine refuses and names the requests."""
    from flax import nnx as _nnx

    from paged_jax.engine.core import Engine, EngineConfig, Request
    from paged_jax.engine.sampling import SamplingParams

    model = Llama(LlamaConfig(**TINY), rngs=_nnx.Rngs(0))
    model.final_norm.scale.set_value(jnp.full_like(model.final_norm.scale[...], jnp.nan))
    sampling = SamplingParams(beam_width=2) if beam else SamplingParams(temperature=1.0, top_p=0.9)
    engine = Engine(RaggedModel(model), model.config.make_kv_pool(20, 4),
                    EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16))
    engine.add_request(Request(request_id="r0", prompt_ids=[1, 2, 3], max_new_tokens=3, sampling=sampling))
    with pytest.raises(FloatingPointError, match=r"not finite .* for requests \['r0'\]"):
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(RuntimeError, match="failed in an earlier step"):
        engine.step()


def test_write_layer_kv_refuses_malformed_pools_and_layers():
    from paged_jax.paging.kv_cache import KVPool, write_layer_kv

    config = LlamaConfig(**TINY)
    kv = config.make_kv_pool(num_pages=5, page_size=4, dtype=jnp.int8)
    k = v = jnp.ones((1, 1, 16), jnp.float32)
    slots = jnp.asarray([0], jnp.int32)
    cases = [
        (KVPool(k=kv.k, v=kv.v), "an int8 kv pool needs k_scale and v_scale"),
        (KVPool(k=kv.k.astype(jnp.float32), v=kv.v.astype(jnp.float32), k_scale=kv.k_scale, v_scale=kv.v_scale),
         "a float one has none"),
        (KVPool(k=kv.k, v=kv.v, k_scale=kv.k_scale.astype(jnp.bfloat16), v_scale=kv.v_scale),
         r"k_scale must be f32\[2, 1, 5, 4\], got bfloat16"),
        (KVPool(k=kv.k, v=kv.v[:, :, :4], k_scale=kv.k_scale, v_scale=kv.v_scale), "of one shape"),
    ]
    for pool, match in cases:
        with pytest.raises(ValueError, match=match):
            write_layer_kv(pool, jnp.int32(0), k, v, slots)
        with pytest.raises(ValueError, match=match):
            RaggedModel(tiny_model()).check_kv_pool(pool)
    for layer in (2, -1):
        with pytest.raises(ValueError, match=r"layer must be in \[0, num_layers=2\)"):
            write_layer_kv(kv, layer, k, v, slots)
    for layer in (True, 1.7, jnp.float32(1.0), "1", np.array([1]), np.bool_(True)):
        with pytest.raises(ValueError, match="layer must be an integer scalar"):
            write_layer_kv(kv, layer, k, v, slots)
    # K/V that would broadcast into the pool's heads are refused, never spread.
    for bad_k, bad_v, what in [(jnp.ones((1, 2, 16)), v, "k"), (jnp.ones((1, 1, 1)), v, "k"), (k, jnp.ones((1, 1, 8)), "v"),
                               (jnp.ones((1, 1, 16), jnp.int32), v, "k")]:
        with pytest.raises(ValueError, match=rf"{what} must be a float \[N_tok, K=1, H=16\] array"):
            write_layer_kv(kv, 0, bad_k, bad_v, slots)
    with pytest.raises(ValueError, match="k and v must hold the same tokens, got 2 and 1"):
        write_layer_kv(kv, 0, jnp.ones((2, 1, 16)), v, jnp.asarray([0, 1], jnp.int32))
    out = write_layer_kv(kv, 0, jnp.ones((2, 1, 16)), jnp.ones((2, 1, 16)), [0, 5])  # a list of slots works
    assert int(out.k[0, 0, 1, 1, 0]) != 0
    two = jnp.ones((2, 1, 16), jnp.float32)
    for bad in ([0, 99], [-2, 1], [3, 3]):  # past the pool, negative but not padding, twice
        with pytest.raises(ValueError, match=r"slots must be distinct flat slots in \[0, 20\) or -1"):
            write_layer_kv(kv, 0, two, two, jnp.asarray(bad, jnp.int32))
    with pytest.raises(ValueError, match=r"slots must be an integer \[N_tok=2\] array"):
        write_layer_kv(kv, 0, two, two, jnp.asarray([0], jnp.int32))
