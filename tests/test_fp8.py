"""fp8 K/V pages (float8_e4m3fn, float8_e5m2) beside int8: the pool is
allocated in exactly the dtype asked for (tpu-inference once allocated fp8
as bf16 without a word), writes quantize with a per-token scale and touch
only their slots, page copies move pages and scales, a decoder on an fp8
pool gives logits close to the f32 pool's, and dtypes that are not K/V page
dtypes are refused by name at every door (the pool, the decoder, models.llm,
the CLI).

The kernels' fp8 checks sit beside their int8 ones (tests/test_kernels.py,
tests/test_ragged_attention.py, tests/test_attention.py, tests/test_swap.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import LlamaConfig
from models.llama import Llama
from models.ragged import RaggedModel
from paged_jax.paging.kv_cache import KVPool, check_pool, copy_pages, init_kv_pool, write_layer_kv
from pallas_kernels.common import dequantize_kv, quantized_max
from tests.decoder_helpers import mixed_calls

FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
FP8_IDS = ["e4m3fn", "e5m2"]
SHAPE = dict(num_layers=2, num_kv_heads=3, num_pages=5, page_size=4, head_dim=16)
TINY = dict(vocab_size=97, model_dim=32, mlp_dim=48, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
            rope_theta=10000.0, rms_norm_eps=1e-5)


@functools.cache
def tiny_model() -> Llama:
    """A random tiny decoder, its weights drawn in NumPy into the module's
    abstract shapes (Flax's eager initialisation compiles a program per
    draw: 6 s here, against 0.4 s); norm scales near 1, so a dropped norm
    would show. Cached: tests only read it."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(LlamaConfig(**TINY), rngs=nnx.Rngs(0))))
    r = np.random.default_rng(0)

    def draw(path, x):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if "scale" in name:
            return jnp.asarray(1 + 0.1 * r.normal(size=x.shape), x.dtype)
        return jnp.asarray(r.normal(size=x.shape) * (1.0 if name.startswith("embed") else 0.2), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


def fp8_bound(x: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """The largest error quantizing ``x`` [..., H] to ``dtype`` with
    ``scales`` [...] may leave: half a step, relative for normal values
    (``nmant`` mantissa bits), the subnormal step near zero."""
    info = jnp.finfo(dtype)
    return np.maximum(np.abs(x) * 2.0 ** -(info.nmant + 1),
                      scales[..., None] * float(info.smallest_subnormal) / 2) * (1 + 1e-5)


# ---------------------------------------------------------------- the pool


@pytest.mark.parametrize("dtype, want", [(jnp.float8_e4m3fn, jnp.float8_e4m3fn), ("fp8", jnp.float8_e4m3fn),
                                         ("float8_e5m2", jnp.float8_e5m2)], ids=["e4m3fn", "fp8", "e5m2"])
def test_fp8_pool_is_allocated_in_fp8_with_scales(dtype, want):
    pool = init_kv_pool(**SHAPE, dtype=dtype)
    assert pool.k.dtype == want and pool.v.dtype == want and pool.quantized
    assert pool.k_scale.dtype == jnp.float32 and pool.k_scale.shape == (2, 3, 5, 4) == pool.v_scale.shape
    slots = 2 * 3 * 5 * 4  # layers * KV heads * pages * page size
    assert pool.k.nbytes == slots * 16  # one byte per element, not two (bf16) or four
    assert pool.nbytes == 2 * slots * (16 + 4)  # K and V: H bytes and a 4-byte scale per (token, KV head)
    config = LlamaConfig(**{**TINY, "num_q_heads": 6, "num_kv_heads": 3})
    assert config.kv_bytes_per_token(want) == config.kv_bytes_per_token(jnp.int8) == 2 * 2 * 3 * (16 + 4)
    assert pool.nbytes == 5 * 4 * config.kv_bytes_per_token(want)
    assert config.make_kv_pool(5, 4, dtype).k.dtype == want
    check_pool(pool)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_write_round_trips_and_touches_only_its_slots(dtype):
    """Written tokens read back within fp8's rounding of their per-token
    scale; the -1 padding slot, the other layer and every other slot keep
    their bytes (the pool starts full of random content so a stray write
    shows); jit writes the same bytes."""
    r = np.random.default_rng(1)
    pool = init_kv_pool(**SHAPE, dtype=dtype)
    shape = pool.k.shape
    pool = KVPool(k=jnp.asarray(r.normal(size=shape), dtype), v=jnp.asarray(r.normal(size=shape), dtype),
                  k_scale=jnp.asarray(r.random(shape[:-1]), jnp.float32),
                  v_scale=jnp.asarray(r.random(shape[:-1]), jnp.float32))
    k, v = (jnp.asarray(r.normal(size=(4, 3, 16)) * 5, jnp.float32) for _ in range(2))
    slots = [6, -1, 19, 0]  # page 1 offset 2; padding; page 4 offset 3; page 0 offset 0
    out = write_layer_kv(pool, jnp.int32(1), k, v, jnp.asarray(slots, jnp.int32))
    assert out.k.dtype == dtype and out.v.dtype == dtype
    written = np.zeros(shape[:-1], bool)  # [layers, K, P, L]
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        page, offset = divmod(slot, 4)
        written[1, :, page, offset] = True
        for pages, scales, want in ((out.k, out.k_scale, k), (out.v, out.v_scale, v)):
            step = np.asarray(scales[1, :, page, offset])  # [K]
            np.testing.assert_allclose(step, np.abs(np.asarray(want[row])).max(-1) / quantized_max(dtype), rtol=1e-6)
            got = np.asarray(dequantize_kv(pages[1, :, page, offset], scales[1, :, page, offset]))  # [K, H]
            assert np.all(np.abs(got - np.asarray(want[row])) <= fp8_bound(np.asarray(want[row]), step, dtype))
    for before, after in zip(jax.tree.leaves(pool), jax.tree.leaves(out)):
        b, a = np.asarray(before), np.asarray(after)
        keep = ~written if b.ndim == 4 else np.broadcast_to(~written[..., None], b.shape)
        assert a[keep].tobytes() == b[keep].tobytes()
    jitted = jax.jit(write_layer_kv)(pool, jnp.int32(1), k, v, jnp.asarray(slots, jnp.int32))
    for eager, traced in zip(jax.tree.leaves(out), jax.tree.leaves(jitted)):
        assert np.asarray(eager).tobytes() == np.asarray(traced).tobytes()


def test_copy_pages_moves_fp8_pages_with_their_scales():
    r = np.random.default_rng(2)
    shape = (2, 3, 5, 4, 16)
    pool = KVPool(k=jnp.asarray(r.normal(size=shape), jnp.float8_e4m3fn),
                  v=jnp.asarray(r.normal(size=shape), jnp.float8_e4m3fn),
                  k_scale=jnp.asarray(r.random(shape[:-1]), jnp.float32),
                  v_scale=jnp.asarray(r.random(shape[:-1]), jnp.float32))
    out = copy_pages(pool, jnp.asarray([1, -1, 4]), jnp.asarray([3, 2, 2]))  # 1 -> 3, skipped, 4 -> 2
    for before, after in zip(jax.tree.leaves(pool), jax.tree.leaves(out)):
        b, a = np.asarray(before), np.asarray(after)
        assert a.dtype == b.dtype
        assert a[:, :, 3].tobytes() == b[:, :, 1].tobytes() and a[:, :, 2].tobytes() == b[:, :, 4].tobytes()
        for page in (0, 1, 4):
            assert a[:, :, page].tobytes() == b[:, :, page].tobytes()


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fnuz, jnp.float8_e4m3, jnp.int4, jnp.int32, "float64", "fp7"],
                         ids=["e4m3fnuz", "e4m3", "int4", "int32", "float64", "fp7"])
def test_other_dtypes_are_refused_by_name(dtype):
    """Not K/V page dtypes: other fp8 encodings (e4m3fnuz: no negative
    zero, NaN at 0x80; e4m3: IEEE-style with inf), sub-byte and integer
    types, and float64 (f32 without jax_enable_x64)."""
    name = dtype if isinstance(dtype, str) and dtype == "fp7" else jnp.dtype(dtype).name
    shown = repr(name) if name == "fp7" else name
    with pytest.raises(ValueError, match=f"dtype must be a K/V page dtype: .*got dtype={shown}"):
        init_kv_pool(**SHAPE, dtype=dtype)
    with pytest.raises(ValueError, match=f"dtype must be a K/V page dtype: .*got dtype={shown}"):
        LlamaConfig(**TINY).make_kv_pool(5, 4, dtype)


def test_fp8_pools_without_scales_or_odd_pages_are_refused():
    kv = init_kv_pool(**SHAPE, dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="a float8_e4m3fn kv pool needs k_scale and v_scale"):
        check_pool(KVPool(k=kv.k, v=kv.v))
    odd = kv.k.astype(jnp.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="kv pool dtype must be a K/V page dtype: .*got kv pool dtype=float8_e4m3fnuz"):
        check_pool(KVPool(k=odd, v=odd, k_scale=kv.k_scale, v_scale=kv.v_scale))
    with pytest.raises(ValueError, match="K and V must share one dtype, got float8_e4m3fn and float8_e5m2"):
        check_pool(KVPool(k=kv.k, v=kv.v.astype(jnp.float8_e5m2), k_scale=kv.k_scale, v_scale=kv.v_scale))
    fp8 = init_kv_pool(num_layers=2, num_kv_heads=2, num_pages=5, page_size=4, head_dim=16, dtype="fp8")
    with pytest.raises(ValueError, match="a float8_e4m3fn kv pool needs k_scale and v_scale"):
        RaggedModel(tiny_model()).check_kv_pool(KVPool(k=fp8.k, v=fp8.v))


# ---------------------------------------------------------------- the decoder


# fp8 against the f32 pool, same weights and tokens, logits of std 5.4 and
# range [-16, 16.5]: measured max |difference| 0.78 for e4m3fn (RMS 0.23),
# against 0.18 for int8 (RMS 0.05) and 2.1 for e5m2 (RMS 0.46); argmax
# unchanged for all three. fp8's relative step (up to 1/16 of an element
# for e4m3fn) is coarser than int8's max|x| / 254 on these 16-wide head
# vectors. Scales shifted by one token moved the e4m3fn logits by 12.8,
# unit scales (dropped) by 20.3.
LOGITS_ATOL = {jnp.dtype(jnp.float8_e4m3fn): 2.0}


def test_decoder_on_an_fp8_pool_gives_logits_close_to_the_f32_pool():
    """Three sequences prefilled through the decoder's flat batch (the
    engine's path: forward_ragged, K/V quantized as written, read back
    dequantized; every slot no write filled holds NaN pages and scales)."""
    model = tiny_model()
    r = np.random.default_rng(0)
    schedule = [[(row, r.integers(0, TINY["vocab_size"], n).tolist()) for row, n in enumerate((19, 7, 12))]]
    f32 = np.stack(list(mixed_calls(model, schedule)[0].values()))  # [3, V]
    fp8 = np.stack(list(mixed_calls(model, schedule, kv_dtype=jnp.float8_e4m3fn)[0].values()))
    assert np.all(np.isfinite(fp8))
    np.testing.assert_allclose(fp8, f32, rtol=0, **{"atol": LOGITS_ATOL[jnp.dtype(jnp.float8_e4m3fn)]})
    assert not np.array_equal(fp8, f32)  # the pool was quantized
    assert (fp8.argmax(-1) == f32.argmax(-1)).all()


@pytest.mark.slow
def test_engine_on_an_fp8_pool_mostly_agrees_with_f32_greedy():
    """The engine end to end (prefill chunks, decode, pages freed and
    reused): greedy tokens of an fp8 pool against an f32 pool. They may
    part at near-ties, after which a request's continuations differ:
    measured, 12 of 16 requests identical over 16 tokens, 15 of 16 with
    the same first token."""
    from paged_jax.engine.core import Engine, EngineConfig, Request

    model = tiny_model()
    r = np.random.default_rng(3)
    requests = [(r.integers(0, TINY["vocab_size"], int(r.integers(2, 30))).tolist()) for _ in range(16)]
    outs = {}
    for dtype in (jnp.float32, jnp.float8_e4m3fn):
        engine = Engine(RaggedModel(model), model.config.make_kv_pool(64, 4, dtype),
                        EngineConfig(max_seqs=8, max_seq_len=64, max_num_batched_tokens=32))
        assert engine.kv.k.dtype == dtype
        done = engine.run([Request(request_id=i, prompt_ids=p, max_new_tokens=16) for i, p in enumerate(requests)])
        outs[dtype] = {o.request_id: o.output_ids for o in done}
    same = sum(outs[jnp.float32][i] == outs[jnp.float8_e4m3fn][i] for i in range(len(requests)))
    first = sum(outs[jnp.float32][i][0] == outs[jnp.float8_e4m3fn][i][0] for i in range(len(requests)))
    assert same > len(requests) // 2 and first >= len(requests) * 3 // 4, (same, first)


# ---------------------------------------------------------------- the doors above the pool


def test_serve_sharegpt_takes_fp8(tmp_path):
    """(On a mesh too: tests/test_sharding_quantized.py.)"""
    from experiments.serving import serve_sharegpt

    for flag, want in (("fp8", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2")):
        assert serve_sharegpt.parse_args(["--kv-dtype", flag, "--out", str(tmp_path)]).kv_dtype == want
    with pytest.raises(SystemExit):
        serve_sharegpt.parse_args(["--kv-dtype", "float8_e4m3fnuz", "--out", str(tmp_path)])


def test_serving_engine_allocates_the_asked_fp8():
    """experiments.lib.serving's engine (what the serving table describes) holds
    an fp8 pool when asked (on a mesh, every shard's dtype:
    tests/test_sharding_quantized.py)."""
    from experiments.lib.serving import make_engine

    model = tiny_model()
    engine = make_engine(model, kv_tokens=64, page_size=4, max_seqs=2, max_seq_len=64, kv_dtype=jnp.float8_e4m3fn)
    assert engine.kv.k.dtype == jnp.float8_e4m3fn and engine.kv.quantized
