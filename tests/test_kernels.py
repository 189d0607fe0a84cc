"""Paged-attention kernels against their references, on CPU in interpret mode.

Two tiers. The references against tiny hand-worked cases (arithmetic in the
comments), then every kernel against its reference over a product of page
size, KV heads, queries per KV head, head dim and dtype. Each case holds one
sequence of every interesting length (0, 1, L - 1, L, L + 1 and the maximum),
block tables that are a random permutation of the pool, a pages-per-sequence
count that is not a multiple of the pages per compute block, and NaN in every
slot no sequence owns, so an out-of-bounds or unmasked read shows.

Compilation dominates the cost (1-3 s a configuration): the default run takes
a covering subset of the product, the full product is marked slow.
"""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention import paged as attention
from pallas_kernels import common
from pallas_kernels.paged_attention_cpu import CPUBlockSizes, paged_attention_cpu, ref_paged_attention_cpu
from pallas_kernels.paged_attention_gpu import GPUBlockSizes, paged_attention_gpu, ref_paged_attention_gpu
from pallas_kernels.paged_attention_tpu import TPUBlockSizes, paged_attention_tpu, ref_paged_attention_tpu
from pallas_kernels.ragged_paged_attention import (
    RaggedBlockSizes,
    ragged_paged_attention,
    ref_ragged_paged_attention,
)

TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    # bf16 outputs are rounded to 8 bits of mantissa (~4e-3 relative), and
    # the GPU kernels multiply in bf16 with f32 accumulation.
    jnp.dtype(jnp.bfloat16): dict(atol=2e-2, rtol=2e-2),
    # Quantized pages against the float pages they were quantized from: the
    # quantization error, not a kernel's (a kernel on quantized pages is held
    # to q's tolerance against the reference on the same pages, which
    # dequantizes them). Attention outputs of unit-variance K/V (outputs of
    # RMS 0.34), over 6 seeds: int8 (uniform steps of max|x| / 127) moved
    # them by at most 0.013 (RMS 0.8 %); e4m3fn (3 mantissa bits, up to 6 %
    # per element) by 0.076 (RMS 3.3 %); e5m2 (2 bits, up to 12 %) by 0.147
    # (RMS 6.6 %). Scales shifted by one token moved them by 0.38-0.41,
    # dropped scales by the dtype's max (127 to 57,344): these tolerances
    # catch gross errors; the kernels against the reference on the same
    # quantized pages are the tight test.
    jnp.dtype(jnp.int8): dict(atol=5e-2, rtol=0),
    jnp.dtype(jnp.float8_e4m3fn): dict(atol=0.15, rtol=0),
    jnp.dtype(jnp.float8_e5m2): dict(atol=0.3, rtol=0),
}
"""Kernel-versus-reference tolerance, keyed by the dtype of q and the pages;
for quantized page dtypes, quantized-versus-float pages."""


def assert_close(actual, expected, dtype):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **TOLERANCES[jnp.dtype(dtype)]
    )


# ---------------------------------------------------------------------------
# Case builder


def make_case(
    seed: int,
    *,
    kv_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype,
    pages_per_seq: int,
    q_lens: list[int] | None = None,
    num_q_tokens: int | None = None,
    page_dtype=None,
):
    """A pool, block tables and queries for one test case.

    Pages are dealt to sequences from a random permutation of the pool;
    block-table entries past a sequence's pages are random page ids. With
    ``page_dtype`` None the pages are in ``dtype``; with a quantized dtype
    (int8, fp8) they are quantized to it, with scales. Every slot no
    sequence owns holds NaN (for quantized pages in the scales, and in the
    pages too where the dtype has a NaN: fp8). With
    ``q_lens`` the queries are ragged ``[B, T, N, H]`` with NaN padding rows,
    otherwise decode queries ``[B, N, H]``.

    Returns:
      dict with q, k_pages, v_pages, block_tables, kv_lens, (q_lens),
      k_scales, v_scales.
    """
    rng = np.random.default_rng(seed)
    batch = len(kv_lens)
    needed = [math.ceil(n / page_size) for n in kv_lens]
    assert max(needed) <= pages_per_seq
    num_pages = sum(needed) + 3
    perm = rng.permutation(num_pages)
    tables = rng.integers(0, num_pages, (batch, pages_per_seq))
    owned = np.zeros((num_pages, page_size), bool)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = perm[start : start + n]
        start += n
        slots = np.arange(kv_lens[b])
        owned[tables[b, slots // page_size], slots % page_size] = True

    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    case = {}
    if page_dtype is not None:
        (kq, ks), (vq, vs) = (common.quantize_kv(jnp.asarray(x), page_dtype) for x in (k, v))
        ks, vs = np.array(ks), np.array(vs)
        ks[:, ~owned] = np.nan
        vs[:, ~owned] = np.nan
        if jnp.issubdtype(page_dtype, jnp.floating):
            kq, vq = (jnp.where(owned[None, :, :, None], x.astype(jnp.float32), jnp.nan).astype(page_dtype)
                      for x in (kq, vq))
        case.update(k_pages=kq, v_pages=vq, k_scales=jnp.asarray(ks), v_scales=jnp.asarray(vs))
    else:
        k[:, ~owned] = np.nan
        v[:, ~owned] = np.nan
        case.update(k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype), k_scales=None, v_scales=None)

    num_q_heads = num_kv_heads * group
    if q_lens is None:
        q = rng.standard_normal((batch, num_q_heads, head_dim)).astype(np.float32)
    else:
        q = rng.standard_normal((batch, num_q_tokens, num_q_heads, head_dim)).astype(np.float32)
        for b, n in enumerate(q_lens):
            q[b, n:] = np.nan
        case["q_lens"] = jnp.asarray(q_lens, jnp.int32)
    case.update(
        q=jnp.asarray(q, dtype),
        block_tables=jnp.asarray(tables, jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
    )
    return case


def decode_args(c):
    return (c["q"], c["k_pages"], c["v_pages"], c["block_tables"], c["kv_lens"], c["k_scales"], c["v_scales"])


def ragged_args(c):
    return (c["q"], c["k_pages"], c["v_pages"], c["block_tables"], c["kv_lens"], c["q_lens"], c["k_scales"],
            c["v_scales"])


def edge_lengths(page_size: int, pages_per_seq: int) -> list[int]:
    return [0, 1, page_size - 1, page_size, page_size + 1, pages_per_seq * page_size]


# ---------------------------------------------------------------------------
# Tier 1: the references on hand-worked cases


def hand_case():
    """One sequence, one head, head dim 2, page size 2, its 2 tokens in page 2.

    q = [1, 0]; k0 = [1, 0], k1 = [0, 0]; v0 = [1, 0], v1 = [0, 1]; scale 1.
    Logits [1, 0]; softmax [e, 1] / (e + 1) = [0.731059, 0.268941]; the
    output is that same vector.
    """
    k = np.full((1, 3, 2, 2), np.nan, np.float32)
    v = np.full((1, 3, 2, 2), np.nan, np.float32)
    k[0, 2] = [[1, 0], [0, 0]]
    v[0, 2] = [[1, 0], [0, 1]]
    return jnp.asarray([[[1.0, 0.0]]]), jnp.asarray(k), jnp.asarray(v), jnp.asarray([[2]], jnp.int32)


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(), [0.731059, 0.268941]),
        # Window 1: the query at position 1 sees only k1 -> v1.
        (dict(sliding_window=1), [0.0, 1.0]),
        # Cap 0.5: logits [0.5 tanh(2), 0] = [0.482014, 0];
        # e^0.482014 = 1.619334 -> [1.619334, 1] / 2.619334.
        (dict(soft_cap=0.5), [0.618223, 0.381777]),
        # Scale 2: logits [2, 0] -> [e^2, 1] / (e^2 + 1) = [0.880797, 0.119203].
        (dict(scale=2.0), [0.880797, 0.119203]),
    ],
    ids=["plain", "window", "soft_cap", "scale"],
)
def test_references_on_hand_case(options, expected):
    q, k, v, tables = hand_case()
    options = {"scale": 1.0, **options}
    lengths = jnp.asarray([2], jnp.int32)
    for ref in (ref_paged_attention_gpu, ref_paged_attention_tpu, ref_paged_attention_cpu):
        np.testing.assert_allclose(ref(q, k, v, tables, lengths, **options)[0, 0], expected, atol=1e-6)
    out = ref_ragged_paged_attention(q[:, None], k, v, tables, lengths, jnp.asarray([1], jnp.int32), **options)
    np.testing.assert_allclose(out[0, 0, 0], expected, atol=1e-6)


def test_ragged_reference_is_causal_on_hand_case():
    # Prefill of both tokens, q0 = q1 = [1, 0]: q0 sees only k0 -> v0 = [1, 0];
    # q1 sees both -> [0.731059, 0.268941] (as in hand_case).
    q, k, v, tables = hand_case()
    q2 = jnp.concatenate([q, q], axis=0)[None]  # [1, 2, 1, 2]
    lens = jnp.asarray([2], jnp.int32)
    out = ref_ragged_paged_attention(q2, k, v, tables, lens, lens, scale=1.0)
    np.testing.assert_allclose(out[0, :, 0], [[1.0, 0.0], [0.731059, 0.268941]], atol=1e-6)


def test_kernels_on_hand_case():
    q, k, v, tables = hand_case()
    lens = jnp.asarray([2], jnp.int32)
    expected = [0.731059, 0.268941]
    gpu = paged_attention_gpu(q, k, v, tables, lens, scale=1.0, block_sizes=GPUBlockSizes(pages_per_compute_block=8))
    tpu = paged_attention_tpu(q, k, v, tables, lens, scale=1.0)
    cpu = paged_attention_cpu(q, k, v, tables, lens, scale=1.0)
    rag = ragged_paged_attention(q[:, None], k, v, tables, lens, jnp.asarray([1], jnp.int32), scale=1.0,
                                 block_sizes=RaggedBlockSizes(pages_per_compute_block=8))
    for out in (gpu[0, 0], tpu[0, 0], cpu[0, 0], rag[0, 0, 0]):
        np.testing.assert_allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_paged_attention_matches_common_reference(dtype):
    # The per-sequence loop (the truth) against the XLA path of
    # paged_jax.attention.paged (a masked gather). Ragged, with a window and a cap.
    c = make_case(0, kv_lens=[0, 5, 17, 9], q_lens=[0, 5, 1, 4], num_q_tokens=6, page_size=4,
                  num_kv_heads=2, group=3, head_dim=8, dtype=dtype, pages_per_seq=5)
    for options in (dict(), dict(sliding_window=3, soft_cap=2.0)):
        ours = ref_ragged_paged_attention(*ragged_args(c), **options)
        theirs = attention.xla_paged_attention(
            c["q"], c["k_pages"], c["v_pages"], c["block_tables"], c["kv_lens"], c["q_lens"], **options)
        assert_close(ours, theirs, dtype)


# ---------------------------------------------------------------------------
# Shared pieces: validation, quantization


def test_validate_inputs_rejects_bad_inputs():
    c = make_case(0, kv_lens=[3, 5], page_size=4, num_kv_heads=2, group=2, head_dim=8,
                  dtype=jnp.float32, pages_per_seq=2)
    q, k, v, bt, lens = c["q"], c["k_pages"], c["v_pages"], c["block_tables"], c["kv_lens"]
    common.validate_inputs(q, k, v, bt, lens)
    fp8 = jnp.zeros(k.shape, jnp.float8_e4m3fn)
    bad = [
        ((q[:, :3], k, v, bt, lens), "multiple of num_kv_heads"),
        ((q, k, v[:, :, :, :4], bt, lens), "must match k_pages"),
        ((q, k, v, bt[:1], lens), "block_tables must be"),
        ((q, k, v, bt, lens.astype(jnp.float32)), "kv_lens must be int32"),
        ((q, k, v, bt, lens, lens), "takes q_lens=None"),
        ((q[:, None], k, v, bt, lens), "needs q_lens"),
        ((q, jnp.zeros(k.shape, jnp.int8), jnp.zeros(k.shape, jnp.int8), bt, lens),
         r"exactly when k_pages is quantized \(int8, float8_e4m3fn, float8_e5m2\), got k_pages int8"),
        ((q, fp8, fp8, bt, lens), "exactly when k_pages is quantized .* got k_pages float8_e4m3fn, k_scales None"),
        ((q, k, v, bt, lens, None, jnp.ones(k.shape[:3]), jnp.ones(k.shape[:3])),
         "exactly when k_pages is quantized .* got k_pages float32, k_scales set"),
        ((q, fp8, fp8, bt, lens, None, jnp.ones(k.shape[:3], jnp.bfloat16), jnp.ones(k.shape[:3])),
         re.escape(f"k_scales must be f32{list(k.shape[:3])}, got bfloat16")),
    ]
    # Page dtypes outside common.KV_DTYPES are refused by name, scales or not.
    for odd in (jnp.float8_e4m3fnuz, jnp.int4, jnp.int32):
        pages = jnp.zeros(k.shape, odd)
        bad.append(((q, pages, pages, bt, lens), f"k_pages must have a K/V page dtype .*got dtype {jnp.dtype(odd)}"))
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            common.validate_inputs(*args)
    for kernel in (paged_attention_gpu, paged_attention_tpu, ref_paged_attention_gpu):
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            kernel(q[:, :3], k, v, bt, lens)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_gpu(q, k, v, bt, lens, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_attention_tpu(q, k, v, bt, lens, soft_cap=-1.0)


def test_block_sizes_check_themselves():
    with pytest.raises(ValueError, match="power of two"):
        GPUBlockSizes(pages_per_compute_block=3)
    with pytest.raises(ValueError, match="k_splits"):
        GPUBlockSizes(k_splits=0)
    with pytest.raises(ValueError, match="block_q"):
        RaggedBlockSizes(block_q=6)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        TPUBlockSizes(pages_per_compute_block=0)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        CPUBlockSizes(pages_per_compute_block=True)
    with pytest.raises(ValueError, match="power of two >= 16"):
        GPUBlockSizes(pages_per_compute_block=1).keys_per_block(8)
    assert TPUBlockSizes(pages_per_compute_block=3).pages_per_compute_block == 3  # any count is fine on TPU


@pytest.mark.parametrize("dtype", common.QUANTIZED_KV_DTYPES, ids=lambda d: d.name)
def test_quantize_kv_round_trip_and_memory(dtype):
    x = np.random.default_rng(0).standard_normal((3, 5, 4, 64)) * 3.0
    x[0, 1, 2] *= 1e30  # huge values: scaled, saturated, never inf or NaN (float8_e4m3fn has no inf)
    x = jnp.asarray(x, jnp.float32).at[0, 0, 0].set(0.0)  # an all-zero vector: scale 0, values 0
    xq, scales = common.quantize_kv(x, dtype)
    assert xq.dtype == dtype and scales.shape == (3, 5, 4) and scales.dtype == jnp.float32
    top = common.quantized_max(dtype)
    np.testing.assert_allclose(scales, jnp.max(jnp.abs(x), axis=-1) / top, rtol=1e-6)
    back = np.asarray(common.dequantize_kv(xq, scales))
    assert np.all(np.isfinite(back))
    err, xs = np.abs(back - np.asarray(x)), np.asarray(scales)[..., None]
    if dtype == jnp.int8:  # uniform steps of one scale: at most half a step
        assert np.all(err <= xs / 2 + 1e-6 * np.abs(np.asarray(x)))
    else:  # relative steps (nmant mantissa bits), down to the subnormal step near zero
        info = jnp.finfo(dtype)
        bound = np.maximum(np.abs(np.asarray(x)) * 2.0 ** -(info.nmant + 1), xs * float(info.smallest_subnormal) / 2)
        assert np.all(err <= bound * (1 + 1e-5))
        # The largest element of each vector maps onto the format's largest value, exactly.
        peak = np.take_along_axis(np.abs(np.asarray(xq, np.float32)), np.abs(np.asarray(x)).argmax(-1)[..., None], -1)
        assert np.all(peak[np.asarray(scales) > 0] == top)
    assert float(scales[0, 0, 0]) == 0.0 and bool(jnp.all(xq[0, 0, 0].astype(jnp.float32) == 0))
    # Per token and KV head: 64 + 4 bytes instead of 256 (f32) or 128 (bf16).
    assert common.kv_bytes_per_token(64, dtype) == 68
    assert common.kv_bytes_per_token(64, jnp.float32) == 256
    assert common.kv_bytes_per_token(64, jnp.bfloat16) == 128
    with pytest.raises(ValueError, match=r"dtype must be one of \['int8', 'float8_e4m3fn', 'float8_e5m2'\], "
                                         r"got dtype=float8_e4m3fnuz"):
        common.quantize_kv(x, jnp.float8_e4m3fnuz)


# ---------------------------------------------------------------------------
# Tier 2: kernels against references over a parameter product

PAGE_SIZES = (8, 16, 32, 64)
KV_HEADS = (1, 3, 8)
GROUPS = (1, 3, 4, 8)
HEAD_DIMS = (64, 128)
DTYPES = (jnp.float32, jnp.bfloat16)
FULL_PRODUCT = list(itertools.product(PAGE_SIZES, KV_HEADS, GROUPS, HEAD_DIMS, DTYPES))

# A covering subset for the default run: every value of every axis appears,
# most pairs of (page size, KV heads, group) too.
SMALL_PRODUCT = [
    (8, 1, 1, 64, jnp.float32),
    (16, 3, 3, 128, jnp.bfloat16),
    (32, 8, 4, 64, jnp.float32),
    (64, 1, 8, 128, jnp.float32),
    (8, 8, 8, 128, jnp.bfloat16),
    (16, 1, 4, 64, jnp.bfloat16),
    (32, 3, 1, 128, jnp.float32),
    (64, 3, 8, 64, jnp.bfloat16),
    (16, 8, 3, 64, jnp.float32),
    (8, 3, 4, 64, jnp.float32),
]
TPU_SMALL_PRODUCT = [SMALL_PRODUCT[i] for i in (0, 1, 2, 3, 7)]
PAGES_PER_SEQ = 5  # not a multiple of the 2 or 4 pages per compute block used below


def _id(params):
    page_size, kv_heads, group, head_dim, dtype = params
    return f"L{page_size}-K{kv_heads}-G{group}-H{head_dim}-{jnp.dtype(dtype).name}"


def _slow_unless_small(product, small):
    small_ids = {_id(p) for p in small}
    return [
        pytest.param(*p, id=_id(p), marks=() if _id(p) in small_ids else pytest.mark.slow) for p in product
    ]


def _gpu_sizes(page_size, seed):
    # 2 pages per block (4 when the page is 8 tokens, for 32 keys); 2 splits
    # on odd seeds so both combination paths run.
    return GPUBlockSizes(pages_per_compute_block=4 if page_size == 8 else 2, k_splits=1 + seed % 2)


@pytest.mark.parametrize("page_size, kv_heads, group, head_dim, dtype",
                         _slow_unless_small(FULL_PRODUCT, SMALL_PRODUCT))
def test_gpu_kernel_matches_reference(page_size, kv_heads, group, head_dim, dtype):
    seed = page_size + kv_heads + group + head_dim
    c = make_case(seed, kv_lens=edge_lengths(page_size, PAGES_PER_SEQ), page_size=page_size,
                  num_kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype, pages_per_seq=PAGES_PER_SEQ)
    out = paged_attention_gpu(*decode_args(c), block_sizes=_gpu_sizes(page_size, seed))
    expected = ref_paged_attention_gpu(*decode_args(c))
    assert out.dtype == c["q"].dtype
    assert_close(out, expected, dtype)
    assert not np.any(np.asarray(out, np.float32)[0])  # length 0: zeros


@pytest.mark.parametrize("page_size, kv_heads, group, head_dim, dtype",
                         _slow_unless_small(FULL_PRODUCT, TPU_SMALL_PRODUCT))
def test_tpu_kernel_matches_reference(page_size, kv_heads, group, head_dim, dtype):
    seed = page_size + kv_heads + group + head_dim
    c = make_case(seed, kv_lens=edge_lengths(page_size, PAGES_PER_SEQ), page_size=page_size,
                  num_kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype, pages_per_seq=PAGES_PER_SEQ)
    out = paged_attention_tpu(*decode_args(c), block_sizes=TPUBlockSizes(pages_per_compute_block=2))
    assert_close(out, ref_paged_attention_tpu(*decode_args(c)), dtype)
    assert not np.any(np.asarray(out, np.float32)[0])


@pytest.mark.parametrize("page_size, kv_heads, group, head_dim, dtype",
                         _slow_unless_small(FULL_PRODUCT, SMALL_PRODUCT))
def test_cpu_kernel_matches_reference(page_size, kv_heads, group, head_dim, dtype):
    seed = page_size + kv_heads + group + head_dim
    c = make_case(seed, kv_lens=edge_lengths(page_size, PAGES_PER_SEQ), page_size=page_size,
                  num_kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype, pages_per_seq=PAGES_PER_SEQ)
    out = paged_attention_cpu(*decode_args(c), block_sizes=CPUBlockSizes(pages_per_compute_block=2))
    assert_close(out, ref_paged_attention_cpu(*decode_args(c)), dtype)
    assert not np.any(np.asarray(out, np.float32)[0])


# Ragged batches: (kv_lens, q_lens), T = 24, page size 8, 5 pages per sequence.
RAGGED_BATCHES = {
    "decode": ([0, 1, 7, 8, 9, 40], [0, 1, 1, 1, 1, 1]),
    "prefill": ([1, 7, 8, 9, 24], [1, 7, 8, 9, 24]),
    # chunked prefill (a 24-token chunk after 16 cached), decodes, an idle slot
    "mixed": ([40, 1, 17, 0, 9, 24], [24, 1, 1, 0, 9, 3]),
}
RAGGED_SMALL = [(3, 3, 64, jnp.float32), (1, 8, 128, jnp.bfloat16), (8, 1, 64, jnp.bfloat16)]
RAGGED_FULL = list(itertools.product(KV_HEADS, GROUPS, HEAD_DIMS, DTYPES))


@pytest.mark.parametrize("batch", list(RAGGED_BATCHES))
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, dtype",
    [
        pytest.param(*p, id=_id((8, *p)), marks=() if p in RAGGED_SMALL else pytest.mark.slow)
        for p in RAGGED_FULL
    ],
)
def test_ragged_kernel_matches_per_sequence_loop(batch, kv_heads, group, head_dim, dtype):
    kv_lens, q_lens = RAGGED_BATCHES[batch]
    c = make_case(len(batch) + kv_heads + group, kv_lens=kv_lens, q_lens=q_lens, num_q_tokens=24, page_size=8,
                  num_kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype, pages_per_seq=PAGES_PER_SEQ)
    out = ragged_paged_attention(*ragged_args(c), block_sizes=RaggedBlockSizes(block_q=8, pages_per_compute_block=2))
    expected = ref_ragged_paged_attention(*ragged_args(c))
    assert_close(out, expected, dtype)
    out_np = np.asarray(out, np.float32)  # host-side checks: no eager compile per slice shape
    for b, n in enumerate(q_lens):
        assert not np.any(out_np[b, n:])  # padding rows: zeros, not NaN
    if dtype == jnp.float32:  # and the XLA path of paged_jax agrees
        assert_close(out, attention.xla_paged_attention(*ragged_args(c)[:6]), dtype)


# ---------------------------------------------------------------------------
# Options real models need: soft cap, sliding window, quantized pages, a scale


OPTION_SETS = {
    "soft_cap": (dict(soft_cap=5.0), None),
    "window": (dict(sliding_window=11), None),
    "int8": (dict(), jnp.int8),
    "int8_window_cap_scale": (dict(sliding_window=20, soft_cap=3.0, scale=0.2), jnp.int8),
    "fp8": (dict(), jnp.float8_e4m3fn),
    "e5m2_window_cap_scale": (dict(sliding_window=20, soft_cap=3.0, scale=0.2), jnp.float8_e5m2),
}
# fp8 on the GPU and ragged kernels runs by default in
# tests/test_ragged_attention.py (NaN pages, through the engine's door);
# here the TPU and CPU kernels take it, and e5m2 one of them.
OPTION_SLOW = {("fp8", "gpu"), ("fp8", "ragged"), ("e5m2_window_cap_scale", "gpu"),
               ("e5m2_window_cap_scale", "tpu"), ("e5m2_window_cap_scale", "ragged")}


@pytest.mark.parametrize("option_set, kernel", [
    pytest.param(o, k, id=f"{o}-{k}", marks=pytest.mark.slow if (o, k) in OPTION_SLOW else ())
    for o in OPTION_SETS for k in ("gpu", "tpu", "cpu", "ragged")
])
def test_kernel_options_match_reference(kernel, option_set):
    options, page_dtype = OPTION_SETS[option_set]
    page_size, dtype = 8, jnp.float32
    lengths = edge_lengths(page_size, PAGES_PER_SEQ)
    if kernel == "ragged":
        c = make_case(1, kv_lens=lengths, q_lens=[0, 1, 7, 1, 9, 16], num_q_tokens=16, page_size=page_size,
                      num_kv_heads=2, group=4, head_dim=64, dtype=dtype, pages_per_seq=PAGES_PER_SEQ,
                      page_dtype=page_dtype)
        out = ragged_paged_attention(*ragged_args(c), **options,
                                     block_sizes=RaggedBlockSizes(block_q=8, pages_per_compute_block=2))
        expected = ref_ragged_paged_attention(*ragged_args(c), **options)
    else:
        c = make_case(1, kv_lens=lengths, page_size=page_size, num_kv_heads=2, group=4, head_dim=64, dtype=dtype,
                      pages_per_seq=PAGES_PER_SEQ, page_dtype=page_dtype)
        if kernel == "gpu":
            out = paged_attention_gpu(*decode_args(c), **options,
                                      block_sizes=GPUBlockSizes(pages_per_compute_block=2, k_splits=2))
        elif kernel == "tpu":
            out = paged_attention_tpu(*decode_args(c), **options, block_sizes=TPUBlockSizes(pages_per_compute_block=3))
        else:
            out = paged_attention_cpu(*decode_args(c), **options, block_sizes=CPUBlockSizes(pages_per_compute_block=3))
        expected = ref_paged_attention_gpu(*decode_args(c), **options)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("page_dtype", common.QUANTIZED_KV_DTYPES, ids=lambda d: d.name)
def test_quantized_pages_stay_close_to_float_pages(page_dtype):
    # Quantization error, not kernel error (the reference on both, so no
    # kernel compiles): within the page dtype's entry of TOLERANCES.
    c = make_case(2, kv_lens=[9, 40, 33], page_size=8, num_kv_heads=2, group=4, head_dim=64, dtype=jnp.float32,
                  pages_per_seq=PAGES_PER_SEQ)
    (kq, ks), (vq, vs) = (common.quantize_kv(c[name], page_dtype) for name in ("k_pages", "v_pages"))
    quantized = ref_paged_attention_gpu(c["q"], kq, vq, c["block_tables"], c["kv_lens"], ks, vs)
    exact = ref_paged_attention_gpu(*decode_args(c))
    assert_close(quantized, exact, page_dtype)
    assert not np.array_equal(np.asarray(quantized), np.asarray(exact))  # the pages were quantized


# ---------------------------------------------------------------------------
# Dispatch


def _dispatch_case(num_q_tokens):
    if num_q_tokens == 1:  # decode, with an idle slot (q_lens = 0 but kv_lens > 0)
        kv_lens, q_lens = [0, 1, 9, 40, 12], [0, 1, 1, 1, 0]
    else:
        kv_lens, q_lens = [40, 1, 17, 0, 9], [16, 1, 1, 0, 9]
    return make_case(3, kv_lens=kv_lens, q_lens=q_lens, num_q_tokens=num_q_tokens, page_size=16, num_kv_heads=3,
                     group=3, head_dim=64, dtype=jnp.float32, pages_per_seq=3)


@pytest.mark.parametrize("num_q_tokens", [1, 16], ids=["decode", "mixed"])
@pytest.mark.parametrize("impl", ["xla_loop", "pallas_gpu", "pallas_tpu", "pallas_ragged", "auto"])
def test_dispatch_impls_match_xla(impl, num_q_tokens):
    c = _dispatch_case(num_q_tokens)
    args = ragged_args(c)[:6]
    xla = attention.paged_attention(*args, impl="xla")
    out = jax.jit(lambda *a: attention.paged_attention(*a, impl=impl))(*args)
    assert out.shape == c["q"].shape
    assert_close(out, xla, jnp.float32)
    assert not np.any(np.asarray(out)[4, int(c["q_lens"][4]):])  # idle / padding rows stay zero


@pytest.mark.parametrize("page_dtype", [
    # fp8 by default: the XLA path in tests/test_attention.py, the kernels in OPTION_SETS.
    jnp.int8, pytest.param(jnp.float8_e4m3fn, marks=pytest.mark.slow),
], ids=["int8", "float8_e4m3fn"])
def test_dispatch_with_quantized_pages(page_dtype):
    c = _dispatch_case(1)
    (kq, ks), (vq, vs) = (common.quantize_kv(c[name], page_dtype) for name in ("k_pages", "v_pages"))
    args = (c["q"], kq, vq, c["block_tables"], c["kv_lens"], c["q_lens"])
    xla = attention.paged_attention(*args, impl="xla", k_scales=ks, v_scales=vs)
    for impl in ("xla_loop", "pallas_gpu"):
        assert_close(attention.paged_attention(*args, impl=impl, k_scales=ks, v_scales=vs), xla, jnp.float32)


@pytest.mark.parametrize(
    "backend, num_q_tokens, called",
    [
        ("cpu", 1, "xla"),
        ("cpu", 16, "xla"),
        ("gpu", 1, "paged_attention_gpu"),
        ("gpu", 16, "ragged_paged_attention"),
        ("tpu", 1, "paged_attention_tpu"),
        ("tpu", 16, "xla"),
    ],
)
def test_auto_picks_the_kernel_of_the_backend(monkeypatch, backend, num_q_tokens, called):
    from pallas_kernels import paged_attention_gpu as gpu_mod
    from pallas_kernels import paged_attention_tpu as tpu_mod
    from pallas_kernels import ragged_paged_attention as ragged_mod

    calls = []

    def spy(name):
        def record(*args, **kwargs):
            calls.append(name)
            q = args[0]
            return jnp.zeros(q.shape, q.dtype)

        return record

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(attention, "unchecked_xla_paged_attention", spy("xla"))
    monkeypatch.setattr(gpu_mod, "unchecked_paged_attention_gpu", spy("paged_attention_gpu"))
    monkeypatch.setattr(tpu_mod, "unchecked_paged_attention_tpu", spy("paged_attention_tpu"))
    monkeypatch.setattr(ragged_mod, "unchecked_ragged_paged_attention", spy("ragged_paged_attention"))
    c = _dispatch_case(num_q_tokens)
    attention.paged_attention(*ragged_args(c)[:6], impl="auto")
    assert calls == [called]


def test_dispatch_rejects_unknown_impl():
    c = _dispatch_case(1)
    with pytest.raises(ValueError, match="impl must be one of"):
        attention.paged_attention(*ragged_args(c)[:6], impl="triton")


# ---------------------------------------------------------------------------
# The stacked pool: layer ``layer`` of [layers, K, P, L, H], read in place


def _stack(x, layer, num_layers=3):
    """``x`` as layer ``layer`` of a stack whose other layers hold NaN."""
    if x is None:
        return None
    x = np.asarray(x)
    fill = 127 if x.dtype == np.int8 else np.nan  # int8 has no NaN: saturated pages beside NaN scales
    stack = np.full((num_layers, *x.shape), fill, x.dtype)
    stack[layer] = x
    return jnp.asarray(stack)


@pytest.mark.parametrize("impl, num_q_tokens, page_dtype", [
    ("xla", 16, None), ("xla", 1, jnp.int8), pytest.param("xla", 1, jnp.float8_e4m3fn, marks=pytest.mark.slow),
    ("xla_loop", 1, None),
    ("xla_loop", 1, jnp.int8), ("pallas_gpu", 1, None), ("pallas_gpu", 1, jnp.int8), ("pallas_tpu", 1, None),
    ("pallas_ragged", 16, None),
], ids=lambda x: jnp.dtype(x).name if isinstance(x, type) else None)
def test_stacked_pool_reads_its_layer_in_place(impl, num_q_tokens, page_dtype):
    """Every implementation, given the stacked pool and a (traced) layer
    index, gives bit for bit what it gives on that layer's pages alone,
    while every other layer holds NaN (quantized pools: NaN scales, and NaN
    pages for fp8 or saturated ones for int8): no other layer is read."""
    c = _dispatch_case(num_q_tokens)
    pages = (c["k_pages"], c["v_pages"])
    scales = (None, None)
    if page_dtype is not None:
        (kq, ks), (vq, vs) = (common.quantize_kv(x, page_dtype) for x in pages)
        pages, scales = (kq, vq), (ks, vs)
    rest = (c["block_tables"], c["kv_lens"], c["q_lens"])
    one = attention.paged_attention(c["q"], *pages, *rest, impl=impl, k_scales=scales[0], v_scales=scales[1])
    stacked = [_stack(x, 1) for x in (*pages, *scales)]
    call = jax.jit(lambda layer, q, k, v, bt, kl, ql, ks, vs: attention.paged_attention(
        q, k, v, bt, kl, ql, impl=impl, layer=layer, k_scales=ks, v_scales=vs))
    out = call(jnp.int32(1), c["q"], *stacked[:2], *rest, *stacked[2:])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(one))
    real = np.arange(num_q_tokens)[None, :] < np.asarray(c["q_lens"])[:, None]
    assert np.all(np.isfinite(np.asarray(out)[real]))


def test_stacked_pool_rejects_bad_layers():
    c = _dispatch_case(1)
    args = (c["q"], _stack(c["k_pages"], 0), _stack(c["v_pages"], 0), c["block_tables"], c["kv_lens"], c["q_lens"])
    for bad in (3, -1):
        with pytest.raises(ValueError, match=r"layer must be in \[0, num_layers=3\), got layer=" + str(bad)):
            attention.paged_attention(*args, impl="xla", layer=bad)
        with pytest.raises(ValueError, match="layer must be in"):
            paged_attention_gpu(c["q"][:, 0], *args[1:5], layer=bad)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        attention.paged_attention(*args, impl="xla", layer=1.0)
    with pytest.raises(ValueError, match="with layer=0, k_pages must be the stacked pool"):
        attention.paged_attention(c["q"], c["k_pages"], c["v_pages"], *args[3:], impl="xla", layer=0)
    with pytest.raises(ValueError, match="or the stacked"):
        attention.paged_attention(*args, impl="xla")  # a 5-D pool without a layer


@pytest.mark.parametrize("page_dtype", [None, jnp.int8, jnp.float8_e4m3fn], ids=["bf16", "int8", "float8_e4m3fn"])
def test_gpu_kernels_lower_to_triton(page_dtype):
    """The GPU kernels (stacked pool, traced layer) lower to Triton IR on a
    machine without a GPU: ``lowering_platforms=("cuda",)`` runs Pallas'
    Triton lowering, which refuses shapes, indexing and ops Triton cannot
    take. What only the GPU compiler can say is tested on a GPU
    (``experiments/device_check.sh``)."""
    pool = jnp.zeros((4, 3, 32, 16, 64), jnp.bfloat16)
    scales = (None, None)
    if page_dtype is not None:
        pool, s = common.quantize_kv(pool, page_dtype)
        scales = (s, s)
    tables, kv_lens = jnp.zeros((4, 8), jnp.int32), jnp.full((4,), 20, jnp.int32)

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    decode = lowered(lambda layer, q: paged_attention_gpu(q, pool, pool, tables, kv_lens, *scales, layer=layer,
                                                          interpret=False),
                     jnp.int32(2), jnp.zeros((4, 9, 64), jnp.bfloat16))
    ragged = lowered(lambda layer, q: ragged_paged_attention(q, pool, pool, tables, kv_lens, jnp.full((4,), 16, jnp.int32),
                                                             *scales, layer=layer, interpret=False),
                     jnp.int32(2), jnp.zeros((4, 16, 9, 64), jnp.bfloat16))
    for text in (decode, ragged):
        assert "xla.gpu.triton" in text
