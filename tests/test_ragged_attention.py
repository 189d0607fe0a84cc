"""Ragged paged attention over a flat batch against an f64 NumPy oracle.

The oracle is written from the definition (per sequence: gather the keys
through the block table, causal softmax in float64), not from another
kernel. Pages no sequence owns hold NaN, so a read outside a row shows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention.batch import BatchShape, RaggedBatch, Tiling, batch_shape
from paged_jax.attention.ragged import attend, count_work, ragged_paged_attention

PAGE = 4


def oracle(q, k_pages, v_pages, block_tables, q_starts, q_lens, kv_lens, *, soft_cap=None, window=None):
    """f64 truth: q [T, N, H], pages [K, P, L, H] (one layer)."""
    q = np.asarray(q, np.float64)
    k_pages, v_pages = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    t_total, n, h = q.shape
    kh, _, page, _ = k_pages.shape
    g = n // kh
    out = np.zeros_like(q)
    for s in range(len(q_lens)):
        ql, kl = int(q_lens[s]), int(kv_lens[s])
        if ql == 0:
            continue
        pos = np.arange(kl)
        pages = np.asarray(block_tables[s])[pos // page]
        k = k_pages[:, pages, pos % page]  # [K, kl, H]
        v = v_pages[:, pages, pos % page]
        for t in range(ql):
            qp = kl - ql + t
            seen = pos <= qp
            if window is not None:
                seen &= pos > qp - window
            for head in range(n):
                logits = k[head // g] @ q[q_starts[s] + t, head] / np.sqrt(h)
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                logits = np.where(seen, logits, -np.inf)
                p = np.exp(logits - logits.max())
                out[q_starts[s] + t, head] = (p / p.sum()) @ v[head // g]
    return out


def make_case(q_lens, kv_lens, *, num_kv_heads=2, group=3, head_dim=8, pages_per_seq=12, seed=0, layers=2):
    """Random flat batch; every page that no sequence owns is NaN."""
    r = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    need = [-(-k // PAGE) for k in kv_lens]
    num_pages = sum(need) + 3
    perm = r.permutation(np.arange(1, num_pages))
    block_tables = np.zeros((num_seqs, pages_per_seq), np.int32)
    c = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = perm[c:c + n]
        c += n
    shape = (layers, num_kv_heads, num_pages, PAGE, head_dim)
    k = r.normal(size=shape).astype(np.float32)
    v = r.normal(size=shape).astype(np.float32)
    owned = np.zeros((num_pages, PAGE), bool)
    for s, kl in enumerate(kv_lens):
        for p in range(kl):
            owned[block_tables[s, p // PAGE], p % PAGE] = True
    k[:, :, ~owned] = np.nan
    v[:, :, ~owned] = np.nan
    q_starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    total = int(sum(q_lens))
    q = r.normal(size=(total + 3, num_kv_heads * group, head_dim)).astype(np.float32)  # 3 padding rows
    return q, k, v, block_tables, q_starts, np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)


def run(case, *, tile_q, ppb, chunk=4, layer=1, **options):
    q, k, v, bt, qs, ql, kl = case
    tiles, _ = count_work(ql, kl, tile_q=tile_q, block_tokens=ppb * PAGE,
                          sliding_window=options.get("sliding_window"))
    fn = jax.jit(functools.partial(ragged_paged_attention, num_tiles=max(tiles, 1) + 2, tile_q=tile_q,
                                   pages_per_block=ppb, work_chunk=chunk, **options))
    return np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layer, jnp.asarray(bt),
                         jnp.asarray(qs), jnp.asarray(ql), jnp.asarray(kl)))


# Lengths 0, 1, L - 1, L, L + 1 and long, decode and prefill chunks mixed.
MIXED = ([1, 0, 3, PAGE, 1, 9, 1, 13], [1, 0, 3, PAGE, PAGE + 1, 9, 2 * PAGE - 1, 40])


@pytest.mark.parametrize("tile_q, ppb", [(1, 1), (1, 4), (2, 1), (4, 2), (16, 3)])
def test_matches_f64_oracle_on_ragged_mixed_batch(tile_q, ppb):
    case = make_case(*MIXED)
    got = run(case, tile_q=tile_q, ppb=ppb)
    q, k, v, bt, qs, ql, kl = case
    want = oracle(q, k[1], v[1], bt, qs, ql, kl)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert np.all(got[int(ql.sum()):] == 0)  # padding rows are zero


@pytest.mark.parametrize("options", [dict(soft_cap=5.0), dict(sliding_window=6), dict(sliding_window=1)])
def test_options_match_oracle(options):
    case = make_case(*MIXED, seed=3)
    got = run(case, tile_q=4, ppb=2, **options)
    q, k, v, bt, qs, ql, kl = case
    want = oracle(q, k[1], v[1], bt, qs, ql, kl, soft_cap=options.get("soft_cap"),
                  window=options.get("sliding_window"))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_hand_worked_single_key():
    """One sequence, one token: the output is its own value row, whatever
    the logit (softmax over one key is 1)."""
    q = np.ones((1, 1, 2), np.float32)
    k = np.full((1, 1, 2, PAGE, 2), np.nan, np.float32)
    v = np.full((1, 1, 2, PAGE, 2), np.nan, np.float32)
    k[0, 0, 1, 0] = [3.0, -1.0]
    v[0, 0, 1, 0] = [0.25, 7.0]
    case = (q, k, v, np.array([[1, 0]], np.int32), np.array([0], np.int32), np.array([1], np.int32),
            np.array([1], np.int32))
    assert run(case, tile_q=1, ppb=1, layer=0).tolist() == [[[0.25, 7.0]]]


def test_neighbour_isolation_is_bit_exact():
    """A row's output does not change, to the bit, when every other
    sequence's K/V and queries change (same lengths, same shapes)."""
    case = make_case(*MIXED, seed=5)
    base = run(case, tile_q=4, ppb=2)
    q, k, v, bt, qs, ql, kl = case
    r = np.random.default_rng(9)
    target = 5
    mine = set(bt[target, : -(-kl[target] // PAGE)].tolist())
    k2, v2, q2 = k.copy(), v.copy(), q.copy()
    for p in range(k.shape[2]):
        if p not in mine:
            k2[:, :, p] = r.normal(size=k2[:, :, p].shape) * 100
            v2[:, :, p] = r.normal(size=v2[:, :, p].shape) * 100
    rows = np.arange(qs[target], qs[target] + ql[target])
    others = np.setdiff1d(np.arange(q.shape[0]), rows)
    q2[others] = r.normal(size=q2[others].shape)
    other = run((q2, k2, v2, bt, qs, ql, kl), tile_q=4, ppb=2)
    assert np.array_equal(base[rows], other[rows])


def test_lengths_past_the_table_never_read_other_rows():
    """kv_lens beyond the row's table width are clamped to it: the row reads
    only its own entries, so its output ignores every other page."""
    q, k, v, bt, qs, ql, kl = make_case([1, 1], [8, 8], pages_per_seq=2)
    kl_bad = np.array([64, 8], np.int32)
    a = run((q, k, v, bt, qs, ql, kl_bad), tile_q=1, ppb=1)
    k2 = k.copy()
    k2[:, :, bt[1]] = 1e3  # the neighbour's pages change
    b = run((q, k2, v, bt, qs, ql, kl_bad), tile_q=1, ppb=1)
    np.testing.assert_array_equal(a[0], b[0])
    assert np.isfinite(a).all()


def test_attend_splits_classes_and_equals_oracle():
    q, k, v, bt, qs, ql, kl = make_case(*MIXED, seed=2)
    tiling = Tiling(prefill_tile_q=4, decode_pages_per_block=2, prefill_pages_per_block=3, decode_work_chunk=3,
                    prefill_work_chunk=2, max_prefill_chunks=8, min_tokens=8)
    shape = batch_shape(ql, num_seq_rows=len(ql), tiling=tiling)
    assert shape.num_tokens == 32 and shape.decode_tiles == 8 and shape.prefill_tiles == 32 // 4 + 8
    t = shape.num_tokens
    n = int(ql.sum())
    qpad = np.zeros((t, *q.shape[1:]), np.float32)
    qpad[:n] = q[:n]
    z = jnp.zeros(t, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(bt), q_starts=jnp.asarray(qs),
                        q_lens=jnp.asarray(ql), kv_lens=jnp.asarray(kl), logits_rows=jnp.zeros(1, jnp.int32),
                        shape=shape)
    got = np.asarray(jax.jit(attend)(jnp.asarray(qpad), jnp.asarray(k), jnp.asarray(v), 0, batch))
    want = oracle(q, k[0], v[0], bt, qs, ql, kl)
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    assert np.all(got[n:] == 0)


def test_one_program_for_any_lengths():
    """Lengths are not part of the program: two batches with the same
    token count and very different contexts reuse one compilation."""
    traces = []

    @jax.jit
    def fn(q, k, v, bt, qs, ql, kl):
        traces.append(1)
        return ragged_paged_attention(q, k, v, 0, bt, qs, ql, kl, num_tiles=4, tile_q=1, pages_per_block=1,
                                      work_chunk=4)

    for kv in ([1, 2, 3, 4], [40, 1, 33, 17]):
        q, k, v, bt, qs, ql, kl = make_case([1, 1, 1, 1], kv, pages_per_seq=12, seed=1)
        pad = np.full((k.shape[0], k.shape[1], 32 - k.shape[2], PAGE, k.shape[4]), np.nan, np.float32)
        k, v = np.concatenate([k, pad], 2), np.concatenate([v, pad], 2)  # one pool size: only lengths differ
        got = np.asarray(fn(q[:4], k, v, bt, qs, ql, kl))
        np.testing.assert_allclose(got, oracle(q[:4], k[0], v[0], bt, qs, ql, kl), atol=2e-5, rtol=2e-5)
    assert len(traces) == 1


def test_batch_shape_refuses_too_many_chunks_and_empty_batches():
    tiling = Tiling(max_prefill_chunks=2)
    with pytest.raises(ValueError, match="max_prefill_chunks=2"):
        batch_shape([3, 3, 3], num_seq_rows=3, tiling=tiling)
    with pytest.raises(ValueError, match="at least one token"):
        batch_shape([0, 0], num_seq_rows=2)
    with pytest.raises(ValueError, match="prefill_tile_q"):
        Tiling(prefill_tile_q=0)
    shape = batch_shape([1] * 5 + [0] * 3, num_seq_rows=8)
    assert shape == BatchShape(num_tokens=16, num_logits=8, decode_tiles=8, prefill_tiles=0)


def flat_batch(q, bt, qs, ql, kl):
    """``(q padded to the bucket, RaggedBatch, real rows)`` for a case, with
    room for 4 prefill chunks."""
    shape = batch_shape(ql, num_seq_rows=len(ql), tiling=Tiling(min_tokens=8, max_prefill_chunks=4))
    n = int(ql.sum())
    qpad = np.zeros((shape.num_tokens, *q.shape[1:]), np.float32)
    qpad[:n] = q[:n]
    z = jnp.zeros(shape.num_tokens, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(bt), q_starts=jnp.asarray(qs),
                        q_lens=jnp.asarray(ql), kv_lens=jnp.asarray(kl), logits_rows=jnp.zeros(1, jnp.int32),
                        shape=shape)
    return qpad, batch, n


@pytest.mark.parametrize("impl", ["pallas_ragged", "pallas_gpu", "xla_loop"])
def test_kernels_on_the_flat_batch_match_oracle(impl):
    """The Pallas kernels (interpret mode here) serve a flat batch through
    its padded view: decode rows as [S, 1], chunks as [max_chunks, T]."""
    q, k, v, bt, qs, ql, kl = make_case(*MIXED, seed=6, pages_per_seq=16)
    qpad, batch, n = flat_batch(q, bt, qs, ql, kl)
    got = np.asarray(jax.jit(functools.partial(attend, impl=impl))(
        jnp.asarray(qpad), jnp.asarray(k), jnp.asarray(v), 1, batch))
    want = oracle(q, k[1], v[1], bt, qs, ql, kl)
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    assert np.all(got[n:] == 0)
    with pytest.raises(ValueError, match="impl must be one of"):
        attend(jnp.asarray(qpad), jnp.asarray(k), jnp.asarray(v), 1, batch, impl="cuda-magic")


def test_bad_inputs_are_refused_with_names():
    q, k, v, bt, qs, ql, kl = make_case(*MIXED)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(bt), jnp.asarray(qs))
    ok = dict(num_tiles=40, tile_q=1, pages_per_block=1, work_chunk=4)
    with pytest.raises(ValueError, match="num_tiles=2 is below the"):
        ragged_paged_attention(*args, jnp.asarray(ql), jnp.asarray(kl), **{**ok, "num_tiles": 2})
    for name in ("tile_q", "work_chunk", "pages_per_block", "num_tiles"):
        with pytest.raises(ValueError, match=name):
            ragged_paged_attention(*args, jnp.asarray(ql), jnp.asarray(kl), **{**ok, name: 0})
    bad = ql.copy()
    bad[0] = 2  # kv_lens[0] = 1
    with pytest.raises(ValueError, match=r"q_lens must be in \[0, kv_lens\], got rows \[0\]"):
        ragged_paged_attention(*args, jnp.asarray(bad), jnp.asarray(kl), **ok)
    neg = kl.copy()
    neg[0] = -3
    with pytest.raises(ValueError, match=r"kv_lens must be in \[0, .*rows \[0\]: \[-3\]"):
        ragged_paged_attention(*args, jnp.asarray(ql), jnp.asarray(neg), **ok)
    with pytest.raises(ValueError, match="layer must be in"):
        ragged_paged_attention(*args[:3], 5, *args[4:], jnp.asarray(ql), jnp.asarray(kl), **ok)
    with pytest.raises(ValueError, match="q_starts must be"):
        ragged_paged_attention(*args[:5], jnp.asarray(qs[:3]), jnp.asarray(ql), jnp.asarray(kl), **ok)
    with pytest.raises(ValueError, match="k_pool and v_pool"):
        ragged_paged_attention(args[0], args[1], args[2][:, :, :3], *args[3:], jnp.asarray(ql), jnp.asarray(kl), **ok)
    with pytest.raises(ValueError, match="soft_cap"):
        ragged_paged_attention(*args, jnp.asarray(ql), jnp.asarray(kl), **ok, soft_cap=0.0)
    shape = batch_shape(ql, num_seq_rows=len(ql))
    z = jnp.zeros(shape.num_tokens, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(bt), q_starts=jnp.asarray(qs),
                        q_lens=jnp.asarray(ql), kv_lens=jnp.asarray(kl), logits_rows=jnp.zeros(1, jnp.int32),
                        shape=shape)
    qpad = jnp.zeros((shape.num_tokens, *q.shape[1:]))
    for options, needle in ((dict(sliding_window=0), "sliding_window"), (dict(soft_cap=0.0), "soft_cap"),
                            (dict(scale=-1.0), "scale"), (dict(windw=3), "unknown attention options")):
        with pytest.raises(ValueError, match=needle):
            attend(qpad, jnp.asarray(k), jnp.asarray(v), 1, batch, impl="xla", **options)


def test_batch_shape_refuses_bad_lengths():
    for q_lens, needle in (([100, -90], "q_lens must be >= 0"), ([2.7, 1.5], "1-D array of integers"),
                           ([[1, 2]], "1-D array of integers"), ([1] * 5, "more than num_seq_rows=2"),
                           ([2**31], "more than a call can index")):
        with pytest.raises(ValueError, match=needle):
            batch_shape(q_lens, num_seq_rows=2)
    with pytest.raises(ValueError, match="num_seq_rows"):
        batch_shape([1], num_seq_rows=0)
    with pytest.raises(ValueError, match="tiling must be"):
        batch_shape([1], num_seq_rows=2, tiling=None)
    with pytest.raises(ValueError, match="min_tokens must be a power of two"):
        Tiling(min_tokens=3)


def test_attend_refuses_a_shape_that_cannot_hold_the_batch():
    """A hand-built BatchShape with room for fewer chunks than the batch
    carries would drop the extra chunks on the padded kernel path."""
    q, k, v, bt, qs, ql, kl = make_case([2, 2, 2], [4, 4, 4])
    tiling = Tiling(max_prefill_chunks=2, min_tokens=8, prefill_tile_q=4)
    shape = BatchShape(num_tokens=8, num_logits=3, prefill_tiles=4, tiling=tiling)
    z = jnp.zeros(8, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(bt), q_starts=jnp.asarray(qs),
                        q_lens=jnp.asarray(ql), kv_lens=jnp.asarray(kl), logits_rows=jnp.zeros(1, jnp.int32),
                        shape=shape)
    for impl in ("xla", "pallas_ragged"):
        with pytest.raises(ValueError, match="3 chunks of 2\\+ tokens \\(max_prefill_chunks=2\\)"):
            attend(jnp.zeros((8, *q.shape[1:])), jnp.asarray(k), jnp.asarray(v), 0, batch, impl=impl)


def _quantized_case(seed, dtype):
    """MIXED quantized to ``dtype`` (int8 or fp8): NaN in the scales of
    every slot no sequence owns (and in the pages themselves for fp8, which
    has a NaN: kernels must mask values too, not only scales), and the f64
    oracle's dequantized pages."""
    from pallas_kernels.common import dequantize_kv, quantize_kv

    q, k, v, bt, qs, ql, kl = make_case(*MIXED, seed=seed, head_dim=16)
    unowned = np.isnan(k[..., 0])
    (kq, ks), (vq, vs) = (quantize_kv(jnp.nan_to_num(jnp.asarray(x)), dtype) for x in (k, v))
    if jnp.issubdtype(dtype, jnp.floating):
        kq, vq = (jnp.where(unowned[..., None], jnp.nan, x.astype(jnp.float32)).astype(dtype) for x in (kq, vq))
    ks, vs = np.where(unowned, np.nan, ks).astype(np.float32), np.where(unowned, np.nan, vs).astype(np.float32)
    exact_k = np.asarray(dequantize_kv(kq, jnp.asarray(ks)))
    exact_v = np.asarray(dequantize_kv(vq, jnp.asarray(vs)))
    return (q, kq, vq, bt, qs, ql, kl), (jnp.asarray(ks), jnp.asarray(vs)), (exact_k, exact_v)


@pytest.mark.parametrize("impl, dtype", [
    ("xla", jnp.int8), ("pallas_ragged", jnp.int8), ("pallas_gpu", jnp.int8),
    # fp8: the Pallas path by default (its chunks run the ragged kernel); the XLA path's default fp8 test is
    # tests/test_fp8.py's decoder logits (NaN pages through forward_ragged).
    pytest.param("xla", jnp.float8_e4m3fn, marks=pytest.mark.slow), ("pallas_gpu", jnp.float8_e4m3fn),
    pytest.param("xla", jnp.float8_e5m2, marks=pytest.mark.slow),
], ids=lambda x: x if isinstance(x, str) else jnp.dtype(x).name)
def test_quantized_pool_matches_oracle_on_dequantized_pages(impl, dtype):
    """Quantized pages (int8, fp8) with per-token scales (stacked ``[layers,
    K, P, L]``, NaN where nobody owns a slot): attention equals the f64
    oracle over the dequantized pages, through the XLA path and the kernels'
    padded view. The quantization error is not in the comparison, so the
    f32 tolerance holds."""
    (q, kq, vq, bt, qs, ql, kl), (ks, vs), (exact_k, exact_v) = _quantized_case(8, dtype)
    assert kq.dtype == dtype and vq.dtype == dtype
    qpad, batch, n = flat_batch(q, bt, qs, ql, kl)
    got = np.asarray(jax.jit(functools.partial(attend, impl=impl))(jnp.asarray(qpad), kq, vq, 1, batch,
                                                                   k_scales=ks, v_scales=vs))
    want = oracle(q, exact_k[1], exact_v[1], bt, qs, ql, kl)
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    assert np.all(got[n:] == 0)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "float8_e4m3fn"])
def test_quantized_scales_and_page_dtypes_are_checked(dtype):
    (q, kq, vq, bt, qs, ql, kl), (ks, vs), _ = _quantized_case(9, dtype)
    rest = (jnp.asarray(bt), jnp.asarray(qs), jnp.asarray(ql), jnp.asarray(kl))
    args = (jnp.asarray(q), kq, vq, 1, *rest)
    name = jnp.dtype(dtype).name
    with pytest.raises(ValueError, match=f"k_scales and v_scales must be given exactly when k_pool is quantized "
                                         rf"\(int8, float8_e4m3fn, float8_e5m2\), got k_pool {name}"):
        ragged_paged_attention(*args, num_tiles=64)
    with pytest.raises(ValueError, match=r"k_scales must be f32\[2, 2, "):
        ragged_paged_attention(*args, num_tiles=64, k_scales=ks[0], v_scales=vs)
    with pytest.raises(ValueError, match="k_pool and v_pool must share one dtype"):
        ragged_paged_attention(jnp.asarray(q), kq, vq.astype(jnp.float32), 1, *rest, num_tiles=64, k_scales=ks,
                               v_scales=vs)
    # A float8 variant that is not a K/V page dtype (other NaN and zero encodings) is refused by name.
    odd = kq.astype(jnp.float32).astype(jnp.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="k_pool must have a K/V page dtype .*got dtype float8_e4m3fnuz"):
        ragged_paged_attention(jnp.asarray(q), odd, odd, 1, *rest, num_tiles=64, k_scales=ks, v_scales=vs)
