"""The XLA paged attention (and the dispatcher) equals dense causal attention on the same tokens."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.attention.paged import paged_attention, xla_paged_attention, xla_paged_decode_attention
from paged_jax.paging.kv_cache import write_pages
from paged_jax.paging.page_state import NULL_PAGE
from pallas_kernels.common import QUANTIZED_KV_DTYPES, dequantize_kv, quantize_kv


def dense_causal(q, k, v, q_start, soft_cap=None, window=None):
    """Plain attention for one sequence. q: [T, N, H], k, v: [S, K, H];
    query t sits at position q_start + t. Returns [T, N, H] (float64)."""
    t_len, n_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    g = n_heads // kv_heads
    q = q.astype(np.float64).reshape(t_len, kv_heads, g, head_dim)
    logits = np.einsum("TKGH,SKH->KGTS", q, k.astype(np.float64)) / np.sqrt(head_dim)
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    qp = q_start + np.arange(t_len)[:, None]
    kp = np.arange(k.shape[0])[None, :]
    visible = kp <= qp
    if window is not None:
        visible &= kp > qp - window
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("KGTS,SKH->TKGH", p, v.astype(np.float64)).reshape(t_len, n_heads, head_dim)


def build_paged(rng, lens, kv_heads, head_dim, page_size, extra_pages=3):
    """Random K/V for sequences of ``lens`` tokens, scattered over a randomly
    permuted pool; every slot no sequence owns (null page included) is NaN."""
    pages_per_seq = max(1, max(-(-n // page_size) for n in lens))
    needed = sum(-(-n // page_size) for n in lens)
    num_pages = 1 + needed + extra_pages
    perm = rng.permutation(np.arange(1, num_pages))
    k_pages = np.full((kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = k_pages.copy()
    block_tables = np.full((len(lens), pages_per_seq), NULL_PAGE, np.int32)
    ks, vs, c = [], [], 0
    for b, n in enumerate(lens):
        k = rng.normal(size=(n, kv_heads, head_dim)).astype(np.float32)
        v = rng.normal(size=(n, kv_heads, head_dim)).astype(np.float32)
        for j in range(-(-n // page_size)):
            block_tables[b, j] = perm[c]
            c += 1
        for t in range(n):
            k_pages[:, block_tables[b, t // page_size], t % page_size] = k[t]
            v_pages[:, block_tables[b, t // page_size], t % page_size] = v[t]
        ks.append(k)
        vs.append(v)
    return k_pages, v_pages, block_tables, ks, vs


@pytest.mark.parametrize(
    "page_size, kv_heads, group, head_dim", [(4, 1, 1, 8), (4, 3, 3, 16), (8, 2, 4, 8), (16, 3, 3, 64)]
)
def test_prefill_equals_dense(page_size, kv_heads, group, head_dim):
    rng = np.random.default_rng(page_size * 100 + kv_heads * 10 + group)
    lens = [1, page_size - 1, page_size, page_size + 1, 3 * page_size + 2]
    lens = [n for n in lens if n > 0]
    k_pages, v_pages, bt, ks, vs = build_paged(rng, lens, kv_heads, head_dim, page_size)
    t_max = max(lens) + 2  # padding query rows
    q = rng.normal(size=(len(lens), t_max, kv_heads * group, head_dim)).astype(np.float32)
    lens_a = jnp.asarray(lens, jnp.int32)
    out = np.asarray(xla_paged_attention(q, k_pages, v_pages, bt, lens_a, lens_a))
    assert not np.isnan(out).any()
    for b, n in enumerate(lens):
        want = dense_causal(q[b, :n], ks[b], vs[b], 0)
        np.testing.assert_allclose(out[b, :n], want, atol=2e-5, rtol=1e-5)
        assert (out[b, n:] == 0).all()


def test_decode_and_chunked_queries_equal_dense():
    rng = np.random.default_rng(1)
    page_size, kv_heads, group, head_dim = 4, 3, 3, 16
    lens = [1, 3, 4, 5, 9, 17]
    k_pages, v_pages, bt, ks, vs = build_paged(rng, lens, kv_heads, head_dim, page_size)
    lens_a = jnp.asarray(lens, jnp.int32)
    # Decode: the last token of each sequence attends to everything.
    qd = rng.normal(size=(len(lens), kv_heads * group, head_dim)).astype(np.float32)
    out = np.asarray(xla_paged_decode_attention(qd, k_pages, v_pages, bt, lens_a))
    for b, n in enumerate(lens):
        np.testing.assert_allclose(out[b], dense_causal(qd[b][None], ks[b], vs[b], n - 1)[0], atol=2e-5)
    # A chunk: the last min(3, n) tokens of each sequence are queries.
    q_lens = np.minimum(lens, 3).astype(np.int32)
    q = rng.normal(size=(len(lens), 4, kv_heads * group, head_dim)).astype(np.float32)
    out = np.asarray(xla_paged_attention(q, k_pages, v_pages, bt, lens_a, jnp.asarray(q_lens)))
    for b, n in enumerate(lens):
        m = q_lens[b]
        np.testing.assert_allclose(out[b, :m], dense_causal(q[b, :m], ks[b], vs[b], n - m), atol=2e-5)
        assert (out[b, m:] == 0).all()


@pytest.mark.parametrize("soft_cap, window", [(5.0, None), (None, 3), (2.0, 5)])
def test_soft_cap_and_sliding_window(soft_cap, window):
    rng = np.random.default_rng(2)
    lens = [2, 7, 12]
    k_pages, v_pages, bt, ks, vs = build_paged(rng, lens, 2, 8, 4)
    q = rng.normal(size=(3, 12, 4, 8)).astype(np.float32) * 3
    la = jnp.asarray(lens, jnp.int32)
    out = np.asarray(xla_paged_attention(q, k_pages, v_pages, bt, la, la, soft_cap=soft_cap, sliding_window=window))
    for b, n in enumerate(lens):
        want = dense_causal(q[b, :n], ks[b], vs[b], 0, soft_cap=soft_cap, window=window)
        np.testing.assert_allclose(out[b, :n], want, atol=2e-5, rtol=1e-5)


def test_zero_length_sequence_gives_zeros():
    rng = np.random.default_rng(3)
    k_pages, v_pages, bt, _, _ = build_paged(rng, [5], 1, 8, 4)
    bt = np.concatenate([bt, np.zeros_like(bt)])  # second sequence: empty, null page
    q = rng.normal(size=(2, 8)).reshape(2, 1, 8).astype(np.float32)
    out = np.asarray(xla_paged_decode_attention(q, k_pages, v_pages, bt, jnp.asarray([5, 0], jnp.int32)))
    assert (out[1] == 0).all() and not np.isnan(out).any()


def test_write_pages_through_slot_mapping():
    pages = jnp.zeros((2, 3, 4, 1))  # K=2, P=3, L=4, H=1
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(3, 2, 1)  # 3 tokens
    slots = jnp.asarray([5, -1, 11])  # page 1 offset 1; padding; page 2 offset 3
    out = np.asarray(write_pages(pages, new, slots))
    assert out[:, 1, 1, 0].tolist() == [1, 2] and out[:, 2, 3, 0].tolist() == [5, 6]
    assert np.count_nonzero(out) == 4  # the padding token wrote nothing


@pytest.mark.parametrize(
    "shapes, needle",
    [
        (dict(q=(2, 1, 6, 8), k=(4, 5, 4, 8)), "multiple of num_kv_heads"),
        (dict(q=(2, 1, 6, 8), k=(3, 5, 4, 16)), "head_dim"),
        (dict(q=(2, 6, 8), k=(3, 5, 4, 8)), "q must be"),
        (dict(q=(2, 1, 6, 8), k=(3, 5, 4, 8), bt=(3, 2)), "block_tables"),
        (dict(q=(2, 1, 6, 8), k=(3, 5, 4, 8), lens=(3,)), "kv_lens"),
    ],
)
def test_bad_inputs_are_named(shapes, needle):
    q = jnp.zeros(shapes["q"])
    k = jnp.zeros(shapes["k"])
    bt = jnp.zeros(shapes.get("bt", (2, 2)), jnp.int32)
    lens = jnp.ones(shapes.get("lens", (2,)), jnp.int32)
    with pytest.raises(ValueError, match=needle):
        paged_attention(q, k, k, bt, lens, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        paged_attention(jnp.zeros((2, 1, 6, 8)), jnp.zeros((3, 5, 4, 8)), jnp.zeros((3, 5, 4, 8)),
                        jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones((2,), jnp.int32),
                        impl="cuda-magic")


def test_dispatch_auto_matches_the_xla_path():
    rng = np.random.default_rng(4)
    lens = [3, 9]
    k_pages, v_pages, bt, _, _ = build_paged(rng, lens, 3, 8, 4)
    q = rng.normal(size=(2, 9, 9, 8)).astype(np.float32)
    la = jnp.asarray(lens, jnp.int32)
    for a, b in itertools.combinations(
        [xla_paged_attention(q, k_pages, v_pages, bt, la, la), paged_attention(q, k_pages, v_pages, bt, la, la)], 2
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(soft_cap=0.0), "soft_cap"),
        (dict(scale=float("nan")), "scale"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(k_scales=jnp.ones((3, 5, 4))), "k_scales and v_scales"),
    ],
)
def test_bad_options_are_named_on_every_path(kwargs, needle):
    args = (jnp.zeros((2, 1, 6, 8)), jnp.zeros((3, 5, 4, 8)), jnp.zeros((3, 5, 4, 8)),
            jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones((2,), jnp.int32))
    for impl in ("auto", "xla", "xla_loop"):
        with pytest.raises(ValueError, match=needle):
            paged_attention(*args, impl=impl, **kwargs)


@pytest.mark.parametrize("dtype", QUANTIZED_KV_DTYPES, ids=lambda d: d.name)
def test_quantized_pages_need_scales_and_integer_q_is_refused(dtype):
    pages = jnp.zeros((3, 5, 4, 8), dtype)
    bt, lens = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match=f"k_scales and v_scales must be given exactly when k_pages is quantized "
                                         rf".* got k_pages {dtype.name}, k_scales None"):
        paged_attention(jnp.zeros((2, 1, 6, 8)), pages, pages, bt, lens, lens)
    with pytest.raises(ValueError, match="q must be a float"):
        paged_attention(jnp.zeros((2, 1, 6, 8), jnp.int32), jnp.zeros((3, 5, 4, 8)), jnp.zeros((3, 5, 4, 8)), bt, lens, lens)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fnuz, jnp.int4, jnp.uint8], ids=lambda d: jnp.dtype(d).name)
def test_pages_of_other_dtypes_are_refused_by_name(dtype):
    """Not one of common.KV_DTYPES: refused whether scales come or not."""
    pages = jnp.zeros((3, 5, 4, 8), dtype)
    bt, lens, scales = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones((3, 5, 4))
    for extra in (dict(), dict(k_scales=scales, v_scales=scales)):
        with pytest.raises(ValueError, match=f"k_pages must have a K/V page dtype .*got dtype {jnp.dtype(dtype)}"):
            paged_attention(jnp.zeros((2, 1, 6, 8)), pages, pages, bt, lens, lens, impl="xla", **extra)


@pytest.mark.parametrize("dtype", QUANTIZED_KV_DTYPES, ids=lambda d: d.name)
def test_quantized_pages_equal_dense_on_dequantized_kv(dtype):
    """The XLA path (which dequantizes the layer, then attends) on int8 or
    fp8 pages equals dense attention over the dequantized K/V, to f32
    precision; NaN scales (and NaN fp8 pages) wherever no sequence owns a
    slot."""
    rng = np.random.default_rng(7)
    lens = [1, 4, 5, 14]
    k_pages, v_pages, bt, _, _ = build_paged(rng, lens, 2, 16, 4)
    unowned = np.isnan(k_pages[..., 0])
    (kq, ks), (vq, vs) = (quantize_kv(jnp.nan_to_num(jnp.asarray(x)), dtype) for x in (k_pages, v_pages))
    ks, vs = (jnp.where(unowned, jnp.nan, s) for s in (ks, vs))
    if jnp.issubdtype(dtype, jnp.floating):
        kq, vq = (jnp.where(unowned[..., None], jnp.nan, x.astype(jnp.float32)).astype(dtype) for x in (kq, vq))
    k_exact, v_exact = np.asarray(dequantize_kv(kq, ks)), np.asarray(dequantize_kv(vq, vs))  # [K, P, L, H]
    q = rng.normal(size=(len(lens), max(lens), 4, 16)).astype(np.float32)
    la = jnp.asarray(lens, jnp.int32)
    out = np.asarray(paged_attention(q, kq, vq, bt, la, la, impl="xla", k_scales=ks, v_scales=vs))
    for b, n in enumerate(lens):
        pos = np.arange(n)
        pages, offsets = bt[b, pos // 4], pos % 4
        k, v = (x[:, pages, offsets].swapaxes(0, 1) for x in (k_exact, v_exact))  # [S, K, H]
        np.testing.assert_allclose(out[b, :n], dense_causal(q[b, :n], k, v, 0), atol=2e-5, rtol=1e-5)
        assert (out[b, n:] == 0).all()


LEAK_IMPLS = ["xla", "xla_loop", "pallas_gpu", "pallas_ragged"]  # pallas_tpu: TPU interpret mode, slow


def leak_case():
    """Two sequences of 20 tokens in 2-page rows of page 16; the null page
    and every page no row owns hold NaN."""
    r = np.random.default_rng(0)
    k = r.normal(size=(1, 8, 16, 64)).astype(np.float32)
    v = r.normal(size=(1, 8, 16, 64)).astype(np.float32)
    bt = np.array([[1, 2], [3, 4]], np.int32)
    q = jnp.asarray(r.normal(size=(2, 1, 3, 64)), jnp.float32)
    return q, k, v, jnp.asarray(bt)


@pytest.mark.parametrize("impl", LEAK_IMPLS)
@pytest.mark.parametrize("kv_lens", [[64, 20], [1000, 20], [-1, 20]])
def test_lengths_past_the_row_are_refused_eagerly(impl, kv_lens):
    q, k, v, bt = leak_case()
    with pytest.raises(ValueError, match=r"kv_lens must be in \[0, pages_per_seq \* page_size = 32\].*rows \[0\]"):
        paged_attention(q, jnp.asarray(k), jnp.asarray(v), bt, jnp.asarray(kv_lens, jnp.int32),
                        jnp.asarray([1, 1], jnp.int32), impl=impl)
    with pytest.raises(ValueError, match=r"q_lens must be in \[0, kv_lens\]"):
        paged_attention(q, jnp.asarray(k), jnp.asarray(v), bt, jnp.asarray([20, 20], jnp.int32),
                        jnp.asarray([1, 21], jnp.int32), impl=impl)


@pytest.mark.parametrize("impl", LEAK_IMPLS)
def test_lengths_past_the_row_never_read_other_pages_under_jit(impl):
    """Under jit the lengths cannot be checked; they are clamped to the
    row, so row 0's output ignores every page it does not own (the null
    page and the other row's pages change; row 0 stays bit-identical)."""
    q, k, v, bt = leak_case()
    fn = jax.jit(lambda k, v, kl: paged_attention(q, k, v, bt, kl, jnp.asarray([1, 1], jnp.int32), impl=impl))
    kl = jnp.asarray([64, 20], jnp.int32)
    base = np.asarray(fn(jnp.asarray(k), jnp.asarray(v), kl))
    k2, v2 = k.copy(), v.copy()
    for p in (0, 3, 4, 5, 6, 7):
        k2[:, p] = 1e3
        v2[:, p] = -1e3
    other = np.asarray(fn(jnp.asarray(k2), jnp.asarray(v2), kl))
    np.testing.assert_array_equal(base[0], other[0])
    assert np.isfinite(base).all()


def test_kernel_entry_points_refuse_and_clamp_lengths_too():
    """Called directly, not through paged_attention, each kernel's public
    function refuses eagerly and clamps under jit as well."""
    from pallas_kernels import paged_attention_cpu, paged_attention_gpu, ragged_paged_attention

    q, k, v, bt = leak_case()
    k, v = jnp.asarray(k), jnp.asarray(v)
    bad = jnp.asarray([64, 20], jnp.int32)
    decode = (paged_attention_cpu.paged_attention_cpu, paged_attention_gpu.paged_attention_gpu)
    for kernel in decode:
        with pytest.raises(ValueError, match="kv_lens must be in"):
            kernel(q[:, 0], k, v, bt, bad)
        out = jax.jit(lambda k, kl: kernel(q[:, 0], k, v, bt, kl))(k, bad)
        k2 = k.at[:, 3:].set(1e3).at[:, 0].set(1e3)
        out2 = jax.jit(lambda k, kl: kernel(q[:, 0], k, v, bt, kl))(k2, bad)
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(out2[0]))
    with pytest.raises(ValueError, match="kv_lens must be in"):
        ragged_paged_attention.ragged_paged_attention(q, k, v, bt, bad, jnp.asarray([1, 1], jnp.int32))


@pytest.mark.parametrize("impl", LEAK_IMPLS)
def test_query_rows_and_page_ids_are_checked(impl):
    """q_lens above the T query rows, and page ids outside the pool, are
    refused eagerly by every implementation."""
    q, k, v, bt = leak_case()  # T = 1, 8 pages
    k, v = jnp.asarray(k), jnp.asarray(v)
    with pytest.raises(ValueError, match=r"q_lens must be in \[0, kv_lens\] and <= T=1"):
        paged_attention(q, k, v, bt, jnp.asarray([20, 20], jnp.int32), jnp.asarray([2, 1], jnp.int32), impl=impl)
    with pytest.raises(ValueError, match=r"page ids in \[0, num_pages=8\), got block_tables\[0, 1\] = 99"):
        paged_attention(q, k, v, jnp.asarray([[1, 99], [3, 4]], jnp.int32), jnp.asarray([20, 20], jnp.int32),
                        jnp.asarray([1, 1], jnp.int32), impl=impl)
